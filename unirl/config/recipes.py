"""Recipes: the config keys of common GRPO variants, by name, applied before a run's own overrides.

    unirl train text --config tiny --recipe dr_grpo
    unirl.train("text", "tiny", recipe="gspo")

A recipe sets only the keys its paper changes; everything else is the config's. The keys each one
sets are listed by ``unirl config list`` and in docs/configs.md. (DAPO and PPO with a critic come as
shipped configs.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unirl.registry import Registry


@dataclass(frozen=True)
class Recipe:
    #: One line: what the variant changes.
    about: str
    #: The paper.
    reference: str
    #: Dotted config keys and their values.
    keys: dict[str, Any]

    def overrides(self) -> list[str]:
        import json

        return [f"{key}={json.dumps(value)}" for key, value in self.keys.items()]


RECIPES: Registry[Recipe] = Registry("recipe")
RECIPES.add("dr_grpo", Recipe(
    "Dr. GRPO: advantages not divided by the group's std; each answer's token losses summed and divided by a constant "
    "length (rollout.max_new_tokens for text), not by the answer's own length",
    "https://arxiv.org/abs/2503.20783",
    {"algo.adv_estimator": "grpo", "algo.adv_scale": "none", "algo.loss_agg": "seq-mean-token-sum-norm"}))
RECIPES.add("gspo", Recipe(
    "GSPO: one importance ratio per answer (the geometric mean of its tokens'), clipped to [1 - 3e-4, 1 + 4e-4] "
    "(the paper's section 5.1)",
    "https://arxiv.org/abs/2507.18071",
    {"algo.level": "sequence", "algo.loss_agg": "seq-mean-token-mean", "algo.clip_low": 3e-4, "algo.clip_high": 4e-4}))
RECIPES.add("rloo", Recipe(
    "RLOO: each answer's baseline is the mean reward of the other answers to its prompt (the advantage only; the "
    "clipped loss stays)",
    "https://arxiv.org/abs/2402.14740",
    {"algo.adv_estimator": "rloo"}))


def recipe_overrides(name: str | None) -> list[str]:
    """``key=value`` strings of recipe ``name`` (none for None); an unknown name lists the recipes."""
    if name is None:
        return []
    try:
        return RECIPES.get(name).overrides()
    except KeyError as err:
        raise ValueError(err.args[0]) from None
