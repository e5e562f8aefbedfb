"""Calling a reward over a batch: ``score_batch`` checks that it gave one finite float (or None) per
sample, and when the reward raises, names the first sample that fails on its own. ``score_requests``
scores several requests in one call where it can (what ``serve-reward`` does with concurrent ones).

Every failure is a ``RewardError`` naming the reward, and the sample with its prompt when known.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from unirl.rewards.registry import RewardError, RewardFn, ScoresWithText

#: When a batch call raised, at most this many samples are re-scored one at a time to find the
#: first one that fails on its own (a bounded extra cost, paid only when the run is failing anyway).
LOCATE_LIMIT = 32


def score_batch(reward_fn: RewardFn, samples: Sequence[Any], *, name: str, **columns: Any) -> list[float | None]:
    """Call ``reward_fn(samples, **columns)`` and check it gave ``len(samples)`` finite floats or Nones
    (a ``ScoresWithText`` keeps its texts).

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
    except SystemExit as err:  # would end the run (with status 0 for sys.exit(0)) without a word
        raise RewardError(f"reward {name!r} called sys.exit({err.code!r}); a reward returns scores or raises") from err
    except Exception as err:
        raise _locate_failure(reward_fn, samples, columns, name, err) from err
    checked = _checked(scores, n, name, prompts)
    return ScoresWithText(checked, scores.texts, scores.failed) if isinstance(scores, ScoresWithText) else checked


def score_requests(reward_fn: RewardFn, requests: Sequence[tuple[Sequence[Any], dict[str, Any]]], *,
                   name: str) -> list[list[float | None] | RewardError]:
    """Score several requests ``(samples, columns)`` with as few calls as possible: for each, what
    ``score_batch(reward_fn, samples, name=name, **columns)`` gives, or the ``RewardError`` it raises.

    Requests with the same column names, each column a list of one value per sample, are joined
    into one call. When that call raises or returns anything but one valid score per sample, each
    of its requests is scored alone, so an error names the sample and prompt within its own request
    and the other requests still get their scores. Joining gives every request the scores it gets
    alone when a sample's score does not depend on the other samples of the call (``serve-reward
    --max-batch 1`` never joins, for a reward where it does).
    """
    groups: dict[Any, list[int]] = {}
    for i, (samples, columns) in enumerate(requests):
        joinable = all(isinstance(v, list) and len(v) == len(samples) for v in columns.values())
        groups.setdefault(tuple(sorted(columns)) if joinable else ("alone", i), []).append(i)
    outcomes: list[Any] = [None] * len(requests)
    for members in groups.values():
        joined = _score_joined(reward_fn, [requests[i] for i in members], name) if len(members) > 1 else None
        if joined is not None:
            for i, scores in zip(members, joined):
                outcomes[i] = scores
            continue
        for i in members:
            samples, columns = requests[i]
            try:
                outcomes[i] = score_batch(reward_fn, samples, name=name, **columns)
            except RewardError as err:
                outcomes[i] = err
    return outcomes


def _score_joined(reward_fn: RewardFn, requests: list[tuple[Sequence[Any], dict[str, Any]]],
                  name: str) -> list[list[float | None]] | None:
    """Each request's scores from one call over all their samples; None if that call failed."""
    samples = [s for request_samples, _ in requests for s in request_samples]
    columns = {key: [v for _, request_columns in requests for v in request_columns[key]] for key in requests[0][1]}
    try:
        scores = _checked(call_reward(reward_fn, samples, columns), len(samples), name, columns.get("prompts"))
    except Exception:  # scored again one request at a time, which names the sample
        return None
    out, start = [], 0
    for request_samples, _ in requests:
        out.append(scores[start:start + len(request_samples)])
        start += len(request_samples)
    return out


def _checked(scores: Any, n: int, name: str, prompts: Any) -> list[float | None]:
    """``scores`` as a list of ``n`` finite floats or Nones; a ``RewardError`` says what is wrong otherwise."""
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
