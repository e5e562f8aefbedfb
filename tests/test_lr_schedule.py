"""LR schedules (unirl/trainer/optim.py): values by hand, verl's cosine re-typed, the config checks, and the
schedule continuing where it stopped after a resume (a real run on the tiny model, unirl.train: the CLI's path)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import unirl
from unirl.trainer.optim import build_scheduler, lr_factor
from unirl.config.schema import OptimConfig


def _lrs(cfg: OptimConfig, total: int, steps: int, resume_at: int | None = None) -> list[float]:
    """The LR each of ``steps`` optimizer steps runs at; with ``resume_at`` the optimizer and the
    scheduler are rebuilt from their state_dicts at that step, as a resumed run does."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps=total)
    out = []
    for s in range(steps):
        if s == resume_at:
            states = opt.state_dict(), sched.state_dict()
            opt = torch.optim.AdamW([param], lr=cfg.lr)
            sched = build_scheduler(opt, cfg, total_steps=total)
            opt.load_state_dict(states[0])
            sched.load_state_dict(states[1])
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_values_by_hand():
    # constant with 4 warm-up steps: 0, 1/4, 2/4, 3/4, then 1.
    assert _lrs(OptimConfig(lr=1.0, warmup_steps=4), None, 6) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    # linear, 2 warm-up of 10: 0, 1/2, then 1 - (s - 2) / 8 down to 0 at step 10.
    lin = _lrs(OptimConfig(lr=1.0, warmup_steps=2, lr_scheduler="linear"), 10, 11)
    assert lin == pytest.approx([0, 0.5, 1, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0])
    # cosine to 0.1 over 4 steps, no warm-up: 0.1 + 0.9 * (1 + cos(pi s / 4)) / 2.
    cos = _lrs(OptimConfig(lr=2.0, lr_scheduler="cosine", min_lr_ratio=0.1), 4, 5)
    half = 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2
    assert cos == pytest.approx([2.0, 2 * half, 2 * 0.55, 2 * (1.1 - half), 0.2])
    # warm-up by ratio: int(0.25 * 10) = 2 steps (verl's rounding).
    assert _lrs(OptimConfig(lr=1.0, warmup_ratio=0.25), 10, 3) == [0.0, 0.5, 1.0]


def _verl_cosine(step, warmup, total, min_lr_ratio, num_cycles=0.5):
    """verl ``get_cosine_schedule_with_warmup``'s lambda (init_lr_ratio 0)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    x = math.cos(math.pi * num_cycles * 2.0 * progress)
    return max(min_lr_ratio, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)


def _hf_linear(step, warmup, total):
    """transformers ``get_linear_schedule_with_warmup``'s lambda (TRL's default schedule)."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_against_verls_cosine_and_transformers_linear(seed):
    g = torch.Generator().manual_seed(seed)
    total = int(torch.randint(5, 200, (1,), generator=g))
    warmup = int(torch.randint(0, total // 2, (1,), generator=g))
    min_ratio = float(torch.rand(1, generator=g)) * 0.5
    for s in range(total + 3):  # past the end too: cosine holds min, linear holds 0
        assert lr_factor(s, kind="cosine", warmup=warmup, total=total, min_ratio=min_ratio) == pytest.approx(
            _verl_cosine(s, warmup, total, min_ratio), abs=1e-12)
        assert lr_factor(s, kind="linear", warmup=warmup, total=total) == pytest.approx(
            _hf_linear(s, warmup, total), abs=1e-12)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_a_resumed_scheduler_continues_the_same_values(kind):
    cfg = OptimConfig(lr=1e-3, lr_scheduler=kind, warmup_steps=3, min_lr_ratio=0.2)
    assert _lrs(cfg, 12, 12, resume_at=5) == _lrs(cfg, 12, 12)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="warmup_steps and optim.warmup_ratio"):
        OptimConfig(warmup_steps=2, warmup_ratio=0.1)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        OptimConfig(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="warmup_ratio"):
        OptimConfig(warmup_ratio=1.0)
    param = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="lr_scheduler=cosine needs"):
        build_scheduler(torch.optim.AdamW([param]), OptimConfig(lr_scheduler="cosine"))


@pytest.mark.slow
def test_a_killed_and_resumed_run_logs_the_uninterrupted_lrs(tmp_path, tiny_lm_dir):
    """4 steps, 2 optimizer steps each (two mini-batches), cosine after 2 warm-up steps; the step-4
    checkpoint removed as if the run died after step 2's: the resumed steps log the same LRs."""
    args = ["rollout.engine=hf", "rollout.max_new_tokens=4", "trainer.total_steps=4", "trainer.prompts_per_step=2",
            "trainer.group_size=4", "trainer.mini_batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0",
            "trainer.save_every=2", "trainer.progress=false", "optim.lr_scheduler=cosine", "optim.warmup_steps=2",
            "optim.min_lr_ratio=0.1", "optim.lr=1e-3"]
    out = tmp_path / "run"

    def train(*extra):
        # In this process: the CLI's own path (unirl.train), without a Python and torch start-up per run.
        unirl.train("text", "tiny", [*args, *extra], output_dir=out, progress=False)
        return {r["step"]: r["actor/lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "actor/lr" in r}

    whole = train()
    # actor/lr is the LR after the step's 2 optimizer steps: factor(2 * step) of 8.
    assert [whole[s] for s in (1, 2, 3, 4)] == pytest.approx(
        [1e-3 * _verl_cosine(2 * s, 2, 8, 0.1) for s in (1, 2, 3, 4)], rel=1e-9)
    shutil.rmtree(out / "checkpoints" / "step_000004")
    resumed = train("trainer.resume=true")
    assert resumed == whole
