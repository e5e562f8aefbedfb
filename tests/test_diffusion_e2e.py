"""The tiny FlowGRPO demo end to end through the CLI: the reward rises, the LoRA trains, artefacts exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_diffusion_run_learns_and_saves(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", "diffusion", "--config", "tiny", "--output-dir", str(run),
         "trainer.progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 60
    rewards = [r["reward/mean"] for r in train]
    assert all(0 <= x <= 1 for x in rewards)
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.1, (first, last)
    # On-policy: one mini-batch per rollout, so every ratio of the update is 1 (up to float noise
    # from the shuffled micro-batch layout).
    for r in train:
        assert abs(r["actor/ratio_max"] - 1) < 1e-4 and abs(r["actor/ratio_min"] - 1) < 1e-4
    for key in ("actor/clip_frac", "actor/approx_kl", "adv/zero_std_frac", "reward/brightness", "time/rollout",
                "time/update", "time/step"):
        assert key in train[-1], key
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]
    assert evals[-1]["eval/reward/brightness"] > evals[0]["eval/reward/brightness"]
    for step in (0, 30, 60):
        assert (run / "eval" / f"step_{step:06d}.png").exists()
    # The LoRA checkpoint: diffusers format, and trained (LoRA B starts at zero).
    from safetensors.torch import load_file

    lora = load_file(run / "checkpoints" / "step_000060" / "pytorch_lora_weights.safetensors")
    assert all(k.startswith("transformer.") for k in lora)
    b = [v for k, v in lora.items() if "lora_B" in k]
    assert b and sum(float(v.abs().sum()) for v in b) > 0
    assert (run / "checkpoints" / "step_000060" / "trainer_state" / "loop.json").exists()
    assert torch.isfinite(torch.tensor([r["loss/total"] for r in train])).all()


def _train(run: Path, *overrides: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", "diffusion", "--config", "tiny", "--output-dir", str(run),
         "trainer.progress=false", "data.eval_size=4", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    # LoRA with the KL to the adapter-disabled reference, CFG in training, a Fast window, scoring threads.
    ("algo.kl_coef=0.04", "kl_form=dt_scaled", "sampling.guidance_scale=2.0", "sampling.train_cfg=true",
     "sampling.sde_window.size=3", "sampling.timestep_fraction=0.7", "trainer.reward_workers=1",
     "trainer.mini_batch_size=16", "trainer.micro_batch_size=8"),
    # Full fine-tuning with a frozen reference copy.
    ("model.lora.enabled=false", "algo.kl_coef=0.04", "optim.lr=1e-4"),
])
def test_variants_train_and_resume(tmp_path, options):
    run = tmp_path / "run"
    rows = _train(run, "trainer.total_steps=2", "trainer.eval_every=0", *options)
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 2
    assert all(torch.isfinite(torch.tensor([r["loss/kl"], r["loss/total"]])).all() for r in train)
    assert train[0]["loss/kl"] == 0.0 or train[0]["loss/kl"] < 1e-6  # first update: policy == reference
    assert train[1]["loss/kl"] > 0  # after one update the policy moved away from the reference
    # Resume continues from the saved step with the EMA and optimizer state.
    rows = _train(run, "trainer.total_steps=3", "trainer.eval_every=0", "trainer.resume=true", *options)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    assert (run / "checkpoints" / "step_000003").exists()
