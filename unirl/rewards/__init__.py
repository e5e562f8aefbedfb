"""Reward functions for unirl, installed beside ``unirl`` (``rewards/<name>.py``, one task per file).

A reward is a callable over a batch: ``reward(samples, *, prompts, <dataset columns>, **kwargs)``
returns one finite float, or None ("does not apply"), per sample; it may be ``async``. Model-based
rewards are classes (``unirl.rewards.models.ModelReward``) instantiated once with the config's kwargs. The
full contract, and the ways a config names a reward (a registered name, an entry point of an
installed package, ``path/to/file.py:function``, ``package.module:function``, ``http://host:port``),
are in ``unirl/rewards/registry.py`` (which also lists the package's files by job), ``unirl/rewards/loading.py``
and docs/rewards.md. Importing this package is cheap: the built-in reward modules are imported on
the first lookup of a name.
"""

from unirl.rewards.loading import list_rewards, load_reward, reward_info, unavailable_builtins
from unirl.rewards.models import ModelReward
from unirl.rewards.registry import ENTRY_POINT_GROUP, REWARDS, RewardError, RewardInfo, register_reward
from unirl.rewards.scoring import call_reward, score_batch

__all__ = [
    "ENTRY_POINT_GROUP",
    "REWARDS",
    "ModelReward",
    "RewardError",
    "RewardInfo",
    "call_reward",
    "list_rewards",
    "load_reward",
    "register_reward",
    "reward_info",
    "score_batch",
    "unavailable_builtins",
]
