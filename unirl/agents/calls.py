"""Calling an environment's code without letting it hang or break the run: each call with a timeout,
a plain method in a daemon thread of its own (a timed-out thread cannot be killed; it finishes in the
background and its result is dropped, and neither the run nor the process's exit waits for it, as
``unirl/tools/calling.py`` does for tools), an ``async def`` one awaited on the loop.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Awaitable, Callable

from unirl.tools.calling import in_daemon_thread


class EnvFailure(Exception):
    """An environment's call raised, returned something invalid, or timed out; ``what`` says which."""

    def __init__(self, what: str, *, timed_out: bool = False):
        super().__init__(what)
        self.what, self.timed_out = what, timed_out


async def guarded(fn: Callable, *args: Any, what: str, timeout_s: float) -> Any:
    """``fn(*args)``'s result (awaited when it is a coroutine), or ``EnvFailure`` naming ``what`` when it
    raises or runs past ``timeout_s``. A cancellation (the run stopping) goes through."""
    try:
        return await asyncio.wait_for(_call(fn, args, what), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise EnvFailure(f"{what} timed out after {timeout_s:g} s", timed_out=True) from None
    except EnvFailure:
        raise
    except Exception as err:  # the environment's own failure: this episode ends, the run goes on
        raise EnvFailure(f"{what} raised {type(err).__name__}: {_one_line(err)}") from err


async def _call(fn: Callable, args: tuple, what: str) -> Any:
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return await fn(*args)
    result = await in_daemon_thread(lambda: fn(*args), name=f"unirl-env {what}")
    if inspect.isawaitable(result):  # a plain method that returned a coroutine
        return await result
    return result


def run_coroutine(coroutine: Awaitable) -> Any:
    """Run ``coroutine`` to completion from synchronous code: on a new event loop in this thread, or,
    when this thread already runs one (a notebook, a caller's async code), in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    box: dict[str, Any] = {}

    def body():
        try:
            box["result"] = asyncio.run(coroutine)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=body, name="unirl-episodes", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"
