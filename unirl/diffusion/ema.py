"""An exponential moving average of the trainable weights, swapped in for evaluation and saving
(FlowGRPO's ``EMAModuleWrapper``); DiffusionNFT's old policy (``OldPolicy``, also DGPO's) follows the weights
the same way, on its own decay schedule.
"""

from __future__ import annotations

import contextlib

import torch


class ParamEMA:
    """Exponential moving average of a list of parameters on FlowGRPO's schedule
    (``flow_grpo/ema.py``, ``EMAModuleWrapper.step``).

    ``step(k)`` is called after optimizer step k (k = 1, 2, ... over the whole run). When
    ``(k + 1) % update_every == 0`` the averages move towards the parameters with decay
    ``d_k = min((1 + k) / (10 + k), decay)``: ``shadow <- shadow + (1 - d_k) (param - shadow)``. The
    warm-up follows the optimizer-step count, not the number of updates, so with ``update_every=8``
    the first update (k = 7) already has decay 8/17 and 0.9 is reached at k = 81, the tenth update.
    ``swapped()`` puts the averages into the parameters for a while.
    """

    def __init__(self, params: list[torch.nn.Parameter], decay: float, update_every: int = 1):
        self.params, self.decay, self.update_every = list(params), decay, update_every
        self.shadow = [p.detach().clone().float() for p in self.params]
        self._upcast = any(p.dtype != torch.float32 for p in self.params)  # bf16 parameters, float32 averages

    def decay_at(self, optimizer_step: int) -> float:
        return min((1 + optimizer_step) / (10 + optimizer_step), self.decay)

    @torch.no_grad()
    def step(self, optimizer_step: int) -> None:
        if (optimizer_step + 1) % self.update_every or not self.shadow:
            return
        d = self.decay_at(optimizer_step)
        # shadow <- shadow + (1 - d) (param - shadow), each operation over all tensors at once.
        delta = torch._foreach_sub([p.float() for p in self.params] if self._upcast else self.params, self.shadow)
        torch._foreach_mul_(delta, 1 - d)
        torch._foreach_add_(self.shadow, delta)

    @contextlib.contextmanager
    def swapped(self):
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        for s, v in zip(self.shadow, state["shadow"], strict=True):
            s.copy_(v)


class OldPolicy(ParamEMA):
    """DiffusionNFT's old policy (and DGPO's ``ema_ref``): a copy of the trainable weights that follows
    them once per training step, ``old <- d old + (1 - d) new`` with ``d = 0`` for the first ``flat`` optimizer steps and then
    ``min(rate * (k - flat), ceiling)`` after k optimizer steps (NVlabs' ``return_decay``).

    ``saw(k)`` records each optimizer step; ``catch_up()`` (before a rollout) moves the copy once with the
    decay of the last step seen, if any step came since the last move: what the code does at the end of
    each epoch. Both counters are part of the state, so a resumed run moves it exactly as before."""

    def __init__(self, params: list[torch.nn.Parameter], flat: int, rate: float, ceiling: float):
        super().__init__(params, decay=ceiling, update_every=1)
        self.flat, self.rate = flat, rate
        self.seen = self.moved = 0  # optimizer steps seen, and the count at the last move

    def decay_at(self, optimizer_step: int) -> float:
        if optimizer_step < self.flat:
            return 0.0
        return min((optimizer_step - self.flat) * self.rate, self.decay)

    def saw(self, optimizer_step: int) -> None:
        self.seen = optimizer_step

    def catch_up(self) -> None:
        if self.seen != self.moved:
            self.step(self.seen)
            self.moved = self.seen

    def state_dict(self) -> dict:
        return {**super().state_dict(), "seen": self.seen, "moved": self.moved}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.seen, self.moved = int(state["seen"]), int(state["moved"])
