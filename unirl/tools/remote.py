"""Tools over HTTP: ``unirl serve-tool NAME`` hosts a tool (the search index, built once, shared by
every run and process that names it ``http://host:port``), and ``RemoteTool`` calls it.

The serving is the reward server's (``unirl/rewards/remote.py``, ``unirl/rewards/batching.py``): concurrent
requests join one call of the tool in one worker thread (the BM25 search retrieves them in one pass
through ``call_batch``), at most ``max_batch`` calls at once, a full queue answered 503, which the
client retries. The protocol:

- ``GET /info`` -> ``{"name", "description"}``; ``GET /health`` -> ``{"status": "ok", "queued",
  "scoring", "batches", "answered", ...}`` (the reward server's counters).
- ``POST /call`` with ``{"arguments": {...}}`` -> 200 ``{"text": "..."}``; 500 ``{"error": ...}`` when
  the tool raised or returned something other than a string; 400 for a malformed request.

The guards are the reward server's (``unirl/serving/guards.py``): arguments naming one of the server's
``--kwargs`` are refused (400), a body over ``--max-body-mb`` (413) or not arrived after
``--body-timeout-s`` (408) too, and with ``--token`` (or ``$UNIRL_REWARD_TOKEN``) every path but
``/health`` needs ``Authorization: Bearer <token>`` (401), which ``RemoteTool`` sends from its
``token`` kwarg or the same variable.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from unirl.rewards.batching import QueueFull
from unirl.serving.guards import Guards, Refused
from unirl.tools.registry import ToolError


def call_batch(tool, calls: list[dict]) -> list:
    """One outcome per call (the text, or the exception to answer that request with): the tool's own
    ``call_batch`` when it has one (a failure there fails the batch's requests alike), else one call each."""
    if hasattr(tool, "call_batch"):
        try:
            texts = tool.call_batch(calls)
        except Exception as err:
            return [err] * len(calls)
        return [_checked(t) for t in texts]
    outcomes = []
    for arguments in calls:
        try:
            result = tool(**arguments)
            if inspect.isawaitable(result):
                result = asyncio.run(result)
            outcomes.append(_checked(result))
        except Exception as err:
            outcomes.append(err)
    return outcomes


def _checked(text: Any):
    return text if isinstance(text, str) else ToolError(f"the tool returned a {type(text).__name__}, not a string")


def make_tool_server(spec: str, host: str = "127.0.0.1", port: int = 8000, kwargs: dict | None = None, *,
                     max_batch: int = 64, max_wait_ms: float = 2.0, max_queue: int = 1024, max_body_mb: float = 16.0,
                     body_timeout_s: float = 30.0, token: str | None = None):
    """A server (bound, not yet serving) for the tool ``spec`` with ``kwargs`` bound; a search index
    is built here, before the port opens. ``max_body_mb``, ``body_timeout_s`` and ``token`` (default
    ``$UNIRL_REWARD_TOKEN``): the guards of ``unirl/serving/guards.py``."""
    from unirl.rewards.batching import BatchQueue
    from unirl.serving.server import AppServer
    from unirl.tools.loading import load_tool, tool_name

    guards = Guards.from_settings("serve-tool", max_body_mb=max_body_mb, body_timeout_s=body_timeout_s, token=token,
                                  settings=kwargs or {})
    tool = load_tool(spec, **(kwargs or {}))
    queue = BatchQueue(lambda calls: call_batch(tool, calls), max_batch=max_batch, max_wait=max_wait_ms / 1000,
                       max_queue=max_queue)
    doc = (inspect.getdoc(tool) or "").strip()
    meta = {"name": tool_name(spec), "description": doc.splitlines()[0] if doc else ""}
    return AppServer(make_app(spec, meta, queue, guards), host, port)


def make_app(spec: str, meta: dict, queue, guards: Guards):
    @asynccontextmanager
    async def lifespan(app):
        queue.start()
        yield
        await queue.stop()

    app = FastAPI(title=f"serve-tool {spec}", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def answer(status: int, body: dict) -> JSONResponse:
        if status != 200:
            sys.stderr.write(f"serve-tool {spec}: {status}: {body['error'].splitlines()[0][:300]}\n")
        return JSONResponse(body, status_code=status)

    @app.get("/info")
    async def info(request: Request):
        try:
            guards.check_token(request)
        except Refused as err:
            return answer(err.status, {"error": str(err)})
        return answer(200, meta)

    @app.get("/health")
    async def health():
        return answer(200, {"status": "ok", **queue.stats(), "max_batch": queue.max_batch,
                            "max_wait_ms": queue.max_wait * 1000, "max_queue": queue.max_queue})

    @app.post("/call")
    async def call(request: Request):
        try:
            body = await guards.read_body(request)
        except Refused as err:
            return answer(err.status, {"error": str(err)})
        try:
            arguments = json.loads(body)["arguments"]
            if not isinstance(arguments, dict):
                raise ValueError("arguments must be an object")
        except Exception as err:
            return answer(400, {"error": f"malformed request: {type(err).__name__}: {err}"})
        try:  # the tool is called with the arguments as keyword arguments: they would replace the server's
            guards.check_names(arguments, "argument")
        except Refused as err:
            return answer(err.status, {"error": str(err)})
        try:
            text = await queue.submit(arguments)
        except QueueFull as err:
            return answer(503, {"error": f"tool server busy: {err}; try again later"})
        except asyncio.CancelledError:
            raise
        except Exception as err:
            return answer(500, {"error": f"tool {spec!r} raised {type(err).__name__}: {err}"})
        return answer(200, {"text": text})

    return app
