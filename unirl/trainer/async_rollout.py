"""Asynchronous rollouts with bounded staleness (``rollout.max_staleness: k``, docs/async.md).

A producer thread samples and scores the next batches while the trainer updates on the current one,
with weights at most k training steps old. The schedule is fixed, so a run repeats and resumes
exactly (it never depends on which thread was faster):

    batch s (the one training step s trains, s = 0, 1, ...) is sampled with the weights after
    step max(s0, s - k), where s0 is the step this run (or its resume) started at.

k = 1 is verl's one-step-off: step s-1 trains on batch s-1 while batch s is sampled with the weights
step s-1 started from. The trainer publishes a copy of its weights at the start of each step
(``publish``); the producer loads the version a batch needs into the engine between two generations,
under ``engine_lock``, so a weight sync never lands inside a generation. The sample's
``Rollout.policy_version`` is the optimizer-step count of the weights that sampled it, and
``rollout/staleness_*`` is the trainer's count minus it, in optimizer steps (k training steps are k
optimizer steps with one mini-batch and one epoch, the default).

Checkpoints (``state_dict``): the producer is drained first (it finishes every batch the published
weights allow: batches s..s+k-1 after step s, and it may not start batch s+k, whose weights are
published only at the next step's start), and those finished batches are saved with the trainer
state, so a resumed run trains on exactly the batches the uninterrupted run would have. A run
extended past its ``total_steps`` samples its first new batches with the weights it resumed from.

Several processes: each runs its own producer and engine on its own share of the prompts; the
producer calls no collective, so the trainer's collectives stay in the main thread in one order.
Dynamic sampling counts kept groups over processes (a collective), so it runs asynchronously on one
process only (refused at setup otherwise).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from unirl.env import LOOP_FIELDS, Rollout


@dataclass
class Produced:
    """One batch from the producer: the scored rollout, as the synchronous loop's rollout and score stages give it."""

    rollout: Rollout
    rewards: torch.Tensor  # [N]
    reward_metrics: dict[str, float]
    filter_metrics: dict[str, float] | None  # dynamic sampling's filter/* figures
    version: int  # the training steps of the weights that sampled it
    optimizer_steps: int  # the optimizer steps of those weights (Rollout.policy_version)


class AsyncRollouts:
    """The producer thread and its bookkeeping: published weight versions, finished batches, wait times.

    ``produce(s)`` samples and scores batch s (runs in the producer thread); ``load_weights(snapshot)``
    puts a published snapshot into the engine (called under ``engine_lock``)."""

    def __init__(self, max_staleness: int, total_steps: int, produce: Callable[[int], tuple],
                 load_weights: Callable[[Any], None]):
        if max_staleness < 1:
            raise ValueError(f"rollout.max_staleness must be >= 1 for asynchronous rollouts, got {max_staleness}")
        self.k, self.total_steps = max_staleness, total_steps
        self.produce, self.load_weights = produce, load_weights
        self.engine_lock = threading.Lock()  # held for a load and a generation, and by the trainer's evaluation
        self._cond = threading.Condition()
        self._weights: dict[int, tuple[Any, int]] = {}  # version -> (snapshot, optimizer steps)
        self._ready: dict[int, Produced] = {}  # batch index -> finished batch
        self._start = 0  # s0: the step this run started at
        self._next = 0  # the next batch the producer samples
        self._busy = False  # sampling a batch now
        self._loaded: int | None = None  # the version in the engine
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._waited_for_weights = 0.0  # since the last ``step_metrics``

    # ------------------------------------------------------------ schedule
    def version_for(self, batch: int) -> int:
        """The weight version (training steps) that samples ``batch``."""
        return max(self._start, batch - self.k)

    def start(self, step: int, snapshot: Any, optimizer_steps: int) -> None:
        """Publish the trainer's weights as version ``step`` and start the producer after the batches
        a resumed checkpoint restored."""
        self._start = step
        self._next = max([step - 1, *self._ready]) + 1
        self.publish(step, snapshot, optimizer_steps)
        self._thread = threading.Thread(target=self._run, name="unirl-rollout-producer", daemon=True)
        self._thread.start()

    def publish(self, version: int, snapshot: Any, optimizer_steps: int) -> None:
        """The trainer's weights after ``version`` training steps, for the batches that need them."""
        with self._cond:
            self._weights.setdefault(version, (snapshot, optimizer_steps))
            self._cond.notify_all()

    def needs_weights(self, version: int) -> bool:
        """Whether a batch still to be sampled is sampled with version ``version`` (else no snapshot is made)."""
        with self._cond:
            return version not in self._weights and any(
                self.version_for(s) == version for s in range(self._next, self.total_steps))

    # ------------------------------------------------------------ trainer side
    def get(self, step: int) -> tuple[Produced, float]:
        """Batch ``step`` and the seconds the trainer waited for it; re-raises the producer's error."""
        start = time.perf_counter()
        with self._cond:
            while step not in self._ready:
                self._raise_if_failed()
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(f"asynchronous rollouts: batch {step} was never produced (the producer stopped)")
                self._cond.wait(timeout=1.0)
            return self._ready.pop(step), time.perf_counter() - start

    def drain(self) -> None:
        """Wait until the producer has finished every batch the published weights allow and is idle."""
        with self._cond:
            while self._thread is not None and self._thread.is_alive() and (self._busy or self._can_produce()):
                self._raise_if_failed()
                self._cond.wait(timeout=1.0)
            self._raise_if_failed()

    def exclusive_engine(self):
        """The engine for the trainer (evaluation, its own weight sync): the producer drained and locked out;
        the next batch reloads its own weights."""
        rollouts = self

        class _Exclusive:
            def __enter__(self):
                rollouts.drain()
                rollouts.engine_lock.acquire()

            def __exit__(self, *exc):
                rollouts._loaded = None
                rollouts.engine_lock.release()

        return _Exclusive()

    def step_metrics(self, produced: Produced, optimizer_steps: int, waited_for_data: float) -> dict[str, float]:
        staleness = (optimizer_steps - produced.rollout.policy_version).float()  # [N]
        with self._cond:
            waited_for_weights, self._waited_for_weights = self._waited_for_weights, 0.0
        return {"rollout/staleness_mean": staleness.mean().item(), "rollout/staleness_max": staleness.max().item(),
                "perf/wait_for_data_s": waited_for_data, "perf/wait_for_weights_s": waited_for_weights}

    def close(self, wait: bool = True) -> None:
        """Stop the producer after its current generation (given up, not saved). ``wait=False`` (a run
        ending on an error or a second signal) does not wait for that generation: the thread is a daemon."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None and wait:
            self._thread.join()

    # ------------------------------------------------------------ producer side
    def _can_produce(self) -> bool:
        return self._next < self.total_steps and self.version_for(self._next) in self._weights

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                waited = time.perf_counter()
                while not self._closing and self._next < self.total_steps and not self._can_produce():
                    self._cond.wait()
                self._waited_for_weights += time.perf_counter() - waited
                if self._closing or self._next >= self.total_steps:
                    self._cond.notify_all()
                    return
                batch, version = self._next, self.version_for(self._next)
                snapshot, optimizer_steps = self._weights[version]
                self._busy = True
            try:
                with self.engine_lock:
                    if self._loaded != version:
                        self.load_weights(snapshot)
                        self._loaded = version
                    rollout, rewards, reward_metrics, filter_metrics = self.produce(batch)
                rollout.policy_version = torch.full((len(rollout),), optimizer_steps, dtype=torch.long)  # [N]
                produced = Produced(rollout, rewards, reward_metrics, filter_metrics, version, optimizer_steps)
            except BaseException as e:  # the trainer raises it at its next get/drain
                with self._cond:
                    self._error, self._busy = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[batch] = produced
                self._next, self._busy = batch + 1, False
                needed = {self.version_for(s) for s in range(self._next, self.total_steps)}
                self._weights = {v: w for v, w in self._weights.items() if v in needed or v > version}
                self._cond.notify_all()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The finished batches not yet trained (after draining), as tensors and plain data."""
        self.drain()
        return {"max_staleness": self.k, "batches": [_produced_state(s, p) for s, p in sorted(self._ready.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("max_staleness") != self.k:
            raise ValueError(f"the checkpoint's in-flight batches were sampled with rollout.max_staleness="
                             f"{state.get('max_staleness')}, this run has {self.k}; resume with the same value")
        self._ready = dict(_produced_from_state(item) for item in state["batches"])


def _produced_state(batch: int, p: Produced) -> dict[str, Any]:
    r = p.rollout
    loop = {name: getattr(r, name) for name in LOOP_FIELDS if getattr(r, name) is not None}
    return {"batch": batch, "version": p.version, "optimizer_steps": p.optimizer_steps, "rewards": p.rewards,
            "reward_metrics": p.reward_metrics, "filter_metrics": p.filter_metrics,
            "rollout": {"tensors": r.tensors, "group_ids": r.group_ids, "prompts": r.prompts, "samples": r.samples,
                        "columns": r.columns, "loop": loop}}


def _produced_from_state(item: dict[str, Any]) -> tuple[int, Produced]:
    r = item["rollout"]
    rollout = Rollout(tensors=r["tensors"], group_ids=r["group_ids"], prompts=r["prompts"], samples=r["samples"],
                      columns=r["columns"], **r["loop"])
    return item["batch"], Produced(rollout, item["rewards"], item["reward_metrics"], item["filter_metrics"],
                                   item["version"], item["optimizer_steps"])


def produce_batch(trainer, batch: int) -> tuple[Rollout, torch.Tensor, dict[str, float], dict[str, float] | None]:
    """The synchronous loop's rollout and score stages for ``batch``, run by the producer thread."""
    if trainer.algo.filter_groups.enabled:  # DAPO: generate and score until enough groups vary
        filtered = trainer.dynamic_sampling(stop=False)
        return filtered.rollout, filtered.rewards, filtered.reward_metrics, filtered.metrics
    rollout = trainer.env.rollout(trainer.env.next_prompts(batch), trainer.cfg.group_size)
    rewards, reward_metrics = trainer.env.score(rollout)
    return rollout, rewards, reward_metrics, None


def build_async_rollouts(trainer, max_staleness: int) -> AsyncRollouts:
    """The producer of a run with ``rollout.max_staleness >= 1``; refuses what it cannot run."""
    env, acc = trainer.env, trainer.accelerator
    if not hasattr(env, "policy_snapshot"):
        raise ValueError(f"rollout.max_staleness={max_staleness}: {type(env).__name__} has no asynchronous "
                         f"rollouts (it needs policy_snapshot and load_policy_snapshot)")
    if trainer.cfg.strategy == "fsdp2":
        raise ValueError(f"rollout.max_staleness={max_staleness} with trainer.strategy=fsdp2 is not supported yet: the "
                         f"producer's weight snapshot is a whole copy of the policy, which a sharded policy does not "
                         f"have on any process; set rollout.max_staleness=0 or trainer.strategy=ddp")
    if trainer.algo.filter_groups.enabled and acc.num_processes > 1:
        raise ValueError(f"rollout.max_staleness={max_staleness} with algo.filter_groups.enabled runs on one process "
                         f"only: dynamic sampling counts groups over processes, which the producer thread cannot do "
                         f"beside the trainer's own collectives; set rollout.max_staleness=0 or use one process")
    return AsyncRollouts(max_staleness, trainer.cfg.total_steps, lambda s: produce_batch(trainer, s),
                         env.load_policy_snapshot)
