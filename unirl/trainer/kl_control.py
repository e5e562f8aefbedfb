"""The coefficient of the KL penalty in the reward (``algo.use_kl_in_reward``): fixed, or adapted to
a target KL as Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593) and verl's
``AdaptiveKLController`` do.

A controller's state is one float, saved in the checkpoint's ``loop.json`` as plain JSON
(``state_dict``), so a resumed run continues with the exact coefficient (a float's JSON text
round-trips exactly).
"""

from __future__ import annotations

from unirl.registry import Registry

KL_CONTROLLERS: Registry[type] = Registry("KL controller")


def adaptive_kl_coef(beta: float, current_kl: float, *, target_kl: float, horizon: int, n: int) -> float:
    """One adaptive update: ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``,
    ``beta * (1 + e * n / horizon)``, with ``n`` the step's number of sequences: the coefficient
    grows when the KL is above its target and shrinks below it, by at most 20% per ``horizon``
    sequences."""
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n / horizon)


@KL_CONTROLLERS.register("fixed")
class FixedKLController:
    """``beta`` stays at its initial value."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController(FixedKLController):
    """``beta`` follows ``adaptive_kl_coef`` after every step."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        super().__init__(kl_coef, target_kl, horizon)
        self.target_kl, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n: int) -> None:
        self.value = adaptive_kl_coef(self.value, current_kl, target_kl=self.target_kl, horizon=self.horizon, n=n)


def build_kl_controller(kind: str, *, kl_coef: float, target_kl: float, horizon: int):
    """The controller ``kind`` (``fixed`` or ``adaptive``) starting at ``kl_coef``."""
    if kind not in KL_CONTROLLERS:
        raise ValueError(KL_CONTROLLERS.unknown_message(kind))
    return KL_CONTROLLERS.get(kind)(kl_coef, target_kl, horizon)
