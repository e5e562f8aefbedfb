"""From a config's tool spec (``rollout.tools[i]``) to a callable with the config's kwargs bound.

The resolving is the one rewards and tools share (``unirl/plugins.py``), over the tool registry
(``TOOLS``): the same five ways of naming, the same messages (unknown name with close matches, missing
file, module or function, misspelt kwarg, missing optional package).
"""

from __future__ import annotations

import functools
from typing import Any

from unirl.tools.registry import TOOLS, ToolError, ToolFn, ToolInfo
from unirl.tools.remote_client import RemoteTool


def load_tool(spec: str, **kwargs: Any) -> ToolFn:
    """The tool ``spec`` names, ready to call as ``tool(**arguments)``: a function gets ``kwargs``
    bound, a class is instantiated once with them, an ``http://`` URL becomes a ``RemoteTool``
    (whose kwargs are the client's: ``timeout``, ``retries``)."""
    return TOOLS.load(spec, kwargs, remote=RemoteTool, bind=_Bound)


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
    return TOOLS.resolve(spec)


def tool_name(spec: str) -> str:
    """The name the model calls a tool by: its registered name, or the function's for a file or
    module spec (``tools/lookup.py:lookup`` -> ``lookup``); a URL's is asked of the server."""
    if ":" in spec and not spec.startswith(("http://", "https://")):
        return spec.rsplit(":", 1)[1]
    return spec


def list_tools() -> list[ToolInfo]:
    """Every registered tool, sorted by name: built-ins, every ``unirl.tools`` entry point, and tools
    registered by modules imported so far."""
    return TOOLS.listing()


def unavailable_tools() -> dict[str, str]:
    """Built-in tool modules and entry points that could not be imported, with what to do about it."""
    TOOLS.ensure_builtins()
    return dict(TOOLS.unavailable)
