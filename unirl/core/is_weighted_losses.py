"""Policy losses that weight the plain policy gradient ``-A_t * log pi(y_t)`` by a stop-gradient
importance weight instead of clipping a ratio surrogate: CISPO, and DPPO's binary trust-region masks.

Per token, with ``r_t = exp(logp_t - old_logp_t)`` (its log clamped to [-20, 20] as verl does) and sg
the stop-gradient::

    cispo:   l_t = -sg(clip(r_t, 1 - is_low, 1 + is_high)) * A_t * logp_t
    dppo_*:  l_t = -sg(min(r_t, ratio_cap)) * A_t * logp_t * m_t,   m_t in {0, 1} (no gradient)

so every token keeps a gradient (CISPO) or loses it only when the policy has moved too far *in the
direction its advantage pushes* (DPPO), where PPO's clip silences a token whose ratio left
``[1 - eps, 1 + eps]``. The per-token losses are weighted by the rollout-correction weights and
aggregated with ``algo.loss_agg`` (``loss_terms.aggregate_tokens``), so micro-batch shares add up.

On policy (ratio 1) both gradients equal the vanilla policy gradient ``-A_t grad logp_t``.

Shapes: n samples of the micro-batch, T' the columns of the piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.loss_terms import LOG_RATIO_CLAMP, TokenTerms, aggregate_tokens, check_number, token_terms
from unirl.core.policy_losses import LossInputs, LossSettings, register_policy_loss


def _terms(inputs: LossInputs) -> TokenTerms:
    return token_terms(inputs.forward["logp"], inputs.old_logp, inputs.advantages, inputs.mask, inputs.weights)


def _finish(per_token: torch.Tensor, terms: TokenTerms, inputs: LossInputs, settings: LossSettings):
    loss = aggregate_tokens(per_token, terms, settings.loss_agg, denominator=inputs.denominator,
                            seq_lengths=inputs.seq_lengths)
    return loss, {"loss/policy": loss.detach()}


def _ratio(terms: TokenTerms) -> torch.Tensor:
    """[n, T'] the detached token ratio, its log clamped to [-20, 20] (verl)."""
    return torch.exp(terms.log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


# ---- CISPO -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CispoArgs:
    """CISPO's settings (``algo.loss_args`` with ``algo.policy_loss: cispo``): the bounds of its IS weight,
    which are not PPO's ratio clip (``algo.clip_low``/``clip_high`` are not read)."""

    #: The weight's lower bound is 1 - is_low; null: no lower bound. MiniMax-M1 sets its epsilon_low^IS
    #: "to a large value" (no lower bound) and tunes only the upper one; verl's CISPO example does the same
    #: with clip_ratio_low: 10.
    is_low: float | None = None
    #: The weight's upper bound is 1 + is_high (verl's CISPO example: clip_ratio_high 0.2). TRL caps the
    #: weight itself at epsilon_high and recommends ScaleRL's 5, which is is_high: 4 here.
    is_high: float = 0.2

    def __post_init__(self):
        check_number(self, "is_low", low=0, optional=True)
        check_number(self, "is_high", low=0)


def cispo_per_token(terms: TokenTerms, is_low: float | None, is_high: float) -> torch.Tensor:
    """CISPO's per-token loss [n, T'] (module docstring)."""
    weight = _ratio(terms).clamp(min=None if is_low is None else 1 - is_low, max=1 + is_high)  # [n, T']
    return -weight * terms.advantages * terms.logp


@register_policy_loss("cispo", settings=CispoArgs)
def cispo_loss(inputs: LossInputs, settings: LossSettings):
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): the policy gradient weighted by the clipped,
    stop-gradient IS ratio, so no token loses its gradient (verl ``compute_policy_loss_cispo``).

    ``l_t = -sg(clip(r_t, 1 - is_low, 1 + is_high)) * A_t * logp_t`` (``CispoArgs``), aggregated with
    ``algo.loss_agg`` (MiniMax-M1 normalises by the batch's token count: ``token-mean``, the default)."""
    terms = _terms(inputs)
    args = settings.args or CispoArgs()
    return _finish(cispo_per_token(terms, args.is_low, args.is_high), terms, inputs, settings)


# ---- DPPO: binary TV and binary KL trust regions --------------------------------------------------------


def _dppo_per_token(terms: TokenTerms, valid: torch.Tensor, ratio_cap: float) -> torch.Tensor:
    """``-sg(min(r, ratio_cap)) * A * logp`` where ``valid``, 0 elsewhere (no gradient there)."""
    weight = _ratio(terms).clamp(max=ratio_cap)  # [n, T']: truncated IS, in place of PPO's dual clip
    return torch.where(valid, -weight * terms.advantages * terms.logp, 0.0)


def _check_dppo(args, low: str, high: str) -> None:
    check_number(args, low, low=0, low_open=True)
    check_number(args, high, low=0, low_open=True)
    check_number(args, "ratio_cap", low=0, low_open=True)


@dataclass(frozen=True)
class DppoTvArgs:
    """DPPO-Binary-TV's settings (``algo.loss_args`` with ``algo.policy_loss: dppo_tv``). verl reads them
    from ``clip_ratio_low``/``clip_ratio_high`` (its comment: "the TV divergence threshold"); here they are
    the loss's own, so PPO's ratio range (``algo.clip_low``/``clip_high``, not read) is not taken for a
    divergence."""

    #: A token with A <= 0 loses its gradient once p - p_old < -tv_low (verl's DPPO example: 0.15).
    tv_low: float = 0.15
    #: A token with A > 0 loses its gradient once p - p_old > tv_high (verl's DPPO example: 0.15).
    tv_high: float = 0.15
    #: The IS weight is truncated at ratio_cap (verl's default in the loss, 20: its comment and the paper's
    #: section 5.4 ask for a large cap; the DPPO example sets 10000; verl's actor config's dual-clip
    #: clip_ratio_c: 3 would shadow it there unless set).
    ratio_cap: float = 20.0

    def __post_init__(self):
        _check_dppo(self, "tv_low", "tv_high")


@register_policy_loss("dppo_tv", settings=DppoTvArgs, discrete=True)
def dppo_tv_loss(inputs: LossInputs, settings: LossSettings):
    """DPPO-Binary-TV (Qi et al. 2026, https://arxiv.org/abs/2602.04879; verl
    ``compute_policy_loss_dppo_tv``): the truncated-IS policy gradient, with a token's gradient dropped
    once its probability has moved past the total-variation threshold in the direction its advantage
    pushes: ``m_t = [p_t - p_old,t <= tv_high]`` for A > 0, ``[p_t - p_old,t >= -tv_low]`` otherwise.

    Probabilities ``p = exp(logp)`` of tokens: text only (``discrete``). The anchor is ``old_logp``: the
    trainer's recomputed log-probs (the paper's "recompute" variant, as verl), the engine's with
    ``algo.bypass_mode`` (the paper's own). AReaL's IcePop-style rejection (``apply_rejection_sampling``)
    differs: it drops tokens whose trainer/engine *ratio* leaves ``[low, high]`` whatever the advantage's
    sign, a rollout correction (unirl's ``algo.rollout_is: token_mask``), not a trust region."""
    terms = _terms(inputs)
    args = settings.args or DppoTvArgs()
    with torch.no_grad():
        moved = torch.exp(terms.logp) - torch.exp(terms.old_logp)  # [n, T'] p - p_old (0 where masked)
        valid = torch.where(terms.advantages > 0, moved <= args.tv_high, moved >= -args.tv_low)  # [n, T']
    return _finish(_dppo_per_token(terms, valid, args.ratio_cap), terms, inputs, settings)


@dataclass(frozen=True)
class DppoKlArgs:
    """DPPO-Binary-KL's settings (``algo.loss_args`` with ``algo.policy_loss: dppo_kl``; verl reads them from
    ``clip_ratio_low``/``clip_ratio_high``, see ``DppoTvArgs``)."""

    #: A token with A <= 0 loses its gradient once its probability fell and the binary KL passed kl_low
    #: (verl's DPPO example: 0.05).
    kl_low: float = 0.05
    #: A token with A > 0 loses its gradient once its probability rose and the binary KL passed kl_high
    #: (verl's DPPO example: 0.05).
    kl_high: float = 0.05
    #: As ``DppoTvArgs.ratio_cap``.
    ratio_cap: float = 20.0

    def __post_init__(self):
        _check_dppo(self, "kl_low", "kl_high")


def binary_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p_old) || Bernoulli(p)) of the sampled token against all others, [n, T']:
    ``p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))`` (verl's 1e-8)."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    return p_old * (old_logp - logp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))


@register_policy_loss("dppo_kl", settings=DppoKlArgs, discrete=True)
def dppo_kl_loss(inputs: LossInputs, settings: LossSettings):
    """DPPO-Binary-KL (https://arxiv.org/abs/2602.04879; verl ``compute_policy_loss_dppo_kl``): as
    ``dppo_tv`` with the binary KL as the divergence: for A > 0 the gradient is dropped where
    ``binary_kl > kl_high`` and the probability rose, for A <= 0 where ``binary_kl > kl_low`` and it fell."""
    terms = _terms(inputs)
    args = settings.args or DppoKlArgs()
    with torch.no_grad():
        kl = binary_kl(terms.logp, terms.old_logp)  # [n, T'] (0 where masked: both log-probs are 0 there)
        p, p_old = torch.exp(terms.logp), torch.exp(terms.old_logp)  # compared as probabilities, as verl does
        valid = torch.where(terms.advantages > 0, (kl <= args.kl_high) | (p <= p_old), (kl <= args.kl_low) | (p >= p_old))
    return _finish(_dppo_per_token(terms, valid, args.ratio_cap), terms, inputs, settings)
