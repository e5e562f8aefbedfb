"""Numeric settings outside their valid range stop the run at load (and in the dry run), naming the key.

Each of these was accepted before and trained wrongly without a word: ``optim.max_grad_norm=-1``
reverses the gradient, ``0`` freezes training, ``algo.adv_clip=-1`` makes every advantage -1, and a
group estimator with ``group_size=1`` trains on all-zero advantages.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from unirl.cli import load_run_config
from unirl.config import ConfigError

REPO = Path(__file__).resolve().parents[1]

BAD = [
    ("optim.max_grad_norm=-1", "optim: max_grad_norm must be > 0 or null, got -1"),
    ("optim.max_grad_norm=0", "optim: max_grad_norm must be > 0 or null, got 0"),
    ("algo.adv_clip=-1", "algo: adv_clip must be > 0 or null, got -1"),
    ("algo.adv_clip=0", "algo: adv_clip must be > 0 or null, got 0"),
    ("optim.lr=.nan", "optim: lr must be > 0, got nan"),
    ("optim.weight_decay=-0.1", "optim: weight_decay must be >= 0, got -0.1"),
    ("optim.eps=0", "optim: eps must be > 0, got 0"),
    ("optim.betas=[0.9,1.0]", "optim: betas[1] must be >= 0 and < 1, got 1.0"),
    ("algo.entropy_coef=-0.01", "algo: entropy_coef must be >= 0, got -0.01"),
    ("algo.clip_low=1.5", "algo: clip_low must be >= 0 and < 1, got 1.5"),
    ("trainer.eval_every=-1", "trainer: eval_every must be >= 0, got -1"),
    ("trainer.save_every=-2", "trainer: save_every must be >= 0, got -2"),
    ("trainer.seed=-1", "trainer: seed must be >= 0 and <= 4294967295, got -1"),
    ("rewards.0.weight=.inf", "weight must be a finite number, got inf"),
    ("model.lora.r=0", "model.lora: r must be >= 1, got 0"),
    ("model.lora.dropout=1.0", "model.lora: dropout must be >= 0 and < 1, got 1.0"),
]
TEXT_ONLY = [
    ("data.max_prompt_length=0", "data: max_prompt_length must be >= 1, got 0"),
    ("rollout.max_new_tokens=0", "rollout: max_new_tokens must be >= 1, got 0"),
    ("rollout.top_p=0", "rollout: top_p must be > 0 and <= 1, got 0"),
    ("rollout.top_k=0", "rollout: top_k must be -1 (off) or >= 1, got 0"),
    ("rollout.gpu_memory_utilization=1.5", "rollout: gpu_memory_utilization must be > 0 and <= 1, got 1.5"),
]
DIFFUSION_ONLY = [
    ("sampling.resolution=0", "sampling: resolution must be >= 1, got 0"),
    ("data.eval_size=0", "data: eval_size must be >= 1 or null, got 0"),
]


def _error(env: str, override: str, *more: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_run_config(env, "tiny", [override, *more])
    return str(info.value)


@pytest.mark.parametrize("override, expected", BAD + TEXT_ONLY)
def test_text_refuses_out_of_range_settings(override, expected):
    assert expected in _error("text", override)


@pytest.mark.parametrize("override, expected", BAD + DIFFUSION_ONLY)
def test_diffusion_refuses_out_of_range_settings(override, expected):
    assert expected in _error("diffusion", override)


@pytest.mark.parametrize("env, estimator", [("text", "grpo"), ("text", "rloo"), ("diffusion", "reinforce++-baseline")])
def test_a_group_estimator_with_groups_of_one_is_refused(env, estimator):
    batch = ["trainer.group_size=1", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8",
             "trainer.prompts_per_step=8"]
    message = _error(env, f"algo.adv_estimator={estimator}", *batch)
    assert f"trainer.group_size=1: algo.adv_estimator={estimator}" in message and "every advantage 0" in message


def test_the_valid_edges_load():
    cfg = load_run_config("text", "tiny", ["optim.max_grad_norm=null", "algo.adv_clip=null", "trainer.seed=0",
                                           "rollout.top_k=-1", "rollout.top_p=1.0", "optim.betas=[0.0,0.999]"])
    assert cfg.optim.max_grad_norm is None and cfg.algo.adv_clip is None


def test_the_dry_run_names_a_bad_setting(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "diffusion", "--config", "tiny", "--dry-run",
                           "--output-dir", str(tmp_path / "r"), "optim.max_grad_norm=-1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "unirl: config error: optim: max_grad_norm must be > 0 or null, got -1.0 (--debug shows the traceback)"]
