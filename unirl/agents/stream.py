"""The run's environment played as a stream of episodes (``source.stream``): the feed of a
``unirl.rollout.stream.StreamSource``, so that episodes waiting on their environment never hold up the batch.

One asyncio loop in a thread of its own plays every episode: prompt batch b's rows, ``group_size`` episodes
each, are started as soon as the source allows (the trainer is at step b - ``max_staleness``), without
waiting for batch b-1 to finish. Each episode is the lock-step runner's ``play`` (``unirl/agents/runner.py``),
on one eager ``TurnBatcher`` (``unirl/rollout/batcher.py``): the turns that are ready go to the engine as soon
as it is free, the engine in a worker thread, so the environments' I/O (an HTTP call, a sandbox, a 200 ms
latency) overlaps generation and the trainer's update. The engine is a ``VersionedEngine``: the weights
the trainer publishes are loaded between two generations, and each token keeps the version that sampled it.

A group is finished when its ``group_size`` episodes are; the source takes the oldest finished groups (by
prompt batch, then row). An environment's failure ends its episode as in the lock-step runner; the engine's
failure, or a first observation too long for ``data.max_prompt_length``, stops the run (the source re-raises
it at the trainer's next step).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Callable

from unirl.agents.episodes import EpisodeRollout, traces_to_rollout
from unirl.agents.runner import players
from unirl.env import Rollout
from unirl.rollout.batcher import TurnBatcher


class EpisodeFeed:
    """Episodes of ``episodes`` (the run's environment) on ``engine`` (a ``VersionedEngine``), rows from
    ``prompts.next(b)``, ``group_size`` episodes a row."""

    def __init__(self, episodes: EpisodeRollout, engine, prompts, *, group_size: int):
        self.episodes, self.engine, self.prompts, self.group_size = episodes, engine, prompts, group_size
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batcher: TurnBatcher | None = None
        self._started_at = 0.0
        self._finished = 0  # episodes finished since the last ``metrics``
        self._in_flight = 0

    def start(self, groups, first_batch: int, may_start: Callable[[int], bool]) -> None:
        self._started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(groups, first_batch, may_start),
                                        name="unirl-episode-stream", daemon=True)
        self._thread.start()

    def _run(self, groups, first_batch: int, may_start) -> None:
        try:
            asyncio.run(self._main(groups, first_batch, may_start))
        except BaseException as err:  # noqa: BLE001 - the trainer raises it at its next step
            groups.fail(err)

    async def _main(self, groups, batch: int, may_start) -> None:
        self._loop = asyncio.get_running_loop()
        play = players(self.engine, self.episodes.tokenizer, self.episodes.make, **self.episodes.settings())
        self._batcher = TurnBatcher(self.engine, play.sampling, eager=True)
        play.start(self._batcher)
        tasks: set[asyncio.Task] = set()
        failed: list[BaseException] = []
        index = 0
        try:
            while not self._stopping and not failed:
                if not may_start(batch):
                    await asyncio.sleep(0.005)
                    continue
                for row_index, row in enumerate(self.prompts.next(batch)):
                    task = asyncio.ensure_future(self._group(play, groups, (batch, row_index), row, index, failed))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    index += self.group_size
                batch += 1
            if failed:
                raise failed[0]
        finally:
            for task in list(tasks):  # the run stops: episodes in flight are given up (and closed)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _group(self, play, groups, order: tuple[int, int], row: dict, first: int, failed: list) -> None:
        self._in_flight += self.group_size
        try:
            traces = await asyncio.gather(*[play.play(first + j, row) for j in range(self.group_size)])
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - the engine's failure or a prompt too long: the run stops
            failed.append(err)
            return
        finally:
            self._in_flight -= self.group_size
        self._finished += len(traces)
        groups.put(order, (row, traces))

    def to_rollout(self, items: list) -> Rollout:
        return traces_to_rollout([row for row, _ in items], [traces for _, traces in items], self.episodes.tokenizer,
                                 turn_discount=self.episodes.env_cfg.turn_discount)

    def waiting(self, finished: int, needed: int, waited_s: float) -> str:
        return (f"source.stream: {finished} of the {needed} groups of episodes a step trains finished within "
                f"{waited_s:g} s ({self._in_flight} episodes playing); is the environment answering?")

    def metrics(self) -> dict[str, float]:
        now = time.perf_counter()
        figures = {"stream/episodes_per_s": self._finished / max(now - self._started_at, 1e-9),
                   "stream/episodes_in_flight": float(self._in_flight)}
        if self._batcher is not None and self._batcher.calls:
            figures["stream/turns_per_engine_call"] = self._batcher.requests / self._batcher.calls
            self._batcher.calls = self._batcher.requests = 0
        self._finished, self._started_at = 0, now
        return figures

    def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                print("unirl: source.stream: episodes still closing after 30 s; left to finish in the background",
                      file=sys.stderr, flush=True)
