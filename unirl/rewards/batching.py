"""A bounded queue that gathers concurrent requests into batches for one worker thread.

``serve-reward`` puts every ``POST /score`` here; one worker takes the waiting requests together
(up to ``max_batch`` samples), scores them with one call in its own thread, and hands each request
its own answer. The policy is the dynamic batching of inference servers (Triton's
``max_queue_delay_microseconds``): a batch is taken when it is full, or when its oldest request has
waited ``max_wait`` seconds, whichever comes first. While the worker is busy, requests pile up and
the next batch takes them all, so under load the reward is called far fewer times than it is asked.

``max_queue`` bounds the requests waiting (not counting the batch being scored): one more is refused
at once with ``QueueFull``, which the server answers with 503, so a client backs off instead of
waiting behind an unbounded queue.

Nothing here knows about rewards: ``call(items) -> outcomes`` scores a batch (an outcome may be an
exception, given to that request alone) and ``size(item)`` counts an item's samples.
"""

from __future__ import annotations

import asyncio
import collections
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already."""


@dataclass
class _Waiting:
    item: Any
    size: int
    arrived: float
    answer: asyncio.Future = field(repr=False)


class BatchQueue:
    """Gather ``submit``-ted items into batches for ``call``, run in one worker thread.

    Args:
        call: scores a batch: ``call(items)`` returns one outcome per item, in order; an outcome
            that is an exception is raised to that item's ``submit`` alone.
        size: an item's weight against ``max_batch`` (its number of samples).
        max_batch: the most samples in one call; an item larger than that is called alone.
        max_wait: seconds a batch may wait for more items after its oldest one arrived.
        max_queue: the most items waiting; ``submit`` raises ``QueueFull`` beyond that.

    ``start()`` and ``stop()`` run inside the event loop (an ASGI app's lifespan).
    """

    def __init__(self, call: Callable[[list[Any]], Sequence[Any]], *, size: Callable[[Any], int] = lambda item: 1,
                 max_batch: int = 256, max_wait: float = 0.002, max_queue: int = 1024):
        if max_batch < 1 or max_queue < 1 or max_wait < 0:
            raise ValueError(f"max_batch and max_queue must be >= 1 and max_wait >= 0, "
                             f"got {max_batch}, {max_queue}, {max_wait}")
        self.call, self.size = call, size
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait, max_queue
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._waiting_size = 0
        self._scoring = 0  # items in the batch being scored
        self.batches = 0  # calls made so far
        self.answered = 0  # items answered so far (with scores or an error)
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._arrived = asyncio.Event()
        # One thread: a model reward is never called from two threads at once.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="serve-reward")
        self._worker = asyncio.get_running_loop().create_task(self._work())

    async def stop(self) -> None:
        """Stop the worker and fail what is still waiting. (uvicorn runs this after the requests in
        flight were answered, or its grace period ran out; a call still running in the thread is left.)"""
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.answer.done():
                waiting.answer.set_exception(QueueFull("the server is shutting down"))
        if self._executor is not None:  # a call still running (a hung reward) is abandoned, not waited for
            self._executor.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, int]:
        """Items waiting and being scored now; calls made and items answered so far."""
        return {"queued": len(self._waiting), "scoring": self._scoring, "batches": self.batches, "answered": self.answered}

    async def submit(self, item: Any) -> Any:
        """``item``'s outcome once its batch is scored (raised if it is an exception)."""
        if self._arrived is None:
            raise RuntimeError("BatchQueue.submit before start()")
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"{len(self._waiting)} request(s) waiting already (max_queue={self.max_queue})")
        loop = asyncio.get_running_loop()
        waiting = _Waiting(item, max(1, self.size(item)), loop.time(), loop.create_future())
        self._waiting.append(waiting)
        self._waiting_size += waiting.size
        self._arrived.set()
        return await waiting.answer

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # 1. Wait for a first item, then for more until the batch is full or the oldest has waited max_wait.
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            while self._waiting_size < self.max_batch:
                left = self._waiting[0].arrived + self.max_wait - loop.time()
                if left <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    break
            # 2. Take the oldest items that fit (the first always does).
            batch = [self._waiting.popleft()]
            total = batch[0].size
            while self._waiting and total + self._waiting[0].size <= self.max_batch:
                total += self._waiting[0].size
                batch.append(self._waiting.popleft())
            self._waiting_size -= total
            # 3. Score them with one call in the worker thread; hand each its outcome.
            self._scoring = len(batch)
            try:
                outcomes = await loop.run_in_executor(self._executor, self.call, [w.item for w in batch])
                if len(outcomes) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} items gave {len(outcomes)} outcomes")
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # a bug in ``call`` (or a SystemExit): every item of the batch gets it
                outcomes = [err] * len(batch)
            finally:
                self._scoring = 0
            self.batches += 1
            for waiting, outcome in zip(batch, outcomes):
                self.answered += 1
                if waiting.answer.done():  # the client went away
                    continue
                if isinstance(outcome, BaseException):
                    waiting.answer.set_exception(outcome)
                else:
                    waiting.answer.set_result(outcome)
