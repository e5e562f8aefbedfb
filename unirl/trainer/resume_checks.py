"""What a resume checks before it trusts a checkpoint (``unirl.trainer.checkpoints.resume``): where its files
are, the loop's counters, the restored optimizer and schedule, the RNG states, and which config changes it
refuses. (The batch source checks its in-flight batches itself: ``unirl.rollout.in_flight``.)

A checkpoint is data that may have been damaged or edited by hand. Each check raises
``StateFileError`` naming the file and the field, so resume skips the checkpoint with that one line
and falls back to the one before; a config change that no checkpoint of the run could accept is a
``CheckpointError`` (there is nothing to fall back to).
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unirl.trainer.state_files import StateFileError

#: The largest counter a checkpoint may hold: integers up to 2**53 are exact in JSON readers that
#: parse numbers as doubles, and no run takes that many steps.
MAX_COUNT = 2**53


# ==================================================================== links
def links_out(path: Path, run_dir: Path) -> bool:
    """Whether ``path`` is a symbolic link whose target lies outside ``run_dir`` (both resolved)."""
    return path.is_symlink() and not path.resolve().is_relative_to(Path(run_dir).resolve())


def link_out_of(path: Path, run_dir: Path) -> Path | None:
    """The first symbolic link at or under ``path`` whose target lies outside ``run_dir``, or None.
    ``os.walk`` does not descend into linked directories, so nothing outside is read."""
    if links_out(path, run_dir):
        return path
    for folder, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            if links_out(Path(folder) / name, run_dir):
                return Path(folder) / name
    return None


def link_message(link: Path) -> str:
    return (f"{link} is a link to {link.resolve()}, outside the run directory; resume reads only what the run "
            f"wrote (copy the files into the run to use them)")


# ============================================================ loop counters
def check_loop_state(state: Any, file: Path, step: int) -> dict[str, Any]:
    """``loop.json`` of the checkpoint ``step_<step>``: every field's type and range, or
    ``StateFileError`` naming the file and the field. Returns ``state``."""
    if not isinstance(state, dict):
        raise StateFileError(f"{file}: not a JSON object of the loop's counters")
    if "step" not in state or "optimizer_steps" not in state:
        raise StateFileError(f"{file}: step or optimizer_steps missing")
    _count(state, "step", file)
    if state["step"] != step:
        raise StateFileError(f"{file}: step is {state['step']}, but the checkpoint is step_{step:06d}")
    for name in ("optimizer_steps", "prompt_batches", "zero_adv_steps"):
        if name in state:
            _count(state, name, file)
    if "kl_ctrl" in state:
        kl = state["kl_ctrl"]
        value = kl.get("value") if isinstance(kl, dict) else None
        if not _real(value) or not math.isfinite(value) or value < 0:
            raise StateFileError(f"{file}: kl_ctrl.value must be a finite number >= 0 (the KL coefficient), "
                                 f"got {_short(kl)}")
    return state


def _count(state: dict, name: str, file: Path) -> None:
    value = state[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise StateFileError(f"{file}: {name} must be a whole number, got {_short(value)}")
    if not 0 <= value <= MAX_COUNT:
        raise StateFileError(f"{file}: {name} must be between 0 and 2**53, got {_short(value)}")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ================================================================ RNG states
def set_rng_states(states: Any, stem: Path) -> None:
    """Each library's RNG state, checked whole first: no float in it may be infinite or NaN (Python's and
    numpy's ``setstate`` take a cached Gaussian of ``inf`` as it is, and the next normal draw returns it)."""
    def floats(value):
        return [x for v in value for x in floats(v)] if isinstance(value, (list, tuple)) else (
            [value] if isinstance(value, float) else [])

    bad = [x for key in ("python", "numpy") for x in floats(states.get(key, ()) if isinstance(states, dict) else ())
           if not math.isfinite(x)]
    if bad:
        raise StateFileError(f"{stem}: corrupt RNG state (holds {bad[0]}; an RNG state is whole numbers and a finite "
                             f"cached Gaussian draw)")
    try:
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
    except (KeyError, ValueError, RuntimeError, TypeError, OverflowError, IndexError) as e:
        raise StateFileError(f"{stem}: corrupt RNG state ({_first_line(e)})") from e


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# =================================================== optimizer and schedule
def check_optimizer(optimizer: torch.optim.Optimizer, stem: Path) -> None:
    """After ``load_state_dict``: each parameter's state tensors (AdamW's moments) have the parameter's
    shape and are finite, and its ``step`` is a finite count >= 0. torch checks none of this, so swapped
    tensor references in the JSON would pass and crash (or silently mix moments) at the first step."""
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                where = f"{stem}.json: parameter {index}'s {key!r}"
                if not isinstance(value, torch.Tensor):
                    if _real(value) and not math.isfinite(value):
                        raise StateFileError(f"{where} is {value}")
                    continue
                if key == "step":
                    if value.numel() != 1 or not torch.isfinite(value).all() or value.item() < 0:
                        raise StateFileError(f"{where} must be one finite count >= 0, got shape {tuple(value.shape)}")
                elif value.shape != param.shape:
                    raise StateFileError(f"{where} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)} "
                                         f"(tensor references swapped or from another model)")
                elif value.is_floating_point() and not torch.isfinite(value).all():
                    raise StateFileError(f"{where} holds NaN or inf")
            index += 1


def check_scheduler(scheduler: Any, stem: Path) -> None:
    """After ``load_state_dict``: a learning-rate schedule's counter is a count and its rates are finite."""
    scheduler = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper holds the schedule
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return
    last = scheduler.last_epoch
    if isinstance(last, bool) or not isinstance(last, int) or not -1 <= last <= MAX_COUNT:
        raise StateFileError(f"{stem}.json: last_epoch must be a count, got {_short(last)}")
    for name in ("base_lrs", "_last_lr"):
        rates = getattr(scheduler, name, None) or []
        if not all(_real(r) and math.isfinite(r) for r in rates):
            raise StateFileError(f"{stem}.json: {name} must be finite learning rates, got {_short(rates)}")


# ============================================================ config changes
#: The critic's settings a resumed PPO run may not change (compared only when both the checkpoint and
#: this run train a critic): its values were learnt under this clip range, its schedule counts
#: ``ppo_epochs`` optimizer passes a step, and its weights come from ``name_or_path``.
CRITIC_KEYS = ("critic.cliprange_value", "critic.ppo_epochs", "critic.name_or_path")


def trains_a_critic(flat: dict[str, Any]) -> bool:
    """Whether a run's flattened config (``algo.adv_estimator``) trains a critic, as the loop decides."""
    from unirl.core import ADVANTAGE_ESTIMATORS

    name = flat.get("algo.adv_estimator")
    return name in ADVANTAGE_ESTIMATORS and bool(getattr(ADVANTAGE_ESTIMATORS.get(name), "reads_values", False))


def critic_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What a resume may not change about the critic, each ``key: old in the checkpoint, new now``
    (flattened configs): whether there is one at all (``algo.adv_estimator``), then ``CRITIC_KEYS``."""
    had, has = trains_a_critic(old), trains_a_critic(new)
    if had != has:
        what = ("it trains a critic", "no critic") if had else ("no critic", "it trains a critic")
        return [f"algo.adv_estimator: {old.get('algo.adv_estimator')!r} in the checkpoint ({what[0]}), "
                f"{new.get('algo.adv_estimator')!r} now ({what[1]})"]
    if not had:
        return []
    changes = []
    for key in CRITIC_KEYS:
        before, now = old.get(key), new.get(key)
        if key == "critic.ppo_epochs":  # null: the trainer's, so compare the passes it makes
            before, now = before or old.get("trainer.ppo_epochs"), now or new.get("trainer.ppo_epochs")
        if key in old and key in new and before != now:
            changes.append(f"{key}: {before!r} in the checkpoint, {now!r} now")
    return changes
