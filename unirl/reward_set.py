"""Turn a run's ``rewards:`` list into one reward per sample, with each component logged.

Shared by every environment. The environment hands over its samples (strings or images), the
prompts and the dataset columns; ``RewardSet`` returns each reward's scores, and ``combine`` turns
them into the reward [N] that feeds the advantages plus ``reward/<name>`` means.

Scoring can run off the critical path: ``submit`` hands a chunk of samples to a thread pool
(``trainer.reward_workers``) and returns a future, so an environment scores chunk k while it
samples chunk k+1 (FlowGRPO does the same with its reward executor). Each chunk is scored by the
same deterministic calls as inline scoring, so the scores are identical; only the wall time
changes. Threads, not processes: model rewards keep one copy of their weights, and most of the
work (a forward pass, an HTTP request) releases the GIL.
"""

from __future__ import annotations

import math
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from unirl.core import group_advantages
from unirl.config.schema import RewardConfig

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class RewardSet:
    """The rewards of a run, loaded once, called once per batch (or chunk) each.

    Args:
        configs: the ``rewards:`` list of the run config.
        aggregation: ``sum_then_normalize`` (weighted sum of raw rewards) or ``normalize_then_sum``
            (each reward normalised within its group, then the weighted sum).
        eps: added to each group's std by ``normalize_then_sum`` (TRL adds 1e-4).
        workers: threads for ``submit``; 0 scores inline.
    """

    def __init__(self, configs: Sequence[RewardConfig], *, aggregation: str = "sum_then_normalize", workers: int = 0,
                 eps: float = 1e-6):
        from unirl.rewards.loading import load_reward

        if not configs:
            raise ValueError("rewards: the list is empty; name at least one reward")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"reward aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if workers < 0:
            raise ValueError(f"reward workers must be >= 0, got {workers}")
        for c in configs:
            if isinstance(c.weight, bool) or not isinstance(c.weight, (int, float)) or not math.isfinite(c.weight):
                raise ValueError(f"reward {c.name!r}: weight must be a finite number, got {c.weight!r}")
        self.configs = list(configs)
        self.aggregation = aggregation
        self.eps = eps
        self.names = [_metric_name(c.name) for c in self.configs]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"rewards: the same reward is listed twice ({self.names}); merge them or rename one")
        self.fns = [load_reward(c.name, **c.kwargs) for c in self.configs]
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="unirl-reward", initializer=one_openmp_thread)
                      if workers > 0 else None)

    def components(self, samples: list[Any], *, prompts: list[str], columns: dict[str, list],
                   texts: dict[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
        """Each reward's scores [n] (float64) by metric name; NaN where a reward returned None (does not apply).
        ``texts``, when given, receives the per-sample texts of the rewards that return some (a
        judge's answers, ``ScoresWithText``) by metric name, for an evaluation to keep.

        Raises ``RewardError`` (naming the reward, and the sample and its prompt when known) when a
        reward raises or returns a wrong number of scores, NaN or infinity.
        """
        from unirl.rewards.scoring import score_batch

        if len(prompts) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(prompts)} prompts")
        out = {}
        for cfg, fn, name in zip(self.configs, self.fns, self.names):
            scores = _within(cfg, lambda: score_batch(fn, samples, name=cfg.name, prompts=prompts, **columns))
            if texts is not None and hasattr(scores, "texts"):
                texts[name] = scores.texts
            # float64, as the rewards came (Python floats): DAPO's filter compares them in their own precision,
            # so 1 and 1 + 1e-9 differ as in verl (float32 made them one); the combined reward is float32.
            out[name] = torch.tensor([math.nan if s is None else s for s in scores], dtype=torch.float64)  # [n]
            if getattr(scores, "failed", None) is not None:  # a judge's unparsable answers, counted (unirl/rewards/judge.py)
                out[f"{name}/parse_failed"] = torch.tensor(scores.failed, dtype=torch.float32)  # [n]
        return out

    def submit(self, samples: list[Any], *, prompts: list[str], columns: dict[str, list]) -> Future:
        """``components`` in the worker pool (a finished future when ``workers=0``)."""
        if self._pool is not None:
            return self._pool.submit(self.components, samples, prompts=prompts, columns=columns)
        future: Future = Future()
        try:
            future.set_result(self.components(samples, prompts=prompts, columns=columns))
        except BaseException as e:  # re-raised by .result(), like a pool future
            future.set_exception(e)
        return future

    def combine(self, components: dict[str, torch.Tensor], group_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The combined reward [N] and ``reward/<name>`` means (over the samples each applies to).

        A reward that returned None for a sample adds nothing to that sample's total. With
        ``normalize_then_sum`` each reward is first replaced by ``(r - group mean) / (group std + eps)``
        over the samples of the group it applies to (``group_advantages`` with ``scale="group"``), TRL's
        per-reward step; TRL then normalises the sum over the batch, which is the advantage estimator's
        job here (``adv_scale: batch``).
        """
        n = len(group_ids)
        total = torch.zeros(n, dtype=torch.float32)  # [N]
        metrics = {}
        for cfg, name in zip(self.configs, self.names):
            if name not in components:
                raise ValueError(f"reward {cfg.name!r}: no scores under {name!r} (got {sorted(components)})")
            scores = components[name].float().cpu()  # [N]
            if scores.shape != (n,):
                raise ValueError(f"reward {cfg.name!r}: expected {n} scores, got shape {tuple(scores.shape)}")
            applies = ~torch.isnan(scores)
            metrics[f"reward/{name}"] = torch.nanmean(scores).item()  # NaN when it applies to no sample
            value = torch.where(applies, scores, 0.0)
            if self.aggregation == "normalize_then_sum":
                value = _group_normalise(value, applies, group_ids.cpu(), self.eps)
            total.add_(value, alpha=cfg.weight)
            if f"{name}/parse_failed" in components:
                metrics[f"reward/{name}/parse_failed"] = components[f"{name}/parse_failed"].float().mean().item()
        return total, metrics

    def __call__(self, samples: list[Any], *, prompts: list[str], columns: dict[str, list],
                 group_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Score inline and combine: the reward [N] and ``reward/<name>`` means."""
        return self.combine(self.components(samples, prompts=prompts, columns=columns), group_ids)

    def close(self) -> None:
        """Stop the worker threads without waiting: a finished run has taken every result, and a failed
        or interrupted one must not wait on a reward that hangs (chunks not started are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "RewardSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _within(cfg: RewardConfig, call):
    """``call()`` (one reward over a batch), or a ``RewardError`` naming the reward when it takes more
    than ``cfg.timeout_s`` seconds. The call then goes on in its (daemon) thread, which cannot be
    stopped from outside, but no longer holds the run or its exit."""
    if cfg.timeout_s is None:
        return call()
    from unirl.rewards.registry import RewardError

    outcome: dict[str, Any] = {}

    def run():
        try:
            outcome["scores"] = call()
        except BaseException as e:  # handed to the caller below
            outcome["error"] = e

    thread = threading.Thread(target=run, name=f"unirl-reward-{cfg.name}", daemon=True)
    thread.start()
    thread.join(cfg.timeout_s)
    if thread.is_alive():
        raise RewardError(f"reward {cfg.name!r}: no answer after {cfg.timeout_s:g} s (its timeout_s); a hung reward "
                          f"stops the run rather than hanging it")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["scores"]


#: A loaded OpenMP runtime in /proc/self/maps: GNU libgomp, Intel libiomp5, LLVM libomp.
_OPENMP_LIBRARY = re.compile(r"/\S*/lib(?:g|i)?omp\d*\.so[.\d]*$")


def one_openmp_thread() -> None:
    """Let torch work in the calling thread run on one OpenMP thread, leaving the process's others alone.

    A torch operation in a new thread makes that thread the master of a second OpenMP team (GNU
    libgomp). With more OpenMP threads than cores, libgomp's idle threads stop spinning and sleep
    after each parallel region, so every later operation of the trainer's own team waits to wake
    them: on 2 cores a forward went from 14 ms to 47 ms after one torch reward call in a worker.
    ``torch.set_num_threads(1)`` here would be global (the trainer's threads too, and vLLM's CPU
    worker replaces it by a no-op); ``omp_set_num_threads`` sets this thread's own count (the
    OpenMP spec's per-thread ``nthreads-var``), so no team is started here. Called as the reward
    pool's thread initializer. A no-op where no OpenMP library is loaded or /proc is absent."""
    import ctypes

    torch.get_num_threads()  # torch's lazy per-thread init would set the global count later
    try:
        with open("/proc/self/maps") as maps:
            paths = {m.group(0) for line in maps if (m := _OPENMP_LIBRARY.search(line))}
    except OSError:
        return
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).omp_set_num_threads(1)
        except (OSError, AttributeError):  # not a loadable library, or no OpenMP entry point
            continue


def concat_components(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Join per-chunk ``components`` results in chunk order."""
    if not parts:
        raise ValueError("concat_components: no chunks to join")
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def _group_normalise(values: torch.Tensor, applies: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - group mean) / (group std + eps) over the samples a reward applies to (0 for the others)."""
    out = torch.zeros_like(values)
    idx = applies.nonzero().squeeze(-1)
    if len(idx):
        out[idx] = group_advantages(values[idx], group_ids[idx], scale="group", eps=eps)
    return out


def _metric_name(spec: str) -> str:
    """``gsm8k`` -> gsm8k; ``path/to/file.py:fn`` and ``pkg.mod:fn`` -> fn; a URL -> its host:port."""
    if "://" in spec:
        return spec.split("://", 1)[1].rstrip("/").replace("/", "_")
    return spec.rsplit(":", 1)[-1] if ":" in spec else spec
