"""The reward contract, the ``REWARDS`` registry, and loading a reward from a config string.

The contract, in one of two shapes:

1. **A callable over a batch**:
   ``reward(samples, *, prompts=..., <dataset columns>..., **kwargs) -> one float or None per sample``.
   It may be ``async def``; ``score_batch`` runs the coroutine to completion.
2. **A class** (model-based rewards, see ``rewards/models.py``): ``load_reward`` instantiates it once
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

A reward is named in a config in one of five ways; loading imports exactly the module or file
named and never evaluates a string:

- a registered name (``gsm8k``): the built-in modules listed in ``BUILTIN_MODULES`` are imported
  on the first lookup, so ``import rewards`` stays cheap;
- a name that a pip-installed package declares in the ``unirl.rewards`` entry-point group
  (``[project.entry-points."unirl.rewards"] my_reward = "my_pkg.rewards:my_reward"``): only that
  entry point is imported, and only when the name is not a built-in;
- ``path/to/file.py:function``: exactly that file is imported;
- ``package.module:function``: an importable module;
- ``http://host:port``: a reward served by ``unirl serve-reward`` (``rewards/remote.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import math
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
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
BUILTIN_MODULES: list[str] = [
    "rewards.gsm8k",
    "rewards.mathverify",
    "rewards.clip_rewards",
    "rewards.hpsv2",
    "rewards.image",
    "rewards.ocr",
]

#: The entry-point group through which an installed package adds rewards.
ENTRY_POINT_GROUP = "unirl.rewards"

#: Import name -> pip distribution, where they differ (for the "install ..." hint).
_PIP_NAMES = {
    "math_verify": "math-verify", "latex2sympy2_extended": "math-verify", "PIL": "pillow", "cv2": "opencv-python", "sklearn": "scikit-learn",
    "open_clip": "open-clip-torch", "torchvision": "torchvision",
}

#: When a batch call raised, at most this many samples are re-scored one at a time to find the
#: first one that fails on its own (a bounded extra cost, paid only when the run is failing anyway).
LOCATE_LIMIT = 32


class RewardError(ValueError):
    """A reward cannot be loaded, raised while scoring, or returned something other than one
    finite float (or None) per sample. The message names the reward, and the sample when known."""


@dataclass(frozen=True)
class RewardInfo:
    """What ``unirl rewards list`` shows about a registered reward."""

    name: str
    modality: Literal["text", "image"]
    description: str
    #: Where it comes from: ``built-in``, ``entry point <dist> <version> (<module:attr>)``, or ``module <name>``.
    source: str


_INFO: dict[str, RewardInfo] = {}
#: Built-in module or entry point -> why it could not be imported (a missing optional dependency).
_UNAVAILABLE: dict[str, str] = {}
_IMPORTED: set[str] = set()
_ENTRY_POINTS_SEEN: set[str] = set()


def register_reward(
    name: str, *, modality: Literal["text", "image"] = "text", description: str | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Register a reward function or class under ``name``.

    ``description`` (the one line ``unirl rewards list`` shows) defaults to the first line of the
    docstring.
    """
    if modality not in ("text", "image"):
        raise ValueError(f"reward {name!r}: modality must be 'text' or 'image', got {modality!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"reward {name!r}: register a function or a class, got {type(fn).__name__}")
        REWARDS.add(name, fn)
        module = getattr(fn, "__module__", "?")
        source = "built-in" if module in BUILTIN_MODULES else f"module {module}"
        _INFO[name] = RewardInfo(name, modality, description if description is not None else _first_line(fn), source)
        return fn

    return decorator


def reward_info(name: str) -> RewardInfo:
    """Modality, description and source of a registered reward (built-ins and entry points are looked at)."""
    _ensure_registered(name)
    return _INFO[name]


def list_rewards() -> list[RewardInfo]:
    """Every registered reward, sorted by name: built-ins, every ``unirl.rewards`` entry point, and
    rewards registered by modules imported so far."""
    _ensure_builtins()
    for ep in _entry_points():
        _load_entry_point(ep)
    return [_INFO[name] for name in REWARDS]


def unavailable_builtins() -> dict[str, str]:
    """Built-in modules and entry points that could not be imported, with what to do about it."""
    _ensure_builtins()
    return dict(_UNAVAILABLE)


def load_reward(spec: str, **kwargs: Any) -> RewardFn:
    """The reward named by ``spec``, ready to call over a batch, with ``kwargs`` from the config applied.

    ``spec`` is a registered name, an entry-point name, ``path/to/file.py:function``,
    ``package.module:function`` or ``http://host:port``. A function gets ``kwargs`` bound
    (``functools.partial``); a class is instantiated once with them. Every key of ``kwargs`` must be
    a named parameter: since rewards swallow unknown dataset columns through ``**kwargs``, a
    misspelt setting would otherwise be silently ignored.
    """
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        from rewards.remote import RemoteReward

        _check_bound_kwargs(spec, RemoteReward, kwargs)
        return RemoteReward(spec, **kwargs)
    obj = _resolve(spec)
    if inspect.isclass(obj):
        _check_bound_kwargs(spec, obj, kwargs)
        try:
            return obj(**kwargs)
        except RewardError:
            raise
        except Exception as err:
            raise RewardError(f"reward {spec!r}: {obj.__name__}(**{kwargs!r}) raised {type(err).__name__}: {err}") from err
    if not kwargs:
        return obj
    _check_bound_kwargs(spec, obj, kwargs)
    bound = functools.partial(obj, **kwargs)
    functools.update_wrapper(bound, obj)  # keep __name__/__doc__ for logs and `rewards list`
    return bound


def score_batch(reward_fn: RewardFn, samples: Sequence[Any], *, name: str, **columns: Any) -> list[float | None]:
    """Call ``reward_fn(samples, **columns)`` and check it gave ``len(samples)`` finite floats or Nones.

    Every failure is a ``RewardError`` naming the reward. When the reward raises, the batch is
    re-scored one sample at a time (the first ``LOCATE_LIMIT`` samples at most) to name the first
    sample that fails on its own, with its prompt; when none does (the failure depends on the
    batch, or lies further on), the message says so and shows the batch's first prompt. A
    ``RewardError`` raised by the reward itself (a remote server that cannot be reached, a model
    that cannot be loaded) passes through unchanged, without re-scoring.
    """
    n = len(samples)
    for key, column in columns.items():
        if isinstance(column, (list, tuple)) and len(column) != n:
            raise RewardError(f"reward {name!r}: column {key!r} has {len(column)} values for {n} samples")
    prompts = columns.get("prompts")
    try:
        scores = call_reward(reward_fn, samples, columns)
    except RewardError:
        raise
    except Exception as err:
        raise _locate_failure(reward_fn, samples, columns, name, err) from err

    if hasattr(scores, "tolist") and not isinstance(scores, (list, tuple)):  # numpy array, torch tensor
        if getattr(scores, "ndim", 1) != 1:
            raise RewardError(f"reward {name!r} returned an array of shape {tuple(scores.shape)}, expected ({n},)")
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        raise RewardError(f"reward {name!r} returned {type(scores).__name__}, expected a list of {n} floats")
    if len(scores) != n:
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {n} samples")
    out: list[float | None] = []
    for i, score in enumerate(scores):
        if score is None:
            out.append(None)
            continue
        if isinstance(score, (str, bytes)) or not _is_number(score):
            raise RewardError(
                f"reward {name!r} returned {score!r} for sample {i}{_prompt_of(prompts, i)}; "
                "scores must be floats (or None: does not apply)"
            )
        value = float(score)
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value} for sample {i}{_prompt_of(prompts, i)}; scores must be finite")
        out.append(value)
    return out


def call_reward(reward_fn: RewardFn, samples: Sequence[Any], columns: dict[str, Any]) -> Any:
    """``reward_fn(samples, **columns)``, running it to completion when it is ``async``.

    A coroutine runs in its own event loop (``asyncio.run``); when the calling thread already runs
    a loop (a notebook), it runs in a helper thread instead, since a loop cannot be nested.
    """
    result = reward_fn(samples, **columns)
    if not inspect.isawaitable(result):
        return result
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await(result))
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _await(result)).result()


# ----------------------------------------------------------------------------------------------
# Resolution
# ----------------------------------------------------------------------------------------------


def _resolve(spec: str) -> RewardFn:
    if not isinstance(spec, str) or not spec:
        raise RewardError(f"a reward spec must be a non-empty string, got {spec!r}")
    if ":" not in spec:
        if spec.endswith(".py"):
            raise RewardError(f"reward {spec!r}: name the function too, as {spec}:function")
        _ensure_registered(spec)
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


def _ensure_registered(name: str) -> None:
    """Make ``name`` registered (built-ins first, then an entry point of that name) or raise."""
    _ensure_builtins()
    if name not in REWARDS:
        for ep in _entry_points():
            if ep.name == name:
                _load_entry_point(ep)
    if name not in REWARDS:
        raise RewardError(_unknown_message(name))


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
        except Exception as err:
            # A third-party package that raises on import (e.g. a torchvision built for another
            # torch): that module's rewards are unavailable. An error in our own code is a bug.
            if _raised_in_rewards_package(err):
                raise
            _UNAVAILABLE[module_name] = f"{module_name} failed to import: {type(err).__name__}: {err}"
        _IMPORTED.add(module_name)


def _raised_in_rewards_package(err: BaseException) -> bool:
    """Whether ``err`` comes from a file of this package (a bug) rather than from a dependency."""
    ours = Path(__file__).resolve().parent
    if isinstance(err, SyntaxError) and err.filename:
        return Path(err.filename).resolve().parent == ours
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().parent == ours


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    # Read on every call (cheap): a package installed during the session is seen.
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> None:
    """Import the object an entry point names and register it under the entry point's name.

    A module may register the object itself with ``@register_reward`` under the same name (that
    sets its modality); otherwise it is registered here as a ``text`` reward, or with the modality
    in its ``modality`` attribute. An import error is recorded as unavailable (one broken plugin
    does not stop the others); two rewards under one name is an error.
    """
    key = f"{ep.name}={ep.value}"
    if key in _ENTRY_POINTS_SEEN:
        return
    _ENTRY_POINTS_SEEN.add(key)
    dist = getattr(ep, "dist", None)
    where = f"entry point {dist.name} {dist.version}" if dist is not None else "entry point"
    try:
        obj = ep.load()
    except Exception as err:
        _UNAVAILABLE[f"entry point {ep.name}"] = f"{where} {ep.name} = {ep.value!r} failed to import: {type(err).__name__}: {err}"
        return
    source = f"{where} ({ep.value})"
    if ep.name in REWARDS:
        if REWARDS.get(ep.name) is not obj:
            raise RewardError(
                f"reward {ep.name!r} from {source} clashes with the reward of that name from "
                f"{_INFO[ep.name].source}; uninstall one, or register under another name"
            )
        _INFO[ep.name] = dataclasses.replace(_INFO[ep.name], source=source)
    else:
        register_reward(ep.name, modality=getattr(obj, "modality", "text"))(obj)
        _INFO[ep.name] = dataclasses.replace(_INFO[ep.name], source=source)
    # Its module is imported now: register the other entry points it declares too (no further
    # import), so a reward its module registered itself is listed with its entry point as source.
    for other in _entry_points():
        if other.module == ep.module:
            _load_entry_point(other)


def _unknown_message(name: str) -> str:
    message = (
        REWARDS.unknown_message(name)
        + f". Or give path/to/file.py:function, package.module:function, http://host:port, or install a "
        f"package with a {ENTRY_POINT_GROUP!r} entry point."
    )
    if _UNAVAILABLE:
        message += " Rewards that could not be loaded: " + "; ".join(_UNAVAILABLE.values())
    return message


def _accepted_kwargs(obj: RewardFn) -> list[str] | None:
    """Names a config may set: a function's keyword parameters after ``samples``, or a class's
    constructor parameters (following ``**kwargs`` into the base classes). None: not introspectable."""
    if inspect.isclass(obj):
        names: list[str] = []
        for cls in obj.__mro__:
            init = cls.__dict__.get("__init__")
            if init is None:
                continue
            try:
                params = list(inspect.signature(init).parameters.values())[1:]  # drop self
            except (TypeError, ValueError):
                return None
            names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names]
            if not any(p.kind == p.VAR_KEYWORD for p in params):
                break
        return names
    try:
        params = list(inspect.signature(obj).parameters.values())[1:]  # drop samples
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_bound_kwargs(spec: str, fn: RewardFn, kwargs: dict[str, Any]) -> None:
    named = _accepted_kwargs(fn)
    if named is None:  # no introspectable signature: nothing to check against
        return
    for key in kwargs:
        if key not in named:
            close = difflib.get_close_matches(key, named, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise RewardError(
                f"reward {spec!r} has no parameter {key!r}.{hint} Its parameters: {', '.join(named) or '(none)'}"
            )


def _locate_failure(reward_fn: RewardFn, samples: Sequence[Any], columns: dict[str, Any], name: str,
                    err: Exception) -> RewardError:
    n = len(samples)
    prompts = columns.get("prompts")
    what = f"{type(err).__name__}: {err}"
    if n == 1:
        return RewardError(f"reward {name!r} raised {what} on sample 0{_prompt_of(prompts, 0)}")
    tried = min(n, LOCATE_LIMIT)
    for i in range(tried):
        one = {k: (v[i:i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in columns.items()}
        try:
            call_reward(reward_fn, samples[i:i + 1], one)
        except Exception as single:
            return RewardError(
                f"reward {name!r} raised {type(single).__name__}: {single} on sample {i}{_prompt_of(prompts, i)} "
                f"(found by re-scoring the batch of {n} one sample at a time)"
            )
    return RewardError(
        f"reward {name!r} raised {what} on a batch of {n} samples; re-scored one at a time, none of the "
        f"first {tried} raised, so the failure depends on the batch or lies further on "
        f"(first sample{_prompt_of(prompts, 0)})"
    )


def _prompt_of(prompts: Any, i: int) -> str:
    if isinstance(prompts, (list, tuple)) and i < len(prompts):
        text = str(prompts[i])
        return f" (prompt {text[:200] + '...' if len(text) > 200 else text!r})"
    return ""


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


async def _await(awaitable):
    return await awaitable


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
