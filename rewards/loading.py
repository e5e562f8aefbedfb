"""From a config's reward spec to a callable, with the config's kwargs checked and bound.

A reward is named in a config in one of five ways; loading imports exactly the module or file
named and never evaluates a string:

- a registered name (``gsm8k``): the built-in modules listed in ``registry.BUILTIN_MODULES`` are
  imported on the first lookup, so ``import unirl.rewards`` stays cheap;
- a name that a pip-installed package declares in the ``unirl.rewards`` entry-point group
  (``[project.entry-points."unirl.rewards"] my_reward = "my_pkg.rewards:my_reward"``): only that
  entry point is imported, and only when the name is not a built-in;
- ``path/to/file.py:function``: exactly that file is imported;
- ``package.module:function``: an importable module;
- ``http://host:port``: a reward served by ``unirl serve-reward`` (``rewards/remote_client.py``).

``resolve_reward(spec)`` finds the function or class; ``load_reward(spec, **kwargs)`` also checks
every kwarg against its signature and binds them (or instantiates the class).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any

from unirl.rewards import registry
from unirl.rewards.registry import REWARDS, RewardError, RewardFn, RewardInfo, register_reward

#: Import name -> pip distribution, where they differ (for the "install ..." hint).
_PIP_NAMES = {
    "math_verify": "math-verify", "latex2sympy2_extended": "math-verify", "PIL": "pillow", "cv2": "opencv-python", "sklearn": "scikit-learn",
    "open_clip": "open-clip-torch", "torchvision": "torchvision",
}


def load_reward(spec: str, **kwargs: Any) -> RewardFn:
    """The reward named by ``spec``, ready to call over a batch, with ``kwargs`` from the config applied.

    ``spec`` is a registered name, an entry-point name, ``path/to/file.py:function``,
    ``package.module:function`` or ``http://host:port``. A function gets ``kwargs`` bound
    (``functools.partial``); a class is instantiated once with them. Every key of ``kwargs`` must be
    a named parameter: since rewards swallow unknown dataset columns through ``**kwargs``, a
    misspelt setting would otherwise be silently ignored.
    """
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        from unirl.rewards.remote_client import RemoteReward

        _check_bound_kwargs(spec, RemoteReward, kwargs)
        return RemoteReward(spec, **kwargs)
    obj = resolve_reward(spec)
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


def resolve_reward(spec: str) -> RewardFn:
    """The function or class that ``spec`` names (not an ``http://`` URL), not yet bound or instantiated.

    Raises ``RewardError`` saying what is missing: an unknown name (with close matches and the
    built-ins that could not be loaded), a missing file or module, or a missing function in it.
    """
    if not isinstance(spec, str) or not spec:
        raise RewardError(f"a reward spec must be a non-empty string, got {spec!r}")
    if ":" not in spec:
        if spec.endswith(".py"):
            raise RewardError(f"reward {spec!r}: name the function too, as {spec}:function")
        _ensure_registered(spec)
        return REWARDS.get(spec)

    return resolve_object(spec)


def resolve_object(spec: str, *, kind: str = "reward", error: type[Exception] = RewardError) -> Any:
    """The callable that ``path/to/file.py:function`` or ``package.module:function`` names, for any
    extension point that is named this way (rewards, ``unirl/tools``); ``kind`` and ``error`` word
    and type the error that says what is missing."""
    where, attr = spec.rsplit(":", 1)
    if not where or not attr:
        raise error(f"{kind} {spec!r}: expected path/to/file.py:function or package.module:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(Path(where).expanduser(), spec, kind=kind, error=error)
        origin = f"file {where}"
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            missing = f" (no module named {err.name!r})" if err.name and err.name != where else ""
            raise error(f"{kind} {spec!r}: cannot import module {where!r}{missing}") from err
        origin = f"module {where}"

    fn = getattr(module, attr, None)
    if fn is None:
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(attr, defined, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise error(f"{kind} {spec!r}: {origin} has no function {attr!r}.{hint}")
    if not callable(fn):
        raise error(f"{kind} {spec!r}: {attr!r} in {origin} is a {type(fn).__name__}, not a function")
    return fn


def reward_info(name: str) -> RewardInfo:
    """Modality, description and source of a registered reward (built-ins and entry points are looked at)."""
    _ensure_registered(name)
    return registry._INFO[name]


def list_rewards() -> list[RewardInfo]:
    """Every registered reward, sorted by name: built-ins, every ``unirl.rewards`` entry point, and
    rewards registered by modules imported so far."""
    _ensure_builtins()
    for ep in _entry_points():
        _load_entry_point(ep)
    return [registry._INFO[name] for name in REWARDS]


def unavailable_builtins() -> dict[str, str]:
    """Built-in modules and entry points that could not be imported, with what to do about it."""
    _ensure_builtins()
    return dict(registry._UNAVAILABLE)


# ----------------------------------------------------------------------------------------------
# Files, built-in modules and entry points
# ----------------------------------------------------------------------------------------------


def _import_file(path: Path, spec: str, *, kind: str = "reward", error: type[Exception] = RewardError):
    """Import exactly ``path`` once per resolved path, under a module name of its own."""
    if not path.is_file():
        raise error(f"{kind} {spec!r}: file not found: {path}")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_unirl_reward_{''.join(c if c.isalnum() else '_' for c in resolved.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{kind} {spec!r}: cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # before exec, like import does (dataclasses, pickling)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[module_name]
        raise RewardError(f"reward {spec!r}: {err.filename}:{err.lineno}: syntax error: {err.msg}") from None
    except Exception as err:
        del sys.modules[module_name]
        raise RewardError(f"reward {spec!r}: importing {path} failed: {type(err).__name__}: {err}") from err
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


def _ensure_builtins(state=None) -> None:
    """Import each built-in module once; a missing optional dependency is recorded, not raised.
    ``state``: the module holding ``BUILTIN_MODULES``, ``_IMPORTED`` and ``_UNAVAILABLE`` (the
    rewards' ``registry`` by default; ``unirl/tools/registry.py`` for tools)."""
    state = registry if state is None else state
    for module_name in state.BUILTIN_MODULES:
        if module_name in state._IMPORTED:
            continue
        try:
            importlib.import_module(module_name)
        except ImportError as err:
            top = (err.name or "").split(".")[0]
            if top in ("", "rewards", "unirl"):
                raise  # our own module is missing or broken: a bug, not an optional dependency
            pip_name = _PIP_NAMES.get(top, top)
            if isinstance(err, ModuleNotFoundError):
                state._UNAVAILABLE[module_name] = f"{module_name} needs {top!r}: pip install {pip_name}"
            else:  # the package is there but lacks a name: an incompatible version
                state._UNAVAILABLE[module_name] = (
                    f"{module_name} failed to import from {top!r} ({err}): pip install -U {pip_name}")
        except Exception as err:
            # A third-party package that raises on import (e.g. a torchvision built for another
            # torch): that module's rewards are unavailable. An error in our own code is a bug.
            if _raised_in_rewards_package(err, getattr(state, "PACKAGE_DIR", None)):
                raise
            state._UNAVAILABLE[module_name] = f"{module_name} failed to import: {type(err).__name__}: {err}"
        state._IMPORTED.add(module_name)


def _raised_in_rewards_package(err: BaseException, ours: Path | None = None) -> bool:
    """Whether ``err`` comes from a file of this package (or of ``ours``: a bug) rather than from a dependency."""
    ours = Path(__file__).resolve().parent if ours is None else ours
    if isinstance(err, SyntaxError) and err.filename:
        return Path(err.filename).resolve().parent == ours
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().parent == ours


def _entry_points(group: str | None = None) -> list[importlib.metadata.EntryPoint]:
    # Read on every call (cheap): a package installed during the session is seen.
    group = registry.ENTRY_POINT_GROUP if group is None else group
    return sorted(importlib.metadata.entry_points(group=group), key=lambda ep: ep.name)


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> None:
    """Import the object an entry point names and register it under the entry point's name.

    A module may register the object itself with ``@register_reward`` under the same name (that
    sets its modality); otherwise it is registered here as a ``text`` reward, or with the modality
    in its ``modality`` attribute. An import error is recorded as unavailable (one broken plugin
    does not stop the others); two rewards under one name is an error.
    """
    key = f"{ep.name}={ep.value}"
    if key in registry._ENTRY_POINTS_SEEN:
        return
    registry._ENTRY_POINTS_SEEN.add(key)
    dist = getattr(ep, "dist", None)
    where = f"entry point {dist.name} {dist.version}" if dist is not None else "entry point"
    try:
        obj = ep.load()
    except Exception as err:
        registry._UNAVAILABLE[f"entry point {ep.name}"] = (
            f"{where} {ep.name} = {ep.value!r} failed to import: {type(err).__name__}: {err}")
        return
    source = f"{where} ({ep.value})"
    if ep.name in REWARDS:
        if REWARDS.get(ep.name) is not obj:
            raise RewardError(
                f"reward {ep.name!r} from {source} clashes with the reward of that name from "
                f"{registry._INFO[ep.name].source}; uninstall one, or register under another name"
            )
    else:
        register_reward(ep.name, modality=getattr(obj, "modality", "text"))(obj)
    registry._INFO[ep.name] = dataclasses.replace(registry._INFO[ep.name], source=source)
    # Its module is imported now: register the other entry points it declares too (no further
    # import), so a reward its module registered itself is listed with its entry point as source.
    for other in _entry_points():
        if other.module == ep.module:
            _load_entry_point(other)


def _unknown_message(name: str) -> str:
    message = (
        REWARDS.unknown_message(name)
        + f". Or give path/to/file.py:function, package.module:function, http://host:port, or install a "
        f"package with a {registry.ENTRY_POINT_GROUP!r} entry point."
    )
    if registry._UNAVAILABLE:
        message += " Rewards that could not be loaded: " + "; ".join(registry._UNAVAILABLE.values())
    return message


# ----------------------------------------------------------------------------------------------
# The config's kwargs
# ----------------------------------------------------------------------------------------------


def _accepted_kwargs(obj: RewardFn, skip_first: bool = True) -> list[str] | None:
    """Names a config may set: a function's keyword parameters after ``samples`` (all of them with
    ``skip_first=False``: a tool's), or a class's constructor parameters (following ``**kwargs`` into
    the base classes). None: not introspectable."""
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
        params = list(inspect.signature(obj).parameters.values())[1 if skip_first else 0:]  # drop samples
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_bound_kwargs(spec: str, fn: RewardFn, kwargs: dict[str, Any], *, kind: str = "reward",
                        error: type[Exception] = RewardError, skip_first: bool = True) -> None:
    named = _accepted_kwargs(fn, skip_first)
    if named is None:  # no introspectable signature: nothing to check against
        return
    for key in kwargs:
        if key not in named:
            close = difflib.get_close_matches(key, named, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise error(
                f"{kind} {spec!r} has no parameter {key!r}.{hint} Its parameters: {', '.join(named) or '(none)'}"
            )
