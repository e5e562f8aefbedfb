"""A rollout's tool calls, run together: every call of a turn of the whole batch at once, at most
``max_concurrency`` at a time, each with a timeout, errors turned into observations.

A call that raises, times out, returns something other than a string, names an unknown tool, or could
not be parsed (``ToolCall.error`` set by the format) never ends the run: its observation is
``error_text`` with ``{error}`` filled in, and ``ToolResult.error`` says what happened so the rollout
counts it (``rollout/tool_errors``). A synchronous tool runs in a thread of a pool of
``max_concurrency``; a timed-out thread cannot be killed and finishes in the background (its result
is dropped), so a tool that hangs for ever holds one of the pool's threads.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ToolCall:
    """One call the model made: a tool's name and its arguments, or the reason it could not be parsed."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    #: Set by the call format when the text was a call but not a well-formed one.
    error: str | None = None


@dataclass
class ToolResult:
    text: str  # what the model is shown (the error observation for a failed call)
    error: str | None  # None: the tool answered
    latency_s: float


class ToolRunner:
    """Runs batches of ``ToolCall``s against the tools by name (``{name: callable}``)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], *, timeout_s: float = 30.0, max_concurrency: int = 32,
                 error_text: str = "Error: {error}"):
        if timeout_s <= 0 or max_concurrency < 1:
            raise ValueError(f"tool timeout_s must be > 0 and max_concurrency >= 1, got {timeout_s}, {max_concurrency}")
        self.tools = dict(tools)
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.error_text = error_text
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="unirl-tool")

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """The results of ``calls``, in order. Blocks until every call has answered or timed out."""
        if not calls:
            return []
        return asyncio.run(self._run_all(calls))

    async def _run_all(self, calls: list[ToolCall]) -> list[ToolResult]:
        limit = asyncio.Semaphore(self.max_concurrency)

        async def one(call: ToolCall) -> ToolResult:
            async with limit:
                return await self._run_one(call)

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def _run_one(self, call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        error = call.error or self._unknown(call)
        text = None
        if error is None:
            try:
                text = await asyncio.wait_for(self._invoke(call), timeout=self.timeout_s)
                if not isinstance(text, str):
                    error = f"tool {call.name!r} returned a {type(text).__name__}, not a string"
            except asyncio.TimeoutError:
                error = f"tool {call.name!r} timed out after {self.timeout_s:g} s"
            except Exception as err:  # the tool's own failure: shown to the model, counted
                error = f"tool {call.name!r} raised {type(err).__name__}: {err}"
        if error is not None:
            text = self.error_text.format(error=error)
        return ToolResult(text, error, time.perf_counter() - start)

    def _unknown(self, call: ToolCall) -> str | None:
        if call.name in self.tools:
            return None
        return f"unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}"

    async def _invoke(self, call: ToolCall):
        fn = self.tools[call.name]
        target = fn.__call__ if not inspect.isfunction(fn) and not inspect.ismethod(fn) and hasattr(fn, "__call__") else fn
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target):
            return await fn(**call.arguments)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(**call.arguments))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
