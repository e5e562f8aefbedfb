"""Turns of many episodes (or calls of many agent sessions) sent to an engine together: ``TurnBatcher``.

An episode (an asyncio task) asks for its next turn with ``await batcher.generate(index, context, budget)``
and waits; the batcher decides when the waiting requests go to the engine as one ``generate`` call. That
decision is made in one place, ``TurnBatcher.ready``:

* **lock-step** (``eager=False``, the synchronous rollout): a batch goes once every episode still playing
  is waiting. The engine runs in the event loop's thread, so the batches are those of a lock-step loop
  whatever the environments' timing, and a seeded run repeats exactly (docs/agents.md). An environment
  waiting on I/O holds everyone's next turn until it answers.
* **eager** (``eager=True``: streamed episodes, ``source.stream``, and the agent endpoint): whatever is
  waiting goes as soon as the engine is free, and the engine runs in a worker thread, so environments
  keep answering (their I/O overlaps generation) and the turns that became ready meanwhile form the next
  batch. The batches then depend on timing: runs are not bit-for-bit repeatable.

Requests carry their sampling settings; one engine call takes requests with equal settings only (an
episode runner's are all equal; agent sessions may differ). Runs of k equal contexts (a group's first
turn) become one request with ``n = k`` when every run has the same k, so vLLM shares the prompt's prefill.
"""

from __future__ import annotations

import asyncio
from typing import Any

from unirl.rollout.engine import call_seed


class TurnBatcher:
    """See the module docstring. ``engine``: anything with the ``Engine.generate`` signature; ``sampling``:
    the default sampling keyword arguments; ``live``: the episodes playing (lock-step counts them)."""

    def __init__(self, engine, sampling: dict | None = None, live: int = 0, *, eager: bool = False):
        self.engine, self.sampling, self.live, self.eager = engine, dict(sampling or {}), live, eager
        #: (index, context, budget, sampling, answer) of the requests waiting.
        self.pending: list[tuple[int, list[int], int, dict, asyncio.Future]] = []
        self.busy = False  # an eager engine call is running
        self.calls = 0  # engine calls made, and the requests they answered (batch sizes' sum); a feed's
        self.requests = 0  # figures reset these
        self.sent = 0  # engine calls made, never reset: a seeded call n samples from call_seed(seed, n)

    async def generate(self, index: int, context: list[int], budget: int, sampling: dict | None = None):
        """The next turn of episode ``index`` (a ``Generation`` of at most ``budget`` tokens, when every
        request of its batch asked that few: the caller cuts it), sampled with ``sampling`` (default: the
        batcher's)."""
        answer = asyncio.get_running_loop().create_future()
        self.pending.append((index, context, budget, self.sampling if sampling is None else sampling, answer))
        self._send_when_ready()
        return await answer

    def leave(self) -> None:
        """An episode is over: the others no longer wait for it."""
        self.live -= 1
        self._send_when_ready()

    def ready(self) -> bool:
        """Whether the waiting requests go now: THE place the two modes differ."""
        if not self.pending or self.busy:
            return False
        return self.eager or len(self.pending) >= self.live

    def _send_when_ready(self) -> None:
        if not self.ready():
            return
        batch = self._take()
        contexts, budget, sampling = [p[1] for p in batch], max(p[2] for p in batch), batch[0][3]
        self.calls, self.requests = self.calls + 1, self.requests + len(batch)
        if "seed" in sampling:  # a seeded run: each call its own seeds, so no two turns sample alike
            sampling = {**sampling, "seed": call_seed(sampling["seed"], self.sent)}
        self.sent += 1
        if not self.eager:
            try:
                self._settle(batch, self._generate(contexts, budget, sampling), None)
            except BaseException as err:  # the engine's failure stops the run: every waiting episode gets it
                self._settle(batch, None, err)
            return
        self.busy = True
        task = asyncio.ensure_future(asyncio.to_thread(self._generate, contexts, budget, sampling))
        task.add_done_callback(lambda done: self._finished(batch, done))

    def _finished(self, batch: list, done: asyncio.Future) -> None:
        self.busy = False
        if done.cancelled():
            self._settle(batch, None, asyncio.CancelledError())
        else:
            self._settle(batch, done.result() if done.exception() is None else None, done.exception())
        self._send_when_ready()  # what became ready meanwhile

    def _take(self) -> list:
        """The requests of one engine call: lock-step, every one (ordered by episode, so a seeded run
        repeats); eager, those sampled like the oldest waiting one."""
        if not self.eager:
            batch, self.pending = sorted(self.pending, key=lambda p: p[0]), []
            return batch
        first = self.pending[0][3]
        batch = [p for p in self.pending if p[3] == first]
        self.pending = [p for p in self.pending if p[3] != first]
        return sorted(batch, key=lambda p: p[0])

    @staticmethod
    def _settle(batch: list, gens: list | None, error: BaseException | None) -> None:
        for k, (*_, answer) in enumerate(batch):
            if answer.done():  # its episode was cancelled meanwhile
                continue
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(gens[k])

    def _generate(self, contexts: list[list[int]], max_new_tokens: int, sampling: dict[str, Any]) -> list:
        """One engine call; runs of k equal contexts as one request with n = k when every run has the same k."""
        runs = [1]
        for a, b in zip(contexts, contexts[1:]):
            runs[-1:] = [runs[-1] + 1] if a == b else [runs[-1], 1]
        k = runs[0]
        if k > 1 and all(r == k for r in runs):
            unique = contexts[::k]
            return [g for gs in self.engine.generate(unique, n=k, max_new_tokens=max_new_tokens, **sampling) for g in gs]
        return [gs[0] for gs in self.engine.generate(contexts, n=1, max_new_tokens=max_new_tokens, **sampling)]
