"""The reward contract, the ``REWARDS`` registry, and loading a reward from a config string.

The contract: a reward is a callable over a batch,
``reward(samples, *, prompts=..., <dataset columns>..., **kwargs) -> one float per sample``.

- ``samples``: the N generated samples of the batch (strings for text rewards, PIL images for
  image rewards).
- keyword arguments: ``prompts=[...]`` and the dataset's columns, each a list of N values aligned
  with ``samples`` (e.g. ``answer=[...]`` for GSM8K). A reward takes the columns it needs by name
  and must accept and ignore the others (end the signature with ``**kwargs``).
- settings from the config (``rewards: [{name: gsm8k, kwargs: {method: flexible}}]``) are bound
  by ``load_reward`` and arrive as keyword arguments too.
- returns N finite floats: a list, a tuple, or a 1-D numpy array or torch tensor.
  ``score_batch`` checks this and raises ``RewardError`` naming the reward otherwise.

A reward is named in a config in one of three ways:

- a registered name (``gsm8k``): the built-in modules listed in ``BUILTIN_MODULES`` are imported
  on the first lookup, so ``import rewards`` stays cheap;
- ``path/to/file.py:function``: exactly that file is imported;
- ``package.module:function``: an importable module.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from unirl.registry import Registry

RewardFn = Callable[..., Any]

REWARDS: Registry[RewardFn] = Registry("reward")

#: Modules whose import registers the built-in rewards. Adding a module here registers its rewards.
#: A module needing an optional package should import it before registering anything: if that
#: import fails, the module's rewards are reported as unavailable (with the package to install)
#: while the other modules' rewards still load.
BUILTIN_MODULES: list[str] = ["rewards.gsm8k"]

#: Import name -> pip distribution, where they differ (for the "install ..." hint).
_PIP_NAMES = {"math_verify": "math-verify", "PIL": "pillow", "cv2": "opencv-python", "sklearn": "scikit-learn"}


class RewardError(ValueError):
    """A reward cannot be loaded, or returned something other than one finite float per sample."""


@dataclass(frozen=True)
class RewardInfo:
    """What ``unirl rewards list`` shows about a registered reward."""

    name: str
    modality: Literal["text", "image"]
    description: str
    module: str


_INFO: dict[str, RewardInfo] = {}
#: Built-in module -> why it could not be imported (a missing optional dependency).
_UNAVAILABLE: dict[str, str] = {}
_IMPORTED: set[str] = set()


def register_reward(
    name: str, *, modality: Literal["text", "image"] = "text", description: str | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Register a reward under ``name``; ``description`` defaults to its docstring's first line."""
    if modality not in ("text", "image"):
        raise ValueError(f"reward {name!r}: modality must be 'text' or 'image', got {modality!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        REWARDS.add(name, fn)
        doc = inspect.getdoc(fn) or ""
        text = description if description is not None else (doc.splitlines()[0] if doc else "")
        _INFO[name] = RewardInfo(name, modality, text, getattr(fn, "__module__", "?"))
        return fn

    return decorator


def reward_info(name: str) -> RewardInfo:
    """Modality and description of a registered reward (built-ins are imported first)."""
    _ensure_builtins()
    if name not in REWARDS:
        raise RewardError(_unknown_message(name))
    return _INFO[name]


def list_rewards() -> list[RewardInfo]:
    """Every registered reward, sorted by name (built-ins included)."""
    _ensure_builtins()
    return [_INFO[name] for name in REWARDS]


def unavailable_builtins() -> dict[str, str]:
    """Built-in reward modules that could not be imported, with what to install."""
    _ensure_builtins()
    return dict(_UNAVAILABLE)


def load_reward(spec: str, **kwargs: Any) -> RewardFn:
    """The reward named by ``spec``, with ``kwargs`` bound (``functools.partial``).

    ``spec`` is a registered name, ``path/to/file.py:function`` or ``package.module:function``.
    Every key of ``kwargs`` must be a named parameter of the reward: since rewards swallow unknown
    dataset columns through ``**kwargs``, a misspelt setting would otherwise be silently ignored.
    """
    fn = _resolve(spec)
    if not kwargs:
        return fn
    _check_bound_kwargs(spec, fn, kwargs)
    bound = functools.partial(fn, **kwargs)
    functools.update_wrapper(bound, fn)  # keep __name__/__doc__ for logs and `rewards list`
    return bound


def score_batch(reward_fn: RewardFn, samples: Sequence[Any], *, name: str, **columns: Any) -> list[float]:
    """Call ``reward_fn(samples, **columns)`` and check it gave ``len(samples)`` finite floats."""
    n = len(samples)
    for key, column in columns.items():
        if isinstance(column, (list, tuple)) and len(column) != n:
            raise RewardError(f"reward {name!r}: column {key!r} has {len(column)} values for {n} samples")
    scores = reward_fn(samples, **columns)

    if hasattr(scores, "tolist") and not isinstance(scores, (list, tuple)):  # numpy array, torch tensor
        if getattr(scores, "ndim", 1) != 1:
            raise RewardError(f"reward {name!r} returned an array of shape {tuple(scores.shape)}, expected ({n},)")
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        raise RewardError(f"reward {name!r} returned {type(scores).__name__}, expected a list of {n} floats")
    if len(scores) != n:
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {n} samples")
    out = []
    for i, score in enumerate(scores):
        if isinstance(score, (str, bytes)) or not _is_number(score):
            raise RewardError(f"reward {name!r} returned {score!r} for sample {i}; scores must be floats")
        value = float(score)
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value} for sample {i}; scores must be finite")
        out.append(value)
    return out


# ----------------------------------------------------------------------------------------------
# Resolution
# ----------------------------------------------------------------------------------------------


def _resolve(spec: str) -> RewardFn:
    if not isinstance(spec, str) or not spec:
        raise RewardError(f"a reward spec must be a non-empty string, got {spec!r}")
    if ":" not in spec:
        if spec.endswith(".py"):
            raise RewardError(f"reward {spec!r}: name the function too, as {spec}:function")
        _ensure_builtins()
        if spec not in REWARDS:
            raise RewardError(_unknown_message(spec))
        return REWARDS.get(spec)

    where, attr = spec.rsplit(":", 1)
    if not where or not attr:
        raise RewardError(f"reward {spec!r}: expected path/to/file.py:function or package.module:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(Path(where).expanduser(), spec)
        origin = f"file {where}"
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            missing = f" (no module named {err.name!r})" if err.name and err.name != where else ""
            raise RewardError(f"reward {spec!r}: cannot import module {where!r}{missing}") from err
        origin = f"module {where}"

    fn = getattr(module, attr, None)
    if fn is None:
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(attr, defined, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise RewardError(f"reward {spec!r}: {origin} has no function {attr!r}.{hint}")
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {attr!r} in {origin} is a {type(fn).__name__}, not a function")
    return fn


def _import_file(path: Path, spec: str):
    """Import exactly ``path`` once per resolved path, under a module name of its own."""
    if not path.is_file():
        raise RewardError(f"reward {spec!r}: file not found: {path}")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_unirl_reward_{''.join(c if c.isalnum() else '_' for c in resolved.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward {spec!r}: cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # before exec, like import does (dataclasses, pickling)
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _ensure_builtins() -> None:
    """Import each built-in reward module once; a missing optional dependency is recorded, not raised."""
    for module_name in BUILTIN_MODULES:
        if module_name in _IMPORTED:
            continue
        try:
            importlib.import_module(module_name)
        except ImportError as err:
            top = (err.name or "").split(".")[0]
            if top in ("", "rewards", "unirl"):
                raise  # our own module is missing or broken: a bug, not an optional dependency
            pip_name = _PIP_NAMES.get(top, top)
            if isinstance(err, ModuleNotFoundError):
                _UNAVAILABLE[module_name] = f"{module_name} needs {top!r}: pip install {pip_name}"
            else:  # the package is there but lacks a name: an incompatible version
                _UNAVAILABLE[module_name] = f"{module_name} failed to import from {top!r} ({err}): pip install -U {pip_name}"
        _IMPORTED.add(module_name)


def _unknown_message(name: str) -> str:
    message = REWARDS.unknown_message(name) + ". Or give path/to/file.py:function or package.module:function."
    if _UNAVAILABLE:
        message += " Built-in rewards that could not be loaded: " + "; ".join(_UNAVAILABLE.values())
    return message


def _check_bound_kwargs(spec: str, fn: RewardFn, kwargs: dict[str, Any]) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no introspectable signature: nothing to check against
        return
    named = [
        p.name for p in list(params.values())[1:]
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    for key in kwargs:
        if key not in named:
            close = difflib.get_close_matches(key, named, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise RewardError(
                f"reward {spec!r} has no parameter {key!r}.{hint} Its parameters: {', '.join(named) or '(none)'}"
            )


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
