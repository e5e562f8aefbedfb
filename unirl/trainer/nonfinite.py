"""Stopping a run whose losses or values went NaN or inf, and never checkpointing such a state.

A learning rate far too high (a critic's at 1e30), an fp16 overflow or a reward that returns NaN
makes the step's figures non-finite. The optimizer step is skipped when the gradient norm is not
finite, so one such step can pass; ``trainer.max_nonfinite_steps`` of them in a row stop the run
with one line naming the figure, and the checkpoints written before them are kept: a step with
non-finite figures, or a model with non-finite weights, is not saved over them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from unirl.trainer.checkpoints import last_checkpoint_hint

#: The figures watched: the losses (``loss/*``), the critic's loss and values, and the advantages
#: (where the critic's values end up). Rewards are not: NaN there means "does not apply".
WATCHED = ("loss/", "critic/vf_loss", "critic/vpred_mean", "adv/mean", "adv/abs_mean")


class NonFiniteError(ValueError):
    """The run's figures were non-finite for ``trainer.max_nonfinite_steps`` steps in a row. A
    ``ValueError``: a setting (most often a learning rate) is the cause, and the CLI ends the run with
    this one line and exit status 2."""


class NonFiniteWatch:
    """Counts the steps in a row whose watched figures are not finite (``observe`` after each step)."""

    def __init__(self, limit: int):
        self.limit = limit  # 0: never stop
        self.streak = 0
        self.figures: dict[str, float] = {}  # the latest step's non-finite figures

    def observe(self, metrics: dict[str, float], step: int, run_dir: Path) -> None:
        """Record step ``step``'s figures; ``NonFiniteError`` when the streak reaches the limit."""
        self.figures = {k: v for k, v in metrics.items()
                        if k.startswith(WATCHED) and isinstance(v, float) and not math.isfinite(v)}
        self.streak = self.streak + 1 if self.figures else 0
        if self.figures and self.limit and self.streak >= self.limit:
            raise NonFiniteError(
                f"step {step}: {self._named()} for {self.streak} steps in a row (trainer.max_nonfinite_steps="
                f"{self.limit}); stopped without saving this state; {last_checkpoint_hint(run_dir)}. A learning rate "
                f"too high (optim.lr, critic.optim.lr) is the usual cause")

    def unsafe_to_save(self, models) -> str | None:
        """Why the current state must not be checkpointed (None when it may be): the last step's figures
        were not finite, or a model holds a NaN or inf weight (read with one device sync)."""
        if self.figures:
            return self._named()
        params = [p.detach() for model in models for p in model.parameters()]
        if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
            return "a model holds NaN or inf weights"
        return None

    def _named(self) -> str:
        names = sorted(self.figures)
        shown = ", ".join(f"{k} is {self.figures[k]}" for k in names[:3])
        return shown + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")


def skip_save_line(step: int, why: str, run_dir: Path) -> str:
    """The line printed instead of a checkpoint of a non-finite state."""
    return f"step {step}: not checkpointed: {why}; {last_checkpoint_hint(run_dir)}"
