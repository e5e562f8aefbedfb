"""Where the SDE window lies at each training step (a pure function of the step), and which steps follow it.

Only the steps in the window are stochastic and trained; the others are deterministic ODE steps.

* ``random`` (Flow-GRPO-Fast, FlowGRPO's ``sde_window_size`` / ``sde_window_range``; MixGRPO's
  ``random`` strategy): the start is drawn uniformly in ``[lo, hi - size]`` at every training step,
  from the run's seed and the step.
* ``progressive`` (MixGRPO, https://arxiv.org/abs/2507.21802, ``fastvideo/utils/grpo_states.py`` of
  Tencent-Hunyuan/MixGRPO): the window starts at ``lo`` and moves by ``stride`` steps every
  ``shift_interval`` training steps (the paper's shift interval, the code's ``iters_per_group``), so
  training follows the denoising from the noisy steps to the clean ones. Near ``hi`` the window is cut
  at ``hi`` (``[start, min(start + size, hi))``, as MixGRPO's ``get_current_timesteps``), and after its
  last position it rolls back to ``lo`` (``--roll_back``, which all of MixGRPO's scripts pass).

MixGRPO keeps the position in a mutable object that counts iterations; here it is computed from the
number of finished training steps, so a resumed run and every process find the same window without
saving anything. One change: MixGRPO rolls back when the start *passes* ``hi``, so a start equal to
``hi`` gives an empty window for ``shift_interval`` steps (where its training step would have nothing to
train); here the window rolls back when it would be empty. Its ``decay`` and ``exp_decay`` strategies
(shift intervals that shrink over training) are not implemented.

``kept_steps`` is MixGRPO-Flash's compression of the deterministic steps after the window
(``dpm_post_compress_ratio``): DPM-Solver++(2M) takes them in fewer, longer steps.

Shapes: S sampling steps.
"""

from __future__ import annotations

import random

import torch

SCHEDULES = ("random", "progressive")


def window_bounds(step: int, *, num_steps: int, size: int, window_range: tuple[int, int] | None = None,
                  schedule: str = "random", shift_interval: int = 1, stride: int = 1, seed: int = 0) -> tuple[int, int]:
    """``(start, stop)``: the SDE steps ``[start, stop)`` of training step ``step`` (0 for the first).

    ``size == 0``: every step, ``(0, num_steps)`` (plain FlowGRPO). ``window_range`` ``[lo, hi)`` (None:
    all steps) bounds the window; the module docstring gives the two schedules.

    >>> [window_bounds(s, num_steps=8, size=3, window_range=(0, 6), schedule="progressive", shift_interval=2)
    ...  for s in range(0, 14, 2)]
    [(0, 3), (1, 4), (2, 5), (3, 6), (4, 6), (5, 6), (0, 3)]
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if size == 0:
        return 0, num_steps
    lo, hi = window_range if window_range is not None else (0, num_steps)
    if not (0 <= lo and lo + size <= hi <= num_steps):
        raise ValueError(f"a window of {size} steps does not fit in [{lo}, {hi}) of {num_steps} steps")
    if step < 0 or shift_interval < 1 or stride < 0:
        raise ValueError(f"need step >= 0, shift_interval >= 1 and stride >= 0, got {step}, {shift_interval}, {stride}")
    if schedule == "random":
        # One generator per step, seeded by the run's seed and the step: the same draw on every process
        # and after a resume (the draw unirl made before the schedules existed, kept).
        start = random.Random(seed * 7_919 + step).randint(lo, hi - size)
        return start, start + size
    positions = 1 if stride == 0 else -(-(hi - lo) // stride)  # starts lo, lo + stride, ... below hi
    start = lo + (step // shift_interval) % positions * stride
    return start, min(start + size, hi)


def window_mask(num_steps: int, start: int, stop: int) -> torch.Tensor:
    """``[S]`` bool: True for the SDE steps ``[start, stop)``."""
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[start:stop] = True
    return mask


def kept_steps(num_steps: int, stop: int, ratio: float) -> list[int]:
    """Indices into a schedule's ``S + 1`` sigmas that a rollout visits when the ``S - stop`` steps after the
    window (which ends at ``stop``) are cut to ``ratio`` of them: ``0 .. stop`` unchanged, then ``n`` steps
    to ``S`` (sigma 0), ``n = max(1, int((S - stop + 1) * ratio) - 1)``, as evenly spaced as the schedule allows.

    MixGRPO-Flash (``run_sample_step`` with ``dpm_apply_strategy="post"``) counts ``int((S - stop + 1) *
    ratio)`` points from the window's end to 0, so ``n`` is its number of steps (at least one: it would
    stop short of sigma 0 with none). It re-spaces them linearly in its unshifted time and shifts them;
    here they are taken from the family's own schedule, whose unshifted time is linear too, so the two
    agree where ``S - stop`` is a multiple of ``n`` and differ by the rounding of an index elsewhere.

    >>> kept_steps(25, 4, 0.4)  # MixGRPO-Flash's script: 25 steps, a window [0, 4): 21 steps become 7
    [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25]
    >>> kept_steps(8, 2, 1.0)
    [0, 1, 2, 3, 4, 5, 6, 7, 8]
    """
    if not 0 <= stop <= num_steps or not 0 < ratio <= 1:
        raise ValueError(f"need 0 <= stop <= {num_steps} and 0 < ratio <= 1, got stop={stop}, ratio={ratio}")
    tail = num_steps - stop
    if tail == 0:
        return list(range(num_steps + 1))
    n = max(1, int((tail + 1) * ratio) - 1)
    return list(range(stop)) + [stop + round(j * tail / n) for j in range(n + 1)]
