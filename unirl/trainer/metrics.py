"""How the update's figures are reduced: over micro-batches and pieces (``MetricLog``) and over
processes (``reduce_over_processes``), with one rule for both.

* Shares of a loss-like total (``loss/*``, ``actor/entropy``): micro-batches, column pieces and
  processes each hold a share of the global mini-batch's value, so they add up.
* ``*_max`` / ``*_min``: the extremes.
* Everything else: the mean.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def is_share(name: str) -> bool:
    """Metrics that are a share of a loss-like total (micro-batches, pieces and processes add up)."""
    return name.startswith("loss/") or name in ("actor/entropy", "critic/vf_loss")


class MetricLog:
    """Collects metric values; ``result`` reduces them: shares summed (``sum_shares``) or averaged,
    ``*_max`` / ``*_min`` the extremes, the rest averaged."""

    def __init__(self):
        self.values: dict[str, list[float]] = defaultdict(list)

    def add(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.values[name].append(float(value))

    def result(self, *, sum_shares: bool) -> dict[str, float]:
        out = {}
        for name, vs in self.values.items():
            if name.endswith("_max"):
                out[name] = max(vs)
            elif name.endswith("_min"):
                out[name] = min(vs)
            elif sum_shares and is_share(name):
                out[name] = sum(vs)
            else:
                out[name] = sum(vs) / len(vs)
        return out


def reduce_over_processes(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Global update figures: shares summed over processes, ``*_max`` / ``*_min`` the extremes, the
    rest averaged (grad norm and lr are the same on every process). Every process must pass the same
    keys. One process: ``metrics`` itself."""
    if accelerator.num_processes == 1 or not metrics:
        return metrics
    import torch.distributed as dist

    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=accelerator.device)
    summed, high, low = values.clone(), values.clone(), values.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    out = {}
    for i, k in enumerate(keys):
        if is_share(k):
            out[k] = float(summed[i])
        elif k.endswith("_max"):
            out[k] = float(high[i])
        elif k.endswith("_min"):
            out[k] = float(low[i])
        else:
            out[k] = float(summed[i]) / accelerator.num_processes
    return out


def global_reward_metrics(accelerator, rewards: torch.Tensor, env_metrics: dict[str, float], rollout) -> dict:
    """``reward/mean``, ``reward/std`` and the per-reward ``reward/<name>`` over the global batch.

    One process: the environment's figures. Several: the rewards are gathered, and each reward's
    per-sample scores when the environment left them in ``rollout.tensors["score/<name>"]`` (NaN
    where it does not apply); a figure it did not leave is averaged over processes."""
    from unirl.trainer.distributed import gather_rows, sum_over_processes

    everyone = gather_rows(accelerator, rewards.float())
    out = {"reward/mean": everyone.mean().item(), "reward/std": everyone.std().item()}
    if accelerator.num_processes == 1:
        return {**out, **env_metrics}
    for key, value in env_metrics.items():
        scores = rollout.tensors.get("score/" + key.removeprefix("reward/"))  # the environment's extras
        if scores is not None:
            out[key] = gather_rows(accelerator, scores.float()).nanmean().item()
        else:
            out[key] = sum_over_processes(accelerator, value) / accelerator.num_processes
    return out
