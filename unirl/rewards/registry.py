"""The reward contract and the names of rewards: ``REWARDS``, ``register_reward`` and what is known
about each name. This is the bottom of the rewards package; it imports nothing from it.

The package by job, each file importing only the ones above it in this list:

- ``registry.py`` (this file): the contract, ``RewardError``, the names and their ``RewardInfo``;
- ``loading.py``: turning a config's spec into a callable (names, built-in modules, entry points,
  files, modules, ``http://`` URLs) and checking the config's kwargs against it, through the
  resolver rewards and tools share (``unirl/plugins.py``);
- ``scoring.py``: calling a reward over a batch, checking what it returned, naming the failing sample;
- ``models.py`` (the class shape) and ``remote.py`` (``unirl serve-reward``) on top;
- the built-in rewards, one task per file (``gsm8k.py``, ``reward_model.py``, ...), listed in
  ``BUILTIN_MODULES``.

The contract, in one of two shapes:

1. **A callable over a batch**:
   ``reward(samples, *, prompts=..., <dataset columns>..., **kwargs) -> one float or None per sample``.
   It may be ``async def``; ``score_batch`` runs the coroutine to completion.
2. **A class** (model-based rewards, see ``unirl/rewards/models.py``): ``load_reward`` instantiates it once
   with the config's ``kwargs``, and the instance is then called exactly like shape 1. The class
   decides when to load its weights (``ModelReward`` does it lazily, on the first call).

For both shapes:

- ``samples``: the N generated samples of the batch (strings for text rewards, PIL images for
  image rewards).
- keyword arguments: ``prompts=[...]`` and the dataset's columns, each a list of N values aligned
  with ``samples`` (e.g. ``answer=[...]`` for GSM8K). A reward takes the columns it needs by name
  and must accept and ignore the others (end the signature with ``**kwargs``).
- settings from the config (``rewards: [{name: gsm8k, kwargs: {method: flexible}}]``) are bound
  by ``load_reward``: to the function's keyword arguments, or to the class's constructor.
- returns N values: a list, a tuple, or a 1-D numpy array or torch tensor. Each is a finite float,
  or ``None`` meaning "this reward does not apply to this sample" (it then adds nothing to the
  sample's total and is left out of the reward's logged mean). ``score_batch`` checks this and
  raises ``RewardError`` naming the reward, the sample and its prompt otherwise, and also when the
  reward itself raises.
- may return ``ScoresWithText(scores, texts)`` instead: the scores plus one text per sample (a
  judge's answer, ``unirl/rewards/judge.py``), which evaluation keeps beside the scores in its samples.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from unirl.plugins import Plugins
from unirl.registry import first_sentence

RewardFn = Callable[..., Any]

#: Modules whose import registers the built-in rewards. Adding a module here registers its rewards.
#: A module needing an optional package should import it before registering anything: if that
#: import fails, the module's rewards are reported as unavailable (with the package to install)
#: while the other modules' rewards still load.
BUILTIN_MODULES: list[str] = [
    "unirl.rewards.gsm8k",
    "unirl.rewards.qa_em",
    "unirl.rewards.mathverify",
    "unirl.rewards.geo3k",
    "unirl.rewards.clip_rewards",
    "unirl.rewards.hpsv2",
    "unirl.rewards.image",
    "unirl.rewards.ocr",
    "unirl.rewards.reward_model",
    "unirl.rewards.judge",
    "unirl.rewards.llm_judge",
    "unirl.rewards.geneval",
    "unirl.rewards.imagereward",
    "unirl.agents.reward",  # episode_return, the reward of rollout.environment's episodes
]

#: The entry-point group through which an installed package adds rewards.
ENTRY_POINT_GROUP = "unirl.rewards"


class RewardError(ValueError):
    """A reward cannot be loaded, raised while scoring, or returned something other than one
    finite float (or None) per sample. The message names the reward, and the sample when known."""


class ScoresWithText(list):
    """A reward's scores (the contract's list) that carry one text per sample in ``texts``: why each
    got its score (a judge's answer). Training reads the scores; evaluation also writes the texts.
    ``failed`` (optional, one bool per sample): where the text could not be read as a score (a judge's
    unparsable answer), logged as ``reward/<name>/parse_failed`` (the step's fraction)."""

    def __init__(self, scores, texts, failed=None):
        super().__init__(scores)
        self.texts = [str(t) for t in texts]
        self.failed = None if failed is None else [bool(f) for f in failed]
        if len(self.texts) != len(self) or (self.failed is not None and len(self.failed) != len(self)):
            raise RewardError(f"ScoresWithText: {len(self.texts)} texts and "
                              f"{'no' if failed is None else len(self.failed)} failure flags for {len(self)} scores")


@dataclass(frozen=True)
class RewardInfo:
    """What ``unirl rewards list`` shows about a registered reward."""

    name: str
    modality: Literal["text", "image"]
    description: str
    #: Where it comes from: ``built-in``, ``entry point <dist> <version> (<module:attr>)``, or ``module <name>``.
    source: str


#: The registered rewards, with their ``RewardInfo`` (``REWARDS.info``) and the built-ins and entry
#: points that could not be loaded (``REWARDS.unavailable``); a test may swap in copies
#: (``isolated_registry`` in tests/conftest.py).
REWARDS: Plugins = Plugins(
    "reward", builtin_modules=BUILTIN_MODULES, group=ENTRY_POINT_GROUP, error=RewardError,
    register=lambda name, obj: register_reward(name, modality=getattr(obj, "modality", "text"))(obj),
    package_dir=Path(__file__).resolve().parent, skip_first=True)


def register_reward(
    name: str, *, modality: Literal["text", "image"] = "text", description: str | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Register a reward function or class under ``name``.

    ``description`` (the one line ``unirl rewards list`` shows) defaults to the docstring's first sentence.
    """
    if modality not in ("text", "image"):
        raise ValueError(f"reward {name!r}: modality must be 'text' or 'image', got {modality!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"reward {name!r}: register a function or a class, got {type(fn).__name__}")
        REWARDS.add(name, fn)
        module = getattr(fn, "__module__", "?")
        source = "built-in" if module in REWARDS.builtin_modules else f"module {module}"
        about = description if description is not None else first_sentence(inspect.getdoc(fn) or "")
        REWARDS.info[name] = RewardInfo(name, modality, about, source)
        return fn

    return decorator


def unregister_reward(name: str) -> None:
    """Undo ``register_reward(name)`` (``unirl.train`` registers reward callables for one run only)."""
    REWARDS.remove(name)
    REWARDS.info.pop(name, None)


#: Names that lived in this file before it was split by job, and the module that holds each now.
#: ``from unirl.rewards.registry import load_reward`` keeps working: the module is imported on first
#: access (PEP 562), so importing this file still imports nothing above it.
_MOVED = {
    "load_reward": "unirl.rewards.loading",
    "resolve_reward": "unirl.rewards.loading",
    "reward_info": "unirl.rewards.loading",
    "list_rewards": "unirl.rewards.loading",
    "unavailable_builtins": "unirl.rewards.loading",
    "_ensure_builtins": "unirl.rewards.loading",
    "_raised_in_rewards_package": "unirl.rewards.loading",
    "score_batch": "unirl.rewards.scoring",
    "call_reward": "unirl.rewards.scoring",
}


def __getattr__(name: str) -> Any:
    if name == "_resolve":  # its old, private name
        name = "resolve_reward"
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
