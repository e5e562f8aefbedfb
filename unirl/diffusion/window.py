"""Where the SDE window lies at each training step: a pure function of the step.

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
