"""Every YAML under configs/ loads into its environment's typed config, recursively."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl.config.environments import ENVIRONMENTS
from unirl.config.environments import import_object as _import
from unirl.config import CONFIGS_ROOT, load_config

from machine import config_param

SHIPPED = sorted(CONFIGS_ROOT.rglob("*.yaml"))


def test_configs_are_shipped():
    names = {p.relative_to(CONFIGS_ROOT).as_posix() for p in SHIPPED}
    assert {"text/tiny.yaml", "text/gsm8k.yaml"} <= names


@pytest.mark.parametrize("path", [config_param(p) for p in SHIPPED], ids=lambda p: p.relative_to(CONFIGS_ROOT).as_posix())
def test_shipped_config_validates(path: Path):
    env = path.relative_to(CONFIGS_ROOT).parts[0]
    assert env in ENVIRONMENTS, f"{path}: configs/<env>/ must be one of {sorted(ENVIRONMENTS)}"
    cfg = load_config(_import(ENVIRONMENTS[env][0]), path)
    trainer = cfg.trainer
    assert (trainer.prompts_per_step * trainer.group_size) % trainer.mini_batch_size == 0
    assert cfg.rewards, f"{path}: no reward"
    from unirl.rewards.registry import load_reward

    for reward in cfg.rewards:  # every named reward resolves (models load lazily, not here)
        load_reward(reward.name, **reward.kwargs)


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.parent.name in ("text", "diffusion")],
                         ids=lambda p: p.relative_to(CONFIGS_ROOT).as_posix())
def test_runs_of_many_steps_save_periodically(path: Path):
    """A crash must not lose finished work (issue 37 item 0: smollm2_math died at step 26 of 40 with
    ``save_every: 0`` and lost 25 trained steps): a config of more than 20 steps checkpoints at least
    twice before its end."""
    env = path.relative_to(CONFIGS_ROOT).parts[0]
    trainer = load_config(_import(ENVIRONMENTS[env][0]), path).trainer
    if trainer.total_steps > 20:
        assert 0 < trainer.save_every <= trainer.total_steps // 2, (
            f"{path}: trainer.save_every={trainer.save_every} for {trainer.total_steps} steps")
