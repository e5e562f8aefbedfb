"""The run's device record and the per-step ``perf/*`` figures (unirl/trainer/perf.py), on whatever device runs."""

from __future__ import annotations

import json

import pytest
import torch

from unirl.env import Rollout
from unirl.trainer.perf import PerfMeter, peak_tflops


class _Accelerator:
    """What PerfMeter reads of Accelerate's: the device, the precision, the world, the main process."""

    def __init__(self, device: str, mixed_precision: str = "no"):
        self.device, self.mixed_precision = torch.device(device), mixed_precision
        self.num_processes, self.is_main_process = 1, True

    @staticmethod
    def unwrap_model(model):
        return model


def _text_rollout(prompt_tokens: list[int], response_tokens: list[int]) -> Rollout:
    P, R = max(prompt_tokens), max(response_tokens)
    prompt = torch.tensor([[0] * (P - p) + [1] * p for p in prompt_tokens])
    response = torch.tensor([[1.0] * r + [0.0] * (R - r) for r in response_tokens])
    return Rollout(tensors={"prompt_mask": prompt, "response_mask": response}, group_ids=torch.arange(len(prompt_tokens)),
                   prompts=[""] * len(prompt_tokens), samples=[""] * len(prompt_tokens))


def test_text_throughput_and_mfu_follow_the_token_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRL_PEAK_TFLOPS", "2")  # a known peak, so the CPU gets an MFU here
    model = torch.nn.Linear(10, 10)  # 110 parameters
    meter = PerfMeter.start(_Accelerator("cpu"), model, tmp_path, ppo_epochs=2)
    rollout = _text_rollout([3, 5], [4, 2])  # 8 prompt + 6 response tokens
    out = meter.step_metrics(rollout, seconds=0.5)
    assert out["perf/throughput"] == pytest.approx(14 / 0.5)
    # 2 N per token generated or read, 6 N per token per epoch: 2 * 110 * 14 * (1 + 3 * 2) FLOPs in 0.5 s.
    assert out["perf/mfu"] == pytest.approx(2 * 110 * 14 * 7 / (0.5 * 2e12))
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["world_size"] == 1
    assert info["parameters"] == 110 and info["attn_implementation"] == "default"
    # The CPU's figure is the process's peak resident set: positive, and both keys the same.
    assert out["perf/max_memory_allocated_gb"] == out["perf/max_memory_reserved_gb"] > 0


def test_images_a_second_and_no_guessed_peak_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("UNIRL_PEAK_TFLOPS", raising=False)
    meter = PerfMeter(_Accelerator("cpu", mixed_precision="bf16"), torch.nn.Linear(2, 2))
    assert meter.dtype == "bfloat16"
    images = Rollout(tensors={"latents": torch.zeros(4, 2)}, group_ids=torch.arange(4), prompts=[""] * 4, samples=[None] * 4)
    out = meter.step_metrics(images, seconds=2.0)
    assert out["perf/throughput"] == pytest.approx(2.0)
    assert "perf/mfu" not in out


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4)
    assert peak_tflops("NVIDIA H200", "float32") == pytest.approx(66.9)
    assert peak_tflops("cpu", "float32") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's allocator statistics need a GPU")
def test_cuda_peak_memory_is_the_steps(tmp_path):
    meter = PerfMeter(_Accelerator("cuda"), torch.nn.Linear(2, 2).cuda())
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(256 * 1024 ** 2, dtype=torch.uint8, device="cuda")  # 0.25 GiB
    del x
    first = meter.step_metrics(_text_rollout([1], [1]), 1.0)
    second = meter.step_metrics(_text_rollout([1], [1]), 1.0)
    assert first["perf/max_memory_allocated_gb"] >= 0.25
    assert second["perf/max_memory_allocated_gb"] < 0.25  # the peak was reset after the first reading
