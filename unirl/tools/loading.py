"""From a config's tool spec (``rollout.tools[i]``) to a callable with the config's kwargs bound.

The resolving is the rewards' (``rewards/loading.py``), given this package's registry, error type and
entry-point group: the same five ways of naming, the same messages (unknown name with close matches,
missing file, module or function, misspelt kwarg, missing optional package).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from unirl.rewards import loading as shared
from unirl.tools import registry
from unirl.tools.registry import TOOLS, ToolError, ToolFn, ToolInfo, register_tool


def load_tool(spec: str, **kwargs: Any) -> ToolFn:
    """The tool ``spec`` names, ready to call as ``tool(**arguments)``: a function gets ``kwargs``
    bound, a class is instantiated once with them, an ``http://`` URL becomes a ``RemoteTool``
    (whose kwargs are the client's: ``timeout``, ``retries``)."""
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        from unirl.tools.remote import RemoteTool

        shared._check_bound_kwargs(spec, RemoteTool, kwargs, kind="tool", error=ToolError)
        return RemoteTool(spec, **kwargs)
    obj = resolve_tool(spec)
    if inspect.isclass(obj):
        shared._check_bound_kwargs(spec, obj, kwargs, kind="tool", error=ToolError)
        try:
            return obj(**kwargs)
        except ToolError:
            raise
        except Exception as err:
            raise ToolError(f"tool {spec!r}: {obj.__name__}(**{kwargs!r}) raised {type(err).__name__}: {err}") from err
    if not kwargs:
        return obj
    shared._check_bound_kwargs(spec, obj, kwargs, kind="tool", error=ToolError, skip_first=False)
    bound = _Bound(obj, **kwargs)
    functools.update_wrapper(bound, obj)
    return bound


class _Bound(functools.partial):
    """A tool function with the config's kwargs bound, which a call may not replace: the model's
    arguments naming one are refused (a plain partial lets them win over the config)."""

    def __call__(self, /, *args, **arguments):
        named = sorted(set(self.keywords) & set(arguments))
        if named:
            raise ToolError(f"argument(s) {', '.join(map(repr, named))} are settings of tool "
                            f"{getattr(self.func, '__name__', self.func)!r} from the config; a call may not change them")
        return super().__call__(*args, **arguments)


def resolve_tool(spec: str) -> ToolFn:
    """The function or class ``spec`` names (not a URL), not yet bound or instantiated."""
    if not isinstance(spec, str) or not spec:
        raise ToolError(f"a tool spec must be a non-empty string, got {spec!r}")
    if ":" in spec:
        return shared.resolve_object(spec, kind="tool", error=ToolError)
    if spec.endswith(".py"):
        raise ToolError(f"tool {spec!r}: name the function too, as {spec}:function")
    _ensure_registered(spec)
    return TOOLS.get(spec)


def tool_name(spec: str) -> str:
    """The name the model calls a tool by: its registered name, or the function's for a file or
    module spec (``tools/lookup.py:lookup`` -> ``lookup``); a URL's is asked of the server."""
    if ":" in spec and not spec.startswith(("http://", "https://")):
        return spec.rsplit(":", 1)[1]
    return spec


def list_tools() -> list[ToolInfo]:
    """Every registered tool, sorted by name: built-ins, every ``unirl.tools`` entry point, and tools
    registered by modules imported so far."""
    shared._ensure_builtins(registry)
    for ep in shared._entry_points(registry.ENTRY_POINT_GROUP):
        _load_entry_point(ep)
    return [registry._INFO[name] for name in TOOLS]


def unavailable_tools() -> dict[str, str]:
    """Built-in tool modules and entry points that could not be imported, with what to do about it."""
    shared._ensure_builtins(registry)
    return dict(registry._UNAVAILABLE)


def _ensure_registered(name: str) -> None:
    shared._ensure_builtins(registry)
    if name not in TOOLS:
        for ep in shared._entry_points(registry.ENTRY_POINT_GROUP):
            if ep.name == name:
                _load_entry_point(ep)
    if name not in TOOLS:
        message = (TOOLS.unknown_message(name) + ". Or give path/to/file.py:function, package.module:function, "
                   f"http://host:port, or install a package with a {registry.ENTRY_POINT_GROUP!r} entry point.")
        if registry._UNAVAILABLE:
            message += " Tools that could not be loaded: " + "; ".join(registry._UNAVAILABLE.values())
        raise ToolError(message)


def _load_entry_point(ep) -> None:
    """Register the object an entry point names under the entry point's name (an import error is
    recorded as unavailable, as for rewards)."""
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
    if ep.name in TOOLS and TOOLS.get(ep.name) is not obj:
        raise ToolError(f"tool {ep.name!r} from {where} ({ep.value}) clashes with the tool of that name from "
                        f"{registry._INFO[ep.name].source}; uninstall one, or register under another name")
    if ep.name not in TOOLS:
        register_tool(ep.name)(obj)
    registry._INFO[ep.name] = dataclasses.replace(registry._INFO[ep.name], source=f"{where} ({ep.value})")
