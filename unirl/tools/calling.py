"""A rollout's tool calls, run together: every call of a turn of the whole batch at once, at most
``max_concurrency`` at a time, each with a timeout, errors turned into observations.

A call that raises, times out, returns something other than a string, names an unknown tool, or could
not be parsed (``ToolCall.error`` set by the format) never ends the run: its observation is
``error_text`` with ``{error}`` filled in, and ``ToolResult.error`` says what happened so the rollout
counts it (``rollout/tool_errors``). A synchronous tool runs in a thread, at most ``max_concurrency``
calls at once; a timed-out thread cannot be killed and finishes in the background (its result is
dropped). Each call runs in a daemon thread of its own, so a tool that hangs for ever keeps neither
the run nor the process's exit waiting (a pool's threads are joined at exit: the run printed "done" and
never ended); ``close`` names the tools still running. A result is made valid UTF-8 (a lone surrogate
becomes U+FFFD) so that tokenizing it cannot fail.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)


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
        check_error_text(error_text)
        self.tools = dict(tools)
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.error_text = error_text
        self._running: set[threading.Thread] = set()  # synchronous calls not yet returned (timed-out ones too)
        self._lock = threading.Lock()

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
        return ToolResult(valid_utf8(text), error, time.perf_counter() - start)

    def _unknown(self, call: ToolCall) -> str | None:
        if call.name in self.tools:
            return None
        return f"unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}"

    async def _invoke(self, call: ToolCall):
        fn = self.tools[call.name]
        target = fn.__call__ if not inspect.isfunction(fn) and not inspect.ismethod(fn) and hasattr(fn, "__call__") else fn
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target):
            return await fn(**call.arguments)
        return await self._in_daemon_thread(call.name, lambda: fn(**call.arguments))

    def _in_daemon_thread(self, name: str, work: Callable[[], Any]) -> asyncio.Future:
        """``work()`` in a daemon thread named for the tool, counted in ``still_running`` until it returns."""

        def started(thread):
            with self._lock:
                self._running.add(thread)

        def finished(thread):
            with self._lock:
                self._running.discard(thread)

        return in_daemon_thread(work, name=f"unirl-tool {name}", started=started, finished=finished)

    def still_running(self) -> list[str]:
        """The tools whose calls have not returned (hung past their timeout, or still working)."""
        with self._lock:
            return sorted(t.name.removeprefix("unirl-tool ") for t in self._running)

    def close(self) -> None:
        """Nothing waits for a hung call (its thread is a daemon); say which tools were left running."""
        hung = self.still_running()
        if hung:
            logger.warning("tool calls still running at the end, not waited for: %s", ", ".join(hung))


def check_error_text(error_text: str, key: str = "rollout.tool_error_text") -> None:
    """Refuse an error text whose placeholders are not exactly ``{error}`` (found at load, not at the
    first failed call)."""
    try:
        error_text.format(error="x")
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"{key} {error_text!r}: only the placeholder {{error}} is filled in "
                         f"({type(err).__name__}: {err}); write a literal brace as {{{{ or }}}}") from None


def valid_utf8(text: str | None) -> str | None:
    """``text`` with lone surrogates (which no tokenizer or file accepts) replaced by U+FFFD; a pair
    written as two code points is joined."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def in_daemon_thread(work: Callable[[], Any], *, name: str, started: Callable[[threading.Thread], Any] | None = None,
                     finished: Callable[[threading.Thread], Any] | None = None) -> asyncio.Future:
    """``work()`` in a daemon thread called ``name`` (a hung call never keeps the process alive); its outcome
    lands in the returned future, or is dropped when the loop has gone on without it (a timed-out call) or
    has closed. ``started(thread)`` runs before the thread starts, ``finished(thread)`` in it once ``work``
    has returned or raised (the tools' and the environments' calls both run this way)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def body():
        try:
            outcome = (work(), None)
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting call, which names it
            outcome = (None, err)
        if finished is not None:
            finished(threading.current_thread())
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop has closed: the call timed out long ago
            pass

    thread = threading.Thread(target=body, name=name, daemon=True)
    if started is not None:
        started(thread)
    thread.start()
    return future
