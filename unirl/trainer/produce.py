"""The rollout and score stages as one callable that a batch source asks for each step's batch
(``unirl.rollout.sources``): ``produce(batch, times, stop)`` samples the batch's prompts ``G`` times and scores
the samples, or, with DAPO's dynamic sampling (``algo.filter_groups``), draws and scores prompt batches until
enough groups vary (``unirl.trainer.dynamic_sampling``). It holds what those stages need (the environment's
prompts, sampler and scorer, the filter's settings and the count of prompt batches drawn, which checkpoints
save), never the trainer.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from unirl.env import Environment, Rollout
from unirl.trainer.dynamic_sampling import FilteredBatch, sample_filtered


class Producer:
    """``produce(batch, times, stop)``: ``(rollout, rewards [N], reward figures, filter figures or None)`` of
    training step ``batch``, its stages' seconds in ``times`` (``rollout``, ``score``). ``stop`` (inline
    only: the producer thread calls no collective) lets a signal give up a step that is still drawing."""

    def __init__(self, env: Environment, accelerator, filter_groups, *, prompts_per_step: int, group_size: int):
        self.env, self.accelerator, self.filter = env, accelerator, filter_groups
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        #: Prompt batches drawn by dynamic sampling (without it, batch k is step k's); checkpointed.
        self.prompt_batches = 0

    def __call__(self, batch: int, times: dict[str, float], stop: Callable[[], bool] | None = None
                 ) -> tuple[Rollout, torch.Tensor, dict[str, float], dict[str, float] | None]:
        env = self.env
        if self.filter.enabled:  # DAPO: generate and score until enough groups vary
            begin = time.perf_counter()
            filtered = self.draw_filtered(stop)
            times["rollout"] = time.perf_counter() - begin
            times["score"] = 0.0  # scored while drawing
            return filtered.rollout, filtered.rewards, filtered.reward_metrics, filtered.metrics
        begin = time.perf_counter()
        rollout = env.sampler.rollout(env.prompts.next(batch), self.group_size)
        times["rollout"] = time.perf_counter() - begin
        begin = time.perf_counter()
        rewards, reward_metrics = env.scorer.score(rollout)
        times["score"] = time.perf_counter() - begin
        return rollout, rewards, reward_metrics, None

    def draw_filtered(self, stop: Callable[[], bool] | None = None) -> FilteredBatch:
        """DAPO's dynamic sampling: prompt batches drawn in order (``prompt_batches`` counts them) until the
        step's groups are kept (``unirl.trainer.dynamic_sampling.sample_filtered``)."""
        return sample_filtered(self.env, self.accelerator, self.filter, prompts_per_step=self.prompts_per_step,
                               group_size=self.group_size, next_rows=self._next_rows, stop=stop)

    def _next_rows(self) -> list[dict]:
        self.prompt_batches += 1
        return self.env.prompts.next(self.prompt_batches - 1)
