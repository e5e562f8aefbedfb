"""The pure policy-gradient core shared by the text (GRPO) and diffusion (FlowGRPO) environments.

Functions over tensors only: advantages from group rewards, rewards on tokens and PPO's
critic-based advantages (GAE), KL penalties, on-policy distillation's reverse-KL advantages, the
registered policy losses (``policy_losses``: clipped ratio, GSPO, DiffusionNFT's; ``is_weighted_losses``:
CISPO, DPPO; ``smooth_ratio_losses``: SAPO, GMPO; ``covariance_losses``: Clip-Cov, KL-Cov; ``flow_guards``:
GRPO-Guard, Flow-DPPO; ``flow_methods``: DGPO, TempFlow-GRPO, AWM's matching log-prob), the value loss and
their aggregation. No config objects, no ``.item()``, no distributed calls, no I/O.
"""

from unirl.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    estimate_advantages,
    group_advantages,
    group_stats,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from unirl.core.distill import reverse_kl_advantages
from unirl.core.filtering import nonconstant_groups
from unirl.core.kl import KL_ESTIMATORS, gaussian_kl, kl_divergence
from unirl.core.rollout_correction import (IS_MODES, rollout_is_weights, rollout_mismatch_metrics,
                                          token_staleness_metrics, within_staleness)
from unirl.core.shaping import overlong_penalty
from unirl.core.losses import (
    AGG_MODES,
    aggregate,
    aggregate_denominator,
    clipped_policy_loss,
    entropy_from_logits,
    masked_mean,
    policy_loss_metrics,
    truncated_importance_weights,
)
from unirl.core.policy_losses import POLICY_LOSSES, LossInputs, LossSettings, PolicyLoss, register_policy_loss
# The 2026 losses register themselves on import (cispo, dppo_tv, dppo_kl; sapo, geo_mean; clip_cov, kl_cov;
# grpo_guard, flow_dppo; dgpo, tempflow; gardo).
from unirl.core import covariance_losses, is_weighted_losses, smooth_ratio_losses  # noqa: F401
from unirl.core import flow_guards, flow_methods, gardo  # noqa: F401
from unirl.core.returns import (
    discounted_future_sum,
    discounted_returns,
    gae_advantages,
    kl_penalized_rewards,
    kl_step_rewards,
    reinforce_pp_advantages,
    stepwise_advantages,
    token_scores,
)
from unirl.core.turns import turn_token_rewards
from unirl.core.value import explained_variance, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LossInputs",
    "LossSettings",
    "POLICY_LOSSES",
    "PolicyLoss",
    "aggregate",
    "aggregate_denominator",
    "clipped_policy_loss",
    "compute_advantages",
    "discounted_future_sum",
    "discounted_returns",
    "estimate_advantages",
    "explained_variance",
    "gae_advantages",
    "entropy_from_logits",
    "gaussian_kl",
    "group_advantages",
    "group_stats",
    "grpo_advantages",
    "kl_divergence",
    "kl_penalized_rewards",
    "kl_step_rewards",
    "masked_mean",
    "nonconstant_groups",
    "overlong_penalty",
    "policy_loss_metrics",
    "register_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "reverse_kl_advantages",
    "rloo_advantages",
    "rollout_is_weights",
    "rollout_mismatch_metrics",
    "stepwise_advantages",
    "token_scores",
    "token_staleness_metrics",
    "truncated_importance_weights",
    "turn_token_rewards",
    "value_loss",
    "within_staleness",
]
