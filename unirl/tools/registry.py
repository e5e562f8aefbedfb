"""The tool contract and the names of tools: ``TOOLS``, ``register_tool`` and what is known about each
name. The bottom of the tools package (``unirl/tools/``); it imports nothing from it.

A tool is what a policy calls in the middle of a multi-turn rollout (``rollout.tools``). It is named
in a config exactly as a reward is (``unirl/plugins.py`` resolves both): a registered
name, an entry point of the ``unirl.tools`` group, ``path/to/file.py:function``,
``package.module:function``, or ``http://host:port`` (a tool served by ``unirl serve-tool``).

The contract, in one of two shapes:

1. **A callable**: ``tool(**arguments) -> str``, the call's arguments (``{"query": "..."}``) as
   keyword arguments, the observation as the return value. It may be ``async def``. Settings from the
   config (``rollout.tools: [{name: search, kwargs: {top_k: 3}}]``) are bound to its other keyword
   parameters.
2. **A class** instantiated once with the config's kwargs (a corpus to index, a client to open), then
   called like shape 1. It may also define ``call_batch(list_of_arguments) -> list[str]`` for a batch
   of calls at once (the BM25 search retrieves a batch of queries in one pass); ``unirl serve-tool``
   uses it when it joins concurrent requests.

A tool that raises, times out or returns something other than a string does not end the run: the
model is shown an error observation (``rollout.tool_error_text``) and the error is counted
(``rollout/tool_errors``); see ``unirl/tools/calling.py``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from unirl.plugins import Plugins
from unirl.registry import first_sentence

ToolFn = Callable[..., Any]

#: Modules whose import registers the built-in tools (a module needing an optional package imports it
#: first: if that fails, its tools are listed as unavailable with the package to install).
BUILTIN_MODULES: list[str] = ["unirl.tools.calculator", "unirl.tools.search"]

#: The entry-point group through which an installed package adds tools.
ENTRY_POINT_GROUP = "unirl.tools"


class ToolError(ValueError):
    """A tool cannot be loaded, or its kwargs do not fit it. The message names the tool."""


@dataclass(frozen=True)
class ToolInfo:
    """What ``unirl tools list`` shows about a registered tool."""

    name: str
    description: str
    #: ``built-in``, ``entry point <dist> <version> (<module:attr>)`` or ``module <name>``.
    source: str


#: The registered tools, with their ``ToolInfo`` (``TOOLS.info``) and the built-ins and entry points
#: that could not be loaded (``TOOLS.unavailable``).
TOOLS: Plugins = Plugins(
    "tool", builtin_modules=BUILTIN_MODULES, group=ENTRY_POINT_GROUP, error=ToolError,
    register=lambda name, obj: register_tool(name)(obj), package_dir=Path(__file__).resolve().parent,
    skip_first=False)


def register_tool(name: str, *, description: str | None = None) -> Callable[[ToolFn], ToolFn]:
    """Register a tool function or class under ``name`` (the name the model calls it by).
    ``description`` defaults to the docstring's first sentence."""

    def decorator(fn: ToolFn) -> ToolFn:
        if not callable(fn):
            raise TypeError(f"tool {name!r}: register a function or a class, got {type(fn).__name__}")
        TOOLS.add(name, fn)
        module = getattr(fn, "__module__", "?")
        source = "built-in" if module in TOOLS.builtin_modules else f"module {module}"
        about = description if description is not None else first_sentence(inspect.getdoc(fn) or "")
        TOOLS.info[name] = ToolInfo(name, about, source)
        return fn

    return decorator
