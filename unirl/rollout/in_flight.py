"""The batches a threaded source sampled ahead, as a checkpoint holds them (``trainer_state/source.{json,
safetensors}``, each process's own on several: ``unirl.trainer.source_state``): written (``batch_state``), then read back and checked whole before a resumed run trains on any
of them (``batches_from_state``, ``check_schedule``; docs/async.md, "Damaged in-flight batches").

A checkpoint is data that may have been damaged or edited. Trained on as they are, a batch with a missing key, a
tensor of another shape or dtype, an id outside the vocabulary or NaN log-probs was a traceback or a NaN loss
some steps later, and a missing batch was sampled again without a word (with newer weights than the
uninterrupted run's). Each check raises ``StateError`` naming the batch, the field and what it should hold; the
checkpoint module puts the file in front, and resume skips the checkpoint for the one before (issue 51).

Shapes: N samples of a batch, P prompt tokens (left-padded), R response tokens (right-padded).
"""

from __future__ import annotations

from typing import Any

import torch

from unirl.env import LOOP_FIELDS, Rollout, StateError
from unirl.rollout.batch import Batch

#: The text rollout's token tensors (the only environment sampled ahead): name -> (dtype, the width's letter),
#: as ``unirl.text.sampler`` and the multi-turn rollouts write them.
TOKENS = {"prompt_ids": (torch.long, "P"), "prompt_mask": (torch.long, "P"),
          "response_ids": (torch.long, "R"), "response_mask": (torch.float32, "R")}
#: The loop's fields a batch may carry from its sampling: name -> (dtype, shape letters).
LOOP = {"engine_logp": (torch.float32, "NR"), "policy_version": (torch.long, "N"), "token_version": (torch.long, "NR")}
ITEM_KEYS = ("batch", "version", "optimizer_steps", "rewards", "reward_metrics", "filter_metrics", "rollout")
ROLLOUT_KEYS = ("tensors", "group_ids", "prompts", "samples", "columns", "loop")


def batch_state(batch: int, p: Batch) -> dict[str, Any]:
    """Batch ``batch`` as tensors and plain data (``unirl.trainer.state_files``)."""
    r = p.rollout
    loop = {name: getattr(r, name) for name in LOOP_FIELDS if getattr(r, name) is not None}
    return {"batch": batch, "version": p.version, "optimizer_steps": p.optimizer_steps, "rewards": p.rewards,
            "reward_metrics": p.reward_metrics, "filter_metrics": p.filter_metrics,
            "rollout": {"tensors": r.tensors, "group_ids": r.group_ids, "prompts": r.prompts, "samples": r.samples,
                        "columns": r.columns, "loop": loop}}


def batches_from_state(batches: Any, vocab_size: int | None) -> dict[int, Batch]:
    """``source.json``'s ``batches`` as ``{batch index: Batch}``, each checked whole: the keys, the counters, the
    samples' count, each tensor's dtype and shape, token ids in ``0..vocab_size - 1`` (None: not checked),
    finite log-probs at the sampled tokens, and ``policy_version`` equal to the batch's ``optimizer_steps``.
    ``StateError`` names the first thing wrong."""
    if not isinstance(batches, list):
        raise StateError(f"'batches' must be a list of the batches sampled ahead, got {_kind(batches)}")
    out: dict[int, Batch] = {}
    for i, item in enumerate(batches):
        named = isinstance(item, dict) and type(item.get("batch")) is int
        where = f"batch {item['batch']}" if named else f"batches[{i}]"
        _keys(item, ITEM_KEYS, where)
        for name in ("batch", "version", "optimizer_steps"):
            if isinstance(item[name], bool) or not isinstance(item[name], int) or item[name] < 0:
                raise StateError(f"{where}'s {name} must be a whole number >= 0, got {_kind(item[name])}")
        if item["batch"] in out:
            raise StateError(f"{where} is there twice")
        out[item["batch"]] = _batch(item, where, vocab_size)
    return out


def check_schedule(batches: dict[int, Batch], *, step: int, optimizer_steps: int, k: int,
                   total_steps: int | None) -> None:
    """The batches against the checkpoint's counters (``loop.json``: ``step``, ``optimizer_steps``) and the schedule
    (docs/async.md): after step s the drained producer holds batches s .. s+k-1, none past the writing run's
    ``total_steps`` (None, a checkpoint of an earlier version: s .. s+j-1 for some j <= k), batch b
    sampled with the weights after step v, max(0, b - k) <= v <= s - 1, at most the checkpoint's optimizer steps."""
    expected = list(range(step, step + k if total_steps is None else min(step + k, total_steps)))
    held = sorted(batches)
    if held != expected and not (total_steps is None and held == expected[:len(held)]):
        missing = [b for b in expected if b not in batches]
        raise StateError(f"holds batches {held}, where the producer had finished {expected} after step {step} with "
                         f"source.max_staleness={k}" + (f": batch {missing[0]} is missing" if missing else ""))
    for b in held:
        p = batches[b]
        if p.version > step - 1:
            raise StateError(f"batch {b} claims the weights after step {p.version}, newer than this checkpoint's "
                             f"step {step} could have sampled it with (at most {step - 1})")
        if p.version < b - k:
            raise StateError(f"batch {b} claims the weights after step {p.version}, older than source.max_staleness="
                             f"{k} allows (at least {b - k})")
        if p.optimizer_steps > optimizer_steps:
            raise StateError(f"batch {b} claims weights of {p.optimizer_steps} optimizer steps, more than this "
                             f"checkpoint's {optimizer_steps}")


# ------------------------------------------------------------ one batch
def _batch(item: dict, where: str, vocab_size: int | None) -> Batch:
    r = item["rollout"]
    _keys(r, ROLLOUT_KEYS, f"{where}'s rollout")
    if not isinstance(r["prompts"], list) or not r["prompts"]:
        raise StateError(f"{where}'s prompts must be a non-empty list, got {_kind(r['prompts'])}")
    n = len(r["prompts"])
    if not isinstance(r["samples"], list) or len(r["samples"]) != n:
        raise StateError(f"{where}'s samples must be a list of {n} (one per prompt), got {_kind(r['samples'])}")
    if not isinstance(r["columns"], dict) or not all(isinstance(v, list) and len(v) == n for v in r["columns"].values()):
        raise StateError(f"{where}'s columns must map each name to a list of {n} values")
    _tensor(item["rewards"], f"{where}'s rewards", None, (n,))
    _tensor(r["group_ids"], f"{where}'s group_ids", torch.long, (n,))
    for name in ("reward_metrics", "filter_metrics"):
        value = item[name]
        if not (value is None and name == "filter_metrics") and not (
                isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values())):
            raise StateError(f"{where}'s {name} must be a dict of numbers, got {_kind(value)}")
    tensors, loop = r["tensors"], r["loop"]
    _keys(tensors, tuple(TOKENS), f"{where}'s tensors")
    if not isinstance(loop, dict) or not set(loop) <= set(LOOP_FIELDS):
        raise StateError(f"{where}'s loop fields must be a dict of {', '.join(LOOP_FIELDS)}, got "
                         f"{sorted(loop) if isinstance(loop, dict) else _kind(loop)}")
    width = {}
    for name, (dtype, letter) in TOKENS.items():
        t = _tensor(tensors[name], f"{where}'s {name}", dtype, (n, width.get(letter)))
        width.setdefault(letter, t.shape[1])
    for name, t in tensors.items():  # the environment's extras (scores, turns): one row per sample
        if name not in TOKENS:
            _tensor(t, f"{where}'s {name}", None, (n,), leading=True)
    for name in ("prompt_mask", "response_mask"):
        if not ((tensors[name] == 0) | (tensors[name] == 1)).all():
            raise StateError(f"{where}'s {name} holds values other than 0 and 1")
    for name in ("prompt_ids", "response_ids"):
        bad = tensors[name][(tensors[name] < 0) | (tensors[name] >= (vocab_size or 2**62))]
        if bad.numel():
            raise StateError(f"{where}'s {name} hold token id {int(bad[0])}, outside the policy's vocabulary "
                             f"0..{(vocab_size or 1) - 1}")
    for name, value in loop.items():
        dtype, letters = LOOP.get(name, (None, "N"))
        _tensor(value, f"{where}'s {name}", dtype, tuple({"N": n, "R": width["R"]}[c] for c in letters),
                leading=name not in LOOP)
    sampled = tensors["response_mask"] > 0  # [N, R]
    if "engine_logp" in loop and not torch.isfinite(loop["engine_logp"][sampled]).all():
        raise StateError(f"{where}'s engine_logp holds NaN or inf at sampled tokens (an engine gives each sampled "
                         f"token a finite log-prob)")
    if "policy_version" in loop and not (loop["policy_version"] == item["optimizer_steps"]).all():
        raise StateError(f"{where}'s policy_version is not its optimizer_steps ({item['optimizer_steps']}) for every "
                         f"sample")
    rollout = Rollout(tensors=tensors, group_ids=r["group_ids"], prompts=r["prompts"], samples=r["samples"],
                      columns=r["columns"], **loop)
    return Batch(rollout, item["rewards"], item["reward_metrics"], item["filter_metrics"], item["version"],
                 item["optimizer_steps"])


def _keys(value: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(value, dict):
        raise StateError(f"{where} must be a JSON object, got {_kind(value)}")
    missing = [key for key in keys if key not in value]
    if missing:
        raise StateError(f"{where} lacks {', '.join(repr(key) for key in missing)}")


def _tensor(value: Any, where: str, dtype: torch.dtype | None, shape: tuple, leading: bool = False) -> torch.Tensor:
    """``value`` as a tensor of ``dtype`` (None: any floating dtype) and ``shape`` (None: any size there;
    ``leading``: only the first sizes are given)."""
    if not isinstance(value, torch.Tensor):
        raise StateError(f"{where} must be a tensor, got {_kind(value)}")
    if dtype is None and not leading and not value.is_floating_point():
        raise StateError(f"{where} must be a floating-point tensor, got {value.dtype}")
    if dtype is not None and value.dtype != dtype:
        raise StateError(f"{where} must be {dtype}, got {value.dtype}")
    got = tuple(value.shape[:len(shape)]) if leading else tuple(value.shape)
    if len(got) != len(shape) or any(want is not None and g != want for g, want in zip(got, shape)):
        want = ", ".join("?" if s is None else str(s) for s in shape) + (", ..." if leading else "")
        raise StateError(f"{where} has shape {list(value.shape)}, not [{want}]")
    return value


def _kind(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
