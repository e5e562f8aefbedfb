"""What a run ran on and how fast: the device, dtype, attention and world size once per run
(``<run>/run_info.json``), and per step verl's ``perf/*`` figures.

Per step (``PerfMeter.step_metrics``, added to the step's metrics row):

- ``perf/max_memory_allocated_gb`` and ``perf/max_memory_reserved_gb``: on CUDA, this process's peak
  of ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` during the step (the peak is reset
  after each reading), GiB. On the CPU both are the process's peak resident set size since it started
  (``getrusage``'s ``ru_maxrss``; it never goes down), GiB: torch has no allocator statistics there.
- ``perf/throughput``: this process's tokens a second for text (prompt plus response tokens of the
  step's samples, verl's per-GPU figure), images a second for diffusion (samples / step time).
- ``perf/mfu`` (text): model FLOPs utilisation, estimated as PaLM does (https://arxiv.org/abs/2204.02311,
  appendix B) with attention left out: ``2 N`` FLOPs a token to generate it (or read its prompt) and
  ``6 N`` a token for each epoch of forward and backward, N the model's parameters (a LoRA's frozen
  weights count: their forward and input gradients run), over the step time and the device's dense
  peak for the compute dtype. The old and reference log-prob passes are not counted, so it understates
  the work. Only where the peak is known (``PEAK_TFLOPS``, or ``UNIRL_PEAK_TFLOPS`` in the
  environment); on the CPU it is left out rather than guessed.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any, Optional

import torch

GIB = 1024 ** 3

#: Dense peak TFLOP/s by device-name fragment and compute dtype, from the vendors' datasheets (SXM parts;
#: float32 is the plain, non-TF32 rate that torch uses unless TF32 is allowed).
PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.1, "float16": 362.1, "float32": 91.6},
    "A10G": {"bfloat16": 70.0, "float16": 70.0, "float32": 31.2},
}


def peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """The device's dense peak for ``dtype``: ``UNIRL_PEAK_TFLOPS`` when set, else ``PEAK_TFLOPS``, else None."""
    if os.environ.get("UNIRL_PEAK_TFLOPS"):
        return float(os.environ["UNIRL_PEAK_TFLOPS"])
    for fragment, rates in PEAK_TFLOPS.items():
        if fragment in device_name:
            return rates.get(dtype)
    return None


def _compute_dtype(accelerator, model: torch.nn.Module) -> str:
    """bf16/fp16 under Accelerate's mixed precision, else the dtype most of the parameters have."""
    mixed = {"bf16": "bfloat16", "fp16": "float16"}.get(str(accelerator.mixed_precision))
    if mixed:
        return mixed
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return str(max(counts, key=counts.get)).removeprefix("torch.") if counts else "unknown"


def _attention(model: torch.nn.Module) -> str:
    """transformers' ``config._attn_implementation``; diffusers' models name no such key ("default")."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "default")


class PerfMeter:
    """Reads the figures above for one run; ``start`` writes ``run_info.json`` on the main process."""

    def __init__(self, accelerator, model: torch.nn.Module, ppo_epochs: int = 1):
        self.device = accelerator.device
        self.cuda = self.device.type == "cuda"
        self.device_name = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"
        self.dtype = _compute_dtype(accelerator, accelerator.unwrap_model(model))
        self.parameters = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
        self.ppo_epochs = ppo_epochs
        self.info = {"device": self.device_name, "device_type": self.device.type, "dtype": self.dtype,
                     "attn_implementation": _attention(accelerator.unwrap_model(model)),
                     "world_size": accelerator.num_processes, "parameters": self.parameters,
                     "torch": torch.__version__, "peak_tflops": peak_tflops(self.device_name, self.dtype)}

    @classmethod
    def start(cls, accelerator, model: torch.nn.Module, run_dir: Path, ppo_epochs: int = 1) -> "PerfMeter":
        meter = cls(accelerator, model, ppo_epochs)
        if accelerator.is_main_process:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "run_info.json").write_text(json.dumps(meter.info, indent=1) + "\n")
        if meter.cuda:
            torch.cuda.reset_peak_memory_stats(meter.device)  # the first step's peak, not set-up's
        return meter

    def memory_gb(self) -> tuple[float, float]:
        """(allocated, reserved) peaks in GiB, and a new peak window on CUDA (module docstring)."""
        if self.cuda:
            out = torch.cuda.max_memory_allocated(self.device) / GIB, torch.cuda.max_memory_reserved(self.device) / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
            return out
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: kilobytes
        return rss, rss

    def step_metrics(self, rollout: Any, seconds: float) -> dict[str, float]:
        """The ``perf/*`` figures of one step of ``seconds`` over ``rollout`` (text: its masks; else images)."""
        allocated, reserved = self.memory_gb()
        out = {"perf/max_memory_allocated_gb": allocated, "perf/max_memory_reserved_gb": reserved}
        seconds = max(seconds, 1e-9)
        tensors = getattr(rollout, "tensors", {})
        if "response_mask" in tensors and "prompt_mask" in tensors:
            prompt = float(tensors["prompt_mask"].sum())
            # Every real response token: a multi-turn rollout's loss mask leaves out the tool's observations.
            response = float(tensors.get("response_attention_mask", tensors["response_mask"]).sum())
            out["perf/throughput"] = (prompt + response) / seconds
            peak = self.info["peak_tflops"]
            if peak:
                flops = 2 * self.parameters * (prompt + response) * (1 + 3 * self.ppo_epochs)
                out["perf/mfu"] = flops / (seconds * peak * 1e12)
        else:
            out["perf/throughput"] = len(rollout) / seconds
        return out
