"""Reward functions for unirl, installed beside ``unirl`` (``rewards/<name>.py``, one task per file).

A reward is a callable over a batch: ``reward(samples, *, prompts, <dataset columns>, **kwargs)``
returns one finite float per sample. The full contract, and how a config names a reward (a
registered name, ``path/to/file.py:function`` or ``package.module:function``), are in
``rewards/registry.py``. Importing this package is cheap: the built-in reward modules are imported
on the first lookup of a name.
"""

from rewards.registry import (
    REWARDS,
    RewardError,
    RewardInfo,
    list_rewards,
    load_reward,
    register_reward,
    reward_info,
    score_batch,
    unavailable_builtins,
)

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardInfo",
    "list_rewards",
    "load_reward",
    "register_reward",
    "reward_info",
    "score_batch",
    "unavailable_builtins",
]
