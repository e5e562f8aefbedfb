"""From a config's reward spec to a callable, with the config's kwargs checked and bound.

A reward is named in a config in one of five ways (a registered name, an entry point of the
``unirl.rewards`` group, ``path/to/file.py:function``, ``package.module:function``, or
``http://host:port`` for a reward served by ``unirl serve-reward``); the resolving is the one rewards
and tools share (``unirl/plugins.py``), over the reward registry (``REWARDS``). Loading imports exactly
the module or file named and never evaluates a string.

``resolve_reward(spec)`` finds the function or class; ``load_reward(spec, **kwargs)`` also checks
every kwarg against its signature and binds them (or instantiates the class).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl.plugins import raised_in
from unirl.rewards.registry import REWARDS, RewardFn, RewardInfo
from unirl.rewards.remote_client import RemoteReward


def load_reward(spec: str, **kwargs: Any) -> RewardFn:
    """The reward named by ``spec``, ready to call over a batch, with ``kwargs`` from the config applied.

    ``spec`` is a registered name, an entry-point name, ``path/to/file.py:function``,
    ``package.module:function`` or ``http://host:port``. A function gets ``kwargs`` bound
    (``functools.partial``); a class is instantiated once with them. Every key of ``kwargs`` must be
    a named parameter: since rewards swallow unknown dataset columns through ``**kwargs``, a
    misspelt setting would otherwise be silently ignored.
    """
    return REWARDS.load(spec, kwargs, remote=RemoteReward)


def resolve_reward(spec: str) -> RewardFn:
    """The function or class that ``spec`` names (not an ``http://`` URL), not yet bound or instantiated.

    Raises ``RewardError`` saying what is missing: an unknown name (with close matches and the
    built-ins that could not be loaded), a missing file or module, or a missing function in it.
    """
    return REWARDS.resolve(spec)


def reward_info(name: str) -> RewardInfo:
    """Modality, description and source of a registered reward (built-ins and entry points are looked at)."""
    REWARDS.ensure(name)
    return REWARDS.info[name]


def list_rewards() -> list[RewardInfo]:
    """Every registered reward, sorted by name: built-ins, every ``unirl.rewards`` entry point, and
    rewards registered by modules imported so far."""
    return REWARDS.listing()


def unavailable_builtins() -> dict[str, str]:
    """Built-in modules and entry points that could not be imported, with what to do about it."""
    REWARDS.ensure_builtins()
    return dict(REWARDS.unavailable)


def _ensure_builtins() -> None:
    """Import the built-in reward modules (tests register on top of them)."""
    REWARDS.ensure_builtins()


def _raised_in_rewards_package(err: BaseException) -> bool:
    """Whether ``err`` comes from a file of this package (a bug) rather than from a dependency."""
    return raised_in(err, Path(__file__).resolve().parent)
