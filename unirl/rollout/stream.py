"""Streamed batches: samples arrive as they finish, from a feed that never waits for a batch boundary, and
each step takes the oldest finished groups. Two feeds: the run's own environment played as a stream of
episodes (``source.stream``, ``unirl/agents/stream.py``) and an agent's sessions recorded at the policy's
OpenAI-compatible endpoint (``source.agent``, ``unirl/rollout/sessions.py``).

* ``VersionedEngine``: the engine behind a lock, knowing the weights it holds. Each ``generate`` stamps
  its generations with their version (``Generation.version``: optimizer steps); weights the trainer
  publishes are loaded between two generations, so a sample's turns may come from several versions and
  each token keeps its own (``Rollout.token_version`` [N, T]).
* ``FinishedGroups``: the finished groups, ordered by where they were started (an episode group: its
  prompt batch and row; a session group: when its last session ended).
* ``StreamSource``: the batch source (``unirl.rollout.sources``' contract). ``get`` takes the oldest
  ``prompts_per_step`` finished groups, stamps each sample with its oldest token's version
  (``Rollout.policy_version``), leaves the tokens older than the staleness bound out of the loss
  (``unirl.core.within_staleness``) and scores the batch with the run's rewards.

The staleness bound ``k = source.max_staleness``: step s trains the tokens sampled with the weights of
step s-k or later (counted in training steps, as the threaded source does), and an episode feed starts
the episodes of prompt batch b only once the trainer is at step b-k, so at most k+1 batches are played
at once. With k >= 1 the engine has its own copy of the weights and the trainer publishes a
``WeightVersion`` after each update (``after_update``): generation never waits for the trainer. With k = 0
the engine pauses from the moment a step takes its batch until its update is in the engine: the tokens
of a sample still playing then are from the weights before that update, and leave the loss.

Not reproducible bit for bit (which turns share a batch and which version samples them depends on timing;
the lock-step source is the reproducible one), and a checkpoint holds no sample in flight: a resumed run
starts new episodes from the prompt batch of its step (an agent: new sessions). docs/agents.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Protocol

import torch

from unirl.core.rollout_correction import token_staleness_metrics, within_staleness
from unirl.env import Rollout
from unirl.rollout.batch import Batch


class VersionedEngine:
    """``engine`` behind a lock, holding the weights of version ``version`` (module docstring)."""

    def __init__(self, engine, version: int):
        self.engine, self.version = engine, version
        self.lock = threading.Lock()  # a load and a generation; the trainer's pause (k = 0) and evaluation
        self._next: tuple[Any, int] | None = None  # (WeightVersion or None, version) published, not loaded
        self._held = False
        self.tokenizer = getattr(engine, "tokenizer", None)

    def publish(self, weights, version: int) -> None:
        """Weights (a ``WeightVersion``; None: the engine already holds them) for the next generation."""
        self._next = (weights, version)

    def load_newest(self) -> None:
        """The last published version into the engine (under ``lock``)."""
        published, self._next = self._next, None
        if published is not None:
            weights, version = published
            if weights is not None:
                weights.load_into(self.engine)
            self.version = version

    def generate(self, prompt_ids: list[list[int]], **sampling) -> list[list[Any]]:
        with self.lock:
            self.load_newest()
            groups = self.engine.generate(prompt_ids, **sampling)
            version = self.version
        for group in groups:
            for gen in group:
                gen.version = version
        return groups

    def hold(self) -> None:
        """Pause generation (the trainer is about to change the weights the engine samples from)."""
        self.lock.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.lock.release()


class FinishedGroups:
    """Finished groups (``put(order, item)``), taken oldest first; a feed's failure is re-raised by ``take``."""

    def __init__(self):
        self._cond = threading.Condition()
        self._items: list[tuple[Any, Any]] = []
        self._error: BaseException | None = None

    def put(self, order, item) -> None:
        with self._cond:
            self._items.append((order, item))
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def take(self, count: int, timeout_s: float, hint: Callable[[int], str]) -> list:
        """The ``count`` oldest groups, waiting for them at most ``timeout_s`` (then a ``TimeoutError``
        whose message is ``hint(finished)``)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._items) < count:
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(hint(len(self._items)))
                self._cond.wait(timeout=min(left, 1.0))
            self._items.sort(key=lambda pair: pair[0])
            taken, self._items = self._items[:count], self._items[count:]
            return [item for _, item in taken]


class Feed(Protocol):
    """Where a stream's finished groups come from."""

    def start(self, groups: FinishedGroups, first_batch: int, may_start: Callable[[int], bool]) -> None:
        """Start putting finished groups into ``groups``; prompt batch b may start once ``may_start(b)``."""

    def to_rollout(self, items: list) -> Rollout:
        """Finished groups as one rollout (``group_ids`` keep them apart)."""

    def waiting(self, finished: int, needed: int, waited_s: float) -> str:
        """What a step that waited ``waited_s`` for ``needed`` groups, with ``finished`` there, says."""

    def metrics(self) -> dict[str, float]:
        """The feed's figures since the last call."""

    def stop(self) -> None:
        """Stop (the samples in flight are given up)."""


class StreamSource:
    """The batch source over a feed (module docstring). ``score(rollout)``: the run's rewards ``(rewards [N],
    figures)``; ``snapshot(optimizer_steps)``: the trainer's weights as a ``WeightVersion`` (k >= 1);
    ``sync()``: the trainer's weights into the engine now (k = 0)."""

    kind = "stream"

    def __init__(self, feed: Feed, engine: VersionedEngine, *, max_staleness: int, prompts_per_step: int,
                 score: Callable[[Rollout], tuple], snapshot: Callable[[int], Any] | None, sync: Callable[[], None],
                 wait_s: float = 1800.0):
        self.feed, self.engine, self.k, self.prompts_per_step = feed, engine, max_staleness, prompts_per_step
        self.score, self.snapshot, self.sync, self.wait_s = score, snapshot, sync, wait_s
        self.groups = FinishedGroups()
        self.step = 0  # the step the trainer is at (episodes of prompt batch b start once step >= b - k)
        self._opt_at: dict[int, int] = {}  # training step -> the optimizer steps it started from
        self._waits: list[float] = []

    @property
    def max_staleness(self) -> int:
        return self.k

    def start(self, step: int, optimizer_steps: int) -> None:
        self.step, self._opt_at[step] = step, optimizer_steps
        self.engine.version = optimizer_steps
        self.feed.start(self.groups, step, self.may_start)

    def may_start(self, batch: int) -> bool:
        return batch <= self.step + self.k

    def get(self, step: int, optimizer_steps: int) -> tuple[Batch, float]:
        """The oldest ``prompts_per_step`` finished groups as batch ``step``, and the seconds waited for them."""
        self.step, self._opt_at[step] = step, optimizer_steps
        begin = time.perf_counter()
        items = self.groups.take(self.prompts_per_step, self.wait_s,
                                 lambda finished: self.feed.waiting(finished, self.prompts_per_step, self.wait_s))
        waited = time.perf_counter() - begin
        rollout = self.feed.to_rollout(items)
        figures = self._stamp(rollout, step, optimizer_steps)
        begin = time.perf_counter()
        rewards, reward_metrics = self.score(rollout)
        scored = time.perf_counter() - begin
        if self.k == 0:  # the update changes the weights the engine samples from: generation pauses until then
            self.engine.hold()
        self._figures = figures
        return Batch(rollout, rewards, reward_metrics, None, step, optimizer_steps,
                     {"rollout": waited, "score": scored}), waited

    def _stamp(self, rollout: Rollout, step: int, optimizer_steps: int) -> dict[str, float]:
        """Each sample's version (its oldest trained token's) and the staleness bound applied per token."""
        mask = rollout.tensors["response_mask"]  # [N, R]
        versions = rollout.token_version  # [N, R]
        if versions is None:  # a feed whose engine stamps no versions: the weights it started with
            versions = rollout.token_version = torch.where(mask.bool(), optimizer_steps, -1)
        oldest = self._opt_at.get(max(step - self.k, min(self._opt_at)), optimizer_steps)
        kept = within_staleness(versions, mask, oldest)  # [N, R]
        trained = torch.where(mask.bool(), versions, optimizer_steps)
        rollout.policy_version = trained.min(dim=-1).values  # [N]
        figures = token_staleness_metrics(versions, mask, optimizer_steps, kept)
        rollout.tensors["response_mask"] = mask * kept
        return {f"rollout/{k}": v for k, v in zip(figures, torch.stack(list(figures.values())).tolist())}

    def after_update(self, optimizer_steps: int | None = None) -> None:
        """The updated weights to the engine: k = 0 now (and generation resumes), k >= 1 as a published
        version the engine loads before its next generation."""
        if optimizer_steps is None:
            raise ValueError("a streamed source needs the optimizer steps after the update (the publish stage gives them)")
        if self.k == 0:
            try:
                self.sync()
                self.engine.version = optimizer_steps
            finally:
                self.engine.release()
        else:
            self.engine.publish(self.snapshot(optimizer_steps), optimizer_steps)

    def step_metrics(self, batch: Batch, optimizer_steps: int, waited: float) -> dict[str, float]:
        staleness = (optimizer_steps - batch.rollout.policy_version).float()  # [N]
        return {"rollout/staleness_mean": staleness.mean().item(), "rollout/staleness_max": staleness.max().item(),
                **getattr(self, "_figures", {}), "perf/wait_for_data_s": waited, **self.feed.metrics()}

    @contextlib.contextmanager
    def for_evaluation(self):
        """The engine for the trainer's evaluation, with the newest weights and no generation of the stream's."""
        with self.engine.lock:
            self.engine.load_newest()
            yield

    def drain(self) -> None:
        """Nothing to finish: a checkpoint holds no sample in flight (module docstring)."""

    def close(self, wait: bool = True) -> None:
        self.feed.stop()
        self.engine.release()


def build_stream_source(source_cfg, env, *, policy: Callable[[], Any], prompts_per_step: int, group_size: int,
                        num_processes: int, dynamic_sampling: bool) -> StreamSource:
    """The ``StreamSource`` of ``source.stream`` (the environment's episodes, ``env.sampler.episode_feed``) or
    ``source.agent`` (your agent's sessions, ``unirl.rollout.sessions.SessionFeed``) over ``env``'s engine."""
    from unirl.rollout.batch import own_engine
    from unirl.rollout.weights import WeightVersion

    what, k = ("source.stream" if source_cfg.stream else "source.agent"), source_cfg.max_staleness
    if num_processes > 1:
        raise ValueError(f"{what} runs on one process (its samples arrive at one engine); use one process")
    if dynamic_sampling:
        raise ValueError(f"{what} with algo.filter_groups: dynamic sampling draws prompt batches itself; switch one off")
    sampler = env.sampler
    if getattr(sampler, "engine", None) is None:
        raise ValueError(f"{what}: {type(env).__name__} samples with the policy itself (no rollout engine)")
    if k >= 1:  # generation goes on while the trainer updates: the engine needs weights of its own
        own_engine(sampler, env)
    engine = VersionedEngine(sampler.engine, 0)
    if source_cfg.stream:
        if not callable(getattr(sampler, "episode_feed", None)):
            raise ValueError(f"source.stream plays an environment's episodes; {type(env).__name__} has none")
        feed = sampler.episode_feed(engine, group_size)
    else:
        from unirl.rollout.sessions import SessionFeed

        cfg = env.cfg
        feed = SessionFeed(source_cfg.agent, engine, model_name=cfg.model.name_or_path, group_size=group_size,
                           max_tokens=source_cfg.agent.max_tokens or cfg.rollout.max_new_tokens,
                           reads_reward=any(r.name == "session_reward" for r in cfg.rewards), output_dir=cfg.output_dir)
    bucket_mb = env.cfg.rollout.sync_bucket_mb
    snapshot = None if k == 0 else (
        lambda steps: WeightVersion(policy(), sampler.engine.weights_format, bucket_mb, steps))
    return StreamSource(feed, engine, max_staleness=k, prompts_per_step=prompts_per_step, score=env.scorer.score,
                        snapshot=snapshot, sync=sampler.sync_weights,
                        wait_s=source_cfg.agent.wait_s if source_cfg.agent.port is not None else 1800.0)
