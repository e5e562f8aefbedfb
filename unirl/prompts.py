"""The prompts of a run, one builder both environments share: ``Prompts`` hands out the training rows of
each step (``next``) and holds the held-out rows (``test_rows``).

Shapes: B rows per step and process.
"""

from __future__ import annotations

import random


class Prompts:
    """Hands out B rows per step and process: epochs of a seeded shuffle, resumable from a step number.

    With several processes every one shuffles the same way (same seed) and takes its own slice of
    the step's B * world rows, so the processes never draw the same prompt in a step.
    """

    def __init__(self, rows: list[dict], batch_size: int, *, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, test_rows: list[dict] | None = None):
        if not rows:
            raise ValueError("the training data has no rows")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        #: The held-out rows (every process holds all of them; the evaluation splits them).
        self.test_rows = list(test_rows or [])
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: steps only move forward
        return self._orders[epoch]

    def next(self, step: int) -> list[dict]:
        """Rows for ``step`` (0-based) on this process; the same step always gives the same rows."""
        start = (step * self.world_size + self.rank) * self.batch_size
        out = []
        for k in range(start, start + self.batch_size):
            epoch, pos = divmod(k, len(self.rows))
            out.append(self.rows[self._order(epoch)[pos]])
        return out

