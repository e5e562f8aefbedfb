"""``RemoteTool``: a tool served by ``unirl serve-tool`` (``unirl/tools/remote.py``), called like any tool
(``rollout.tools: [{name: http://host:port}]``). The transport is the remote reward's
(``unirl/rewards/remote_client.py``)."""

from __future__ import annotations

import json
from typing import Any

from unirl.rewards.remote_client import RemoteReward
from unirl.tools.registry import ToolError


class RemoteTool(RemoteReward):
    """A tool served at ``url``, called like any tool: ``tool(**arguments) -> str``. The transport
    (``timeout`` per attempt, ``retries`` with ``backoff``) is the remote reward's."""

    def __call__(self, **arguments: Any) -> str:
        answer = self._request("POST", "/call", json.dumps({"arguments": arguments}).encode())
        text = answer.get("text")
        if not isinstance(text, str):
            raise ToolError(f"tool server {self.url} answered garbage: expected {{\"text\": ...}}, got {json.dumps(answer)[:200]}")
        return text
