"""Calling a reward over a batch: ``score_batch`` checks that it gave one finite float (or None) per
sample, and when the reward raises, names the first sample that fails on its own.

Every failure is a ``RewardError`` naming the reward, and the sample with its prompt when known.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from rewards.registry import RewardError, RewardFn

#: When a batch call raised, at most this many samples are re-scored one at a time to find the
#: first one that fails on its own (a bounded extra cost, paid only when the run is failing anyway).
LOCATE_LIMIT = 32


def score_batch(reward_fn: RewardFn, samples: Sequence[Any], *, name: str, **columns: Any) -> list[float | None]:
    """Call ``reward_fn(samples, **columns)`` and check it gave ``len(samples)`` finite floats or Nones.

    Every failure is a ``RewardError`` naming the reward. When the reward raises, the batch is
    re-scored one sample at a time (the first ``LOCATE_LIMIT`` samples at most) to name the first
    sample that fails on its own, with its prompt; when none does (the failure depends on the
    batch, or lies further on), the message says so and shows the batch's first prompt. A
    ``RewardError`` raised by the reward itself (a remote server that cannot be reached, a model
    that cannot be loaded) passes through unchanged, without re-scoring.
    """
    n = len(samples)
    for key, column in columns.items():
        if isinstance(column, (list, tuple)) and len(column) != n:
            raise RewardError(f"reward {name!r}: column {key!r} has {len(column)} values for {n} samples")
    prompts = columns.get("prompts")
    try:
        scores = call_reward(reward_fn, samples, columns)
    except RewardError:
        raise
    except Exception as err:
        raise _locate_failure(reward_fn, samples, columns, name, err) from err

    if hasattr(scores, "tolist") and not isinstance(scores, (list, tuple)):  # numpy array, torch tensor
        if getattr(scores, "ndim", 1) != 1:
            raise RewardError(f"reward {name!r} returned an array of shape {tuple(scores.shape)}, expected ({n},)")
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        raise RewardError(f"reward {name!r} returned {type(scores).__name__}, expected a list of {n} floats")
    if len(scores) != n:
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {n} samples")
    out: list[float | None] = []
    for i, score in enumerate(scores):
        if score is None:
            out.append(None)
            continue
        if isinstance(score, (str, bytes)) or not _is_number(score):
            raise RewardError(
                f"reward {name!r} returned {score!r} for sample {i}{_prompt_of(prompts, i)}; "
                "scores must be floats (or None: does not apply)"
            )
        value = float(score)
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value} for sample {i}{_prompt_of(prompts, i)}; scores must be finite")
        out.append(value)
    return out


def call_reward(reward_fn: RewardFn, samples: Sequence[Any], columns: dict[str, Any]) -> Any:
    """``reward_fn(samples, **columns)``, running it to completion when it is ``async``.

    A coroutine runs in its own event loop (``asyncio.run``); when the calling thread already runs
    a loop (a notebook), it runs in a helper thread instead, since a loop cannot be nested.
    """
    result = reward_fn(samples, **columns)
    if not inspect.isawaitable(result):
        return result
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await(result))
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _await(result)).result()


def _locate_failure(reward_fn: RewardFn, samples: Sequence[Any], columns: dict[str, Any], name: str,
                    err: Exception) -> RewardError:
    """The ``RewardError`` for a batch call that raised ``err``: the first of the first
    ``LOCATE_LIMIT`` samples that raises on its own, or a message saying none did."""
    n = len(samples)
    prompts = columns.get("prompts")
    what = f"{type(err).__name__}: {err}"
    if n == 1:
        return RewardError(f"reward {name!r} raised {what} on sample 0{_prompt_of(prompts, 0)}")
    tried = min(n, LOCATE_LIMIT)
    for i in range(tried):
        one = {k: (v[i:i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in columns.items()}
        try:
            call_reward(reward_fn, samples[i:i + 1], one)
        except Exception as single:
            return RewardError(
                f"reward {name!r} raised {type(single).__name__}: {single} on sample {i}{_prompt_of(prompts, i)} "
                f"(found by re-scoring the batch of {n} one sample at a time)"
            )
    return RewardError(
        f"reward {name!r} raised {what} on a batch of {n} samples; re-scored one at a time, none of the "
        f"first {tried} raised, so the failure depends on the batch or lies further on "
        f"(first sample{_prompt_of(prompts, 0)})"
    )


def _prompt_of(prompts: Any, i: int) -> str:
    if isinstance(prompts, (list, tuple)) and i < len(prompts):
        text = str(prompts[i])
        return f" (prompt {text[:200] + '...' if len(text) > 200 else text!r})"
    return ""


async def _await(awaitable):
    return await awaitable


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
