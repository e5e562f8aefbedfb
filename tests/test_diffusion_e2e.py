"""The tiny FlowGRPO demo end to end through the CLI: the reward rises, the LoRA trains, artefacts exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_stopped_after

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


def _train_here(run: Path, *overrides: str) -> list[dict]:
    """``_train`` in this process: the CLI's own path (``unirl.train``), without a Python and torch start-up
    for each run (the resume-exactness test below keeps separate processes, as a preempted run has)."""
    import unirl

    unirl.train("diffusion", "tiny", ["data.eval_size=4", *overrides], output_dir=run, progress=False)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    # LoRA with the KL to the adapter-disabled reference, CFG in training, a Fast window, scoring threads.
    ("algo.kl_coef=0.04", "kl_form=exact", "sampling.guidance_scale=2.0", "sampling.train_cfg=true",
     "sampling.sde_window.size=3", "sampling.timestep_fraction=0.7", "trainer.reward_workers=1",
     "trainer.mini_batch_size=16", "trainer.micro_batch_size=8"),
    # Full fine-tuning with a frozen reference copy.
    ("model.lora.enabled=false", "algo.kl_coef=0.04", "optim.lr=1e-4"),
])
def test_variants_train_and_resume(tmp_path, options):
    run = tmp_path / "run"
    rows = _train_here(run, "trainer.total_steps=2", "trainer.eval_every=0", *options)
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 2
    assert all(torch.isfinite(torch.tensor([r["loss/kl"], r["loss/total"]])).all() for r in train)
    assert train[0]["loss/kl"] == 0.0 or train[0]["loss/kl"] < 1e-6  # first update: policy == reference
    assert train[1]["loss/kl"] > 0  # after one update the policy moved away from the reference
    # A pickle planted where Accelerate kept the EMA (custom_checkpoint_0.pkl, loaded with
    # weights_only=False) and its other pickles: resume reads only safetensors and JSON, never these.
    marker = tmp_path / "pwned"
    payload = b"cbuiltins\nopen\n(S'" + str(marker).encode() + b"'\nS'w'\ntR."  # open(marker, "w") when unpickled
    state = run / "checkpoints" / "step_000002" / "trainer_state"
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "scaler.pt", "pytorch_model.bin"):
        (state / name).write_bytes(payload)
    # Resume continues from the saved step with the EMA and optimizer state.
    rows = _train_here(run, "trainer.total_steps=3", "trainer.eval_every=0", "trainer.resume=true", *options)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    assert not marker.exists()
    assert (run / "checkpoints" / "step_000003").exists()


@pytest.mark.slow
def test_branched_mixgrpo_run_resumes_exactly(tmp_path):
    """A sliding window that moves every step (its position a function of the step), branching and
    DPM-Solver++(2M) after the window: a run stopped after step 2 and resumed logs the uninterrupted
    run's step 3 to the bit, and every update is on-policy (ratio 1)."""
    options = ("sampling.sde_window.size=2", "sampling.sde_window.range=[0,6]", "sampling.sde_window.schedule=progressive",
               "sampling.sde_window.shift_interval=1", "sampling.sde_window.stride=2", "sampling.branch_prefix=true",
               "sampling.same_noise_per_group=true", "sampling.ode_solver=dpm2m", "trainer.eval_every=0",
               "trainer.prompts_per_step=4", "trainer.mini_batch_size=16", "trainer.micro_batch_size=16",
               "trainer.save_every=2")
    whole = [r for r in _train(tmp_path / "whole", "trainer.total_steps=3", *options) if "reward/mean" in r]
    cut = run_stopped_after(tmp_path / "whole", 2, tmp_path / "cut")
    resumed = [r for r in _train(cut, "trainer.total_steps=3", "trainer.resume=true", *options) if "reward/mean" in r]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [r["rollout/window_start"] for r in whole] == [0, 2, 4]
    # The branched prefix: 4 prompts x 4 members, 8 steps, the window at k = 0, 2, 4.
    assert [r["rollout/transformer_calls"] for r in whole] == [4 * k + 16 * (8 - k) for k in (0, 2, 4)]
    last = resumed[-1]
    assert last["step"] == 3
    for key, value in whole[-1].items():
        if not key.startswith(("time/", "perf/")):
            assert last[key] == value, key
    for r in whole:
        assert abs(r["actor/ratio_max"] - 1) < 1e-6 and abs(r["actor/ratio_min"] - 1) < 1e-6


def test_every_way_of_naming_an_image_reward_in_a_run(tmp_path):
    """A registered name, a file.py:function, a package.module:function and an installed package's
    ``unirl.rewards`` entry point, in one short tiny diffusion run; each is logged."""
    import os

    import yaml

    site = tmp_path / "site"
    (site / "img_plugin").mkdir(parents=True)
    (site / "img_plugin" / "__init__.py").write_text(
        "def redness(images, **kwargs):\n"
        "    return [sum(p[0] for p in im.convert('RGB').getdata()) / (255.0 * im.width * im.height) for im in images]\n\n"
        "def is_square(images, **kwargs):\n    return [float(im.width == im.height) for im in images]\n"
    )
    info = site / "img_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: img-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[unirl.rewards]\nimg_square = img_plugin:is_square\n")
    (tmp_path / "my_reward.py").write_text("def half(images, *, prompts, **kwargs):\n    return [0.5] * len(images)\n")
    config = tmp_path / "run.yaml"
    base = yaml.safe_load((REPO / "configs" / "diffusion" / "tiny.yaml").read_text())
    config.write_text(yaml.safe_dump({
        **base,
        "rewards": [
            {"name": "brightness"},
            {"name": f"{tmp_path / 'my_reward.py'}:half", "weight": 0.5},
            {"name": "img_plugin:redness", "weight": 0.25},
            {"name": "img_square", "weight": 0.25},
        ],
        "trainer": {**base["trainer"], "total_steps": 2, "prompts_per_step": 4, "group_size": 4,
                    "mini_batch_size": 16, "micro_batch_size": 16, "eval_every": 0, "progress": False,
                    "reward_workers": 1},
        # Two chunks: the first is scored in the reward thread while the second samples, the second
        # when the step asks for the rewards; every reward sees both.
        "sampling": {**base["sampling"], "chunk_size": 8},
    }))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "diffusion", "--config", str(config),
                           "--output-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for m in rows:
        assert m["reward/half"] == 0.5 and m["reward/img_square"] == 1.0
        assert 0 < m["reward/brightness"] < 1 and 0 < m["reward/redness"] < 1
        expected = m["reward/brightness"] + 0.5 * 0.5 + 0.25 * m["reward/redness"] + 0.25
        assert m["reward/mean"] == pytest.approx(expected, abs=1e-5)
