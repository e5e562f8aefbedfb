"""DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476, section 3.2; verl's
``algorithm.filter_groups``): generate and score a batch of prompts, keep the groups whose chosen raw
reward component varies (``unirl.core.nonconstant_groups``), and generate more batches until
``prompts_per_step`` groups are kept, so every step trains on a full batch of groups with a signal.

As in verl, the kept batch is cut to exactly ``prompts_per_step`` groups (the surplus of the last
generation batch is dropped), and at ``max_num_gen_batches`` the run stops with an error, or (``on_exhausted:
train``) trains on the groups kept. With several processes every one generates as many batches
(the decision to go on is taken on the smallest kept count of them all) and keeps the same number
of groups, so the global batch stays even across processes.

Differences from verl's recipe: a generation batch is ``prompts_per_step`` prompts (the recipe samples
3x the training batch at a time, ``gen_batch_size``); more batches are drawn instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from unirl.core import nonconstant_groups
from unirl.trainer.distributed import gather_rows, sum_over_processes
from unirl.env import Environment, Rollout, concat_rollouts
from unirl.config.schema import FilterGroupsConfig


class SamplingExhausted(ValueError):
    """``max_num_gen_batches`` generation batches kept too few varied groups. A ``ValueError``: the
    data or the settings are the cause (the prompts are too easy or too hard, the limit too low), so
    the CLI ends the run with its one line."""


class SamplingStopped(Exception):
    """A stop signal (SIGTERM / SIGINT) arrived while batches were drawn: the step is given up, so a run
    whose groups never vary (``max_num_gen_batches: 0``, no limit) still stops on the first signal."""


#: Without a limit, how many generation batches pass before each line saying the step is still drawing.
_STILL_DRAWING = (10, 100, 1_000, 10_000, 100_000)


@dataclass
class FilteredBatch:
    rollout: Rollout  # the kept groups, at most prompts_per_step of them
    rewards: torch.Tensor  # [N_kept]
    reward_metrics: dict[str, float]  # reward/<name> over the kept samples
    metrics: dict[str, float]  # filter/*


def sample_filtered(env: Environment, accelerator, cfg: FilterGroupsConfig, *, prompts_per_step: int,
                    group_size: int, next_rows: Callable[[], list[dict]],
                    stop: Callable[[], bool] | None = None) -> FilteredBatch:
    """Generate, score and filter batches of ``next_rows()`` prompts until ``prompts_per_step`` groups
    vary on ``cfg.metric`` on every process (see the module docstring).

    ``stop`` is asked after every batch that leaves the step short (on every process alike: it may be a
    collective); when it says so, ``SamplingStopped`` gives the step up."""
    kept: list[tuple[Rollout, torch.Tensor]] = []  # the kept groups of each generation batch, with their rewards
    count = batches = prompts = varied = 0
    while True:
        rows = next_rows()
        batches, prompts = batches + 1, prompts + len(rows)
        rollout = env.sampler.rollout(rows, group_size)
        rewards, _ = env.scorer.score(rollout)
        keep = nonconstant_groups(_metric_values(rollout, cfg.metric), rollout.group_ids)  # [N]
        groups = torch.unique(rollout.group_ids[keep]).tolist()  # in order
        varied += len(groups)
        take = groups[: prompts_per_step - count]
        if take:
            index = torch.isin(rollout.group_ids, torch.tensor(take)).nonzero().squeeze(-1)
            kept.append((rollout.select(index), rewards[index]))
            count += len(take)
        smallest = _min_over_processes(accelerator, count)
        if smallest >= prompts_per_step:
            break
        if cfg.max_num_gen_batches and batches >= cfg.max_num_gen_batches:
            if cfg.on_exhausted == "error":
                raise SamplingExhausted(
                    f"dynamic sampling: {batches} generation batches (algo.filter_groups.max_num_gen_batches) kept "
                    f"{smallest} of trainer.prompts_per_step={prompts_per_step} groups whose {cfg.metric!r} varies; the "
                    f"prompts are too easy or too hard for the policy. Raise max_num_gen_batches, or set "
                    f"algo.filter_groups.on_exhausted=train to train on the groups kept")
            if smallest == 0:
                raise SamplingExhausted(f"dynamic sampling: no group with a varying {cfg.metric!r} on some process after "
                                   f"{batches} generation batches; nothing to train on")
            break
        if stop is not None and stop():
            raise SamplingStopped(f"dynamic sampling stopped by a signal after {batches} generation batches")
        if not cfg.max_num_gen_batches and batches in _STILL_DRAWING:
            accelerator.print(f"dynamic sampling: {batches} generation batches kept {smallest} of "
                              f"trainer.prompts_per_step={prompts_per_step} groups whose {cfg.metric!r} varies; still "
                              f"drawing (algo.filter_groups.max_num_gen_batches=0: no limit)")
    rollout, rewards = _first_groups(kept, smallest, env)
    metrics = {
        "filter/kept_groups": sum_over_processes(accelerator, smallest),
        "filter/varied_groups": sum_over_processes(accelerator, varied),
        "filter/prompts_seen": sum_over_processes(accelerator, prompts),
        "filter/gen_batches": float(batches),
    }
    reward_metrics = {f"reward/{k[len('score/'):]}": torch.nanmean(v.float()).item()
                      for k, v in rollout.tensors.items() if k.startswith("score/")}
    return FilteredBatch(rollout, rewards, reward_metrics, metrics)


def _metric_values(rollout: Rollout, metric: str) -> torch.Tensor:
    """[N] the raw reward component ``metric`` (``score/<metric>`` of the rollout)."""
    values = rollout.tensors.get(f"score/{metric}")
    if values is None:
        names = sorted(k[len("score/"):] for k in rollout.tensors if k.startswith("score/"))
        raise ValueError(f"algo.filter_groups.metric={metric!r} is not a reward component of this run; "
                         f"choose from {names}")
    return values


def _first_groups(kept: list[tuple[Rollout, torch.Tensor]], groups: int, env: Environment
                  ) -> tuple[Rollout, torch.Tensor]:
    """The first ``groups`` kept groups, joined into one rollout without the padding none of them needs
    (a dropped group may have held a batch's longest response), and their rewards."""
    whole = concat_rollouts([r for r, _ in kept], left_padded=env.actions.left_padded)
    rewards = torch.cat([w for _, w in kept])
    first = (whole.group_ids < groups).nonzero().squeeze(-1)  # concat_rollouts numbers groups 0.. in order
    return env.actions.trim_padding(whole.select(first)), rewards[first]


def _min_over_processes(accelerator, value: int) -> int:
    if accelerator.num_processes == 1:
        return value
    return int(gather_rows(accelerator, torch.tensor([value])).min())
