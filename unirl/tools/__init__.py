"""Tools a policy calls during a multi-turn text rollout (Search-R1's search, a calculator, yours).

By job: ``registry.py`` (the contract, ``register_tool``), ``loading.py`` (a config's spec to a
callable, through the resolver rewards and tools share, ``unirl/plugins.py``), ``calling.py`` (a batch
of calls run concurrently with a timeout, errors turned into observations), ``formats.py`` (how calls
and observations look in the text: Search-R1 tags or the chat template's ``<tool_call>``), the built-in
tools (``calculator.py``, ``search.py``), ``remote.py`` (``unirl serve-tool``) and ``remote_client.py``
(``RemoteTool``, its client). Importing this package is cheap: the built-in tool modules are imported
on the first lookup of a name.
"""

from unirl.tools.loading import list_tools, load_tool, resolve_tool, tool_name, unavailable_tools
from unirl.tools.registry import ENTRY_POINT_GROUP, TOOLS, ToolError, ToolInfo, register_tool

__all__ = ["ENTRY_POINT_GROUP", "TOOLS", "ToolError", "ToolInfo", "list_tools", "load_tool", "register_tool",
           "resolve_tool", "tool_name", "unavailable_tools"]
