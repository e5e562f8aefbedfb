"""Policy losses that reshape PPO's ratio surrogate instead of clipping it per token: SAPO's smooth gate
and GMPO's geometric mean over a sequence.

Shapes: n samples of the micro-batch, T' the columns of the piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.loss_terms import LOG_RATIO_CLAMP, TokenTerms, aggregate_tokens, check_number, token_terms
from unirl.core.losses import aggregate
from unirl.core.policy_losses import LossInputs, LossSettings, register_policy_loss


def _terms(inputs: LossInputs) -> TokenTerms:
    return token_terms(inputs.forward["logp"], inputs.old_logp, inputs.advantages, inputs.mask, inputs.weights)


# ---- SAPO ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SapoArgs:
    """SAPO's settings (``algo.loss_args`` with ``algo.policy_loss: sapo``): the gate's temperatures.
    Defaults are verl's actor config and TRL's ``sapo_temperature_pos``/``_neg``."""

    #: Temperature of tokens with A > 0 (verl ``tau_pos: 1.0``, TRL 1.0).
    tau_pos: float = 1.0
    #: Temperature of tokens with A <= 0 (verl ``tau_neg: 1.05``, TRL 1.05): a larger one narrows the gate
    #: for negative tokens, whose gradients spread over many other tokens' logits (the paper's asymmetry).
    tau_neg: float = 1.05

    def __post_init__(self):
        check_number(self, "tau_pos", low=0, low_open=True)
        check_number(self, "tau_neg", low=0, low_open=True)


def sapo_per_token(terms: TokenTerms, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO's per-token loss [n, T']: ``-f(r_t) A_t`` with ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``."""
    ratio = torch.exp(terms.log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [n, T'], with gradient
    adv = terms.advantages
    # In the advantages' dtype (two Python floats would make a float32 tensor).
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))  # [n, T'] (or [n, 1])
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)  # [n, T']
    return -gate * adv


@register_policy_loss("sapo", settings=SapoArgs, loss_agg="seq-mean-token-mean")
def sapo_loss(inputs: LossInputs, settings: LossSettings):
    """SAPO (Soft Adaptive Policy Optimization, https://arxiv.org/abs/2511.20347; verl
    ``compute_policy_loss_sapo``, TRL ``loss_type="sapo"``): PPO's hard clip replaced by a smooth gate;
    needs ``algo.loss_agg: seq-mean-token-mean``.

    ``l_t = -f(r_t) A_t``, ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``, tau = ``tau_pos`` for A > 0 else
    ``tau_neg`` (``SapoArgs``): ``f'(r) = 4 sigmoid(.)(1 - sigmoid(.))`` is 1 at r = 1 (the on-policy
    gradient is the policy gradient) and decays smoothly as the ratio leaves 1, so off-policy tokens are
    down-weighted instead of cut off. verl and TRL aggregate it with ``seq-mean-token-mean`` whatever
    else is configured; here ``algo.loss_agg`` must say so (checked where the config loads)."""
    terms = _terms(inputs)
    args = settings.args or SapoArgs()
    loss = aggregate_tokens(sapo_per_token(terms, args.tau_pos, args.tau_neg), terms, settings.loss_agg,
                            denominator=inputs.denominator, seq_lengths=inputs.seq_lengths)
    return loss, {"loss/policy": loss.detach()}


# ---- GMPO ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GeoMeanArgs:
    """GMPO's settings (``algo.loss_args`` with ``algo.policy_loss: geo_mean``): its clip range, on the
    token *log*-ratio (verl reads ``clip_ratio_low``/``clip_ratio_high`` for it; PPO's ratio range,
    ``algo.clip_low``/``clip_high``, is not read here)."""

    #: The token log-ratio is clipped at -log_clip_low where that lowers the objective (GMPO's README and
    #: verl's GMPO example: 0.4, i.e. the ratio at e^-0.4).
    log_clip_low: float = 0.4
    #: And at +log_clip_high (0.4 as well: ratio e^0.4).
    log_clip_high: float = 0.4

    def __post_init__(self):
        check_number(self, "log_clip_low", low=0)
        check_number(self, "log_clip_high", low=0)


def geo_mean_per_sequence(terms: TokenTerms, log_clip_low: float, log_clip_high: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [n], has_tokens [n])``: GMPO's loss of each sequence and whether it has a trained token."""
    lengths = (terms.mask.sum(-1) if terms.mask is not None else
               torch.full(terms.logp.shape[:1], terms.logp.shape[1], device=terms.logp.device))  # [n]
    per_len = lengths.clamp_min(1)  # [n]
    sign = torch.sign(terms.advantages)  # [n, T'] (or [n, 1])
    clipped = terms.log_ratio.clamp(-log_clip_low, log_clip_high)  # [n, T']
    # PPO's pessimistic min, in log space and signed by the advantage: the clip bites only where it lowers
    # the objective (a token with A = 0 contributes log-ratio 0).
    log_ratio = sign * torch.minimum(sign * terms.log_ratio, sign * clipped)  # [n, T']
    seq_ratio = torch.exp(log_ratio.sum(-1) / per_len)  # [n]: the geometric mean of the token ratios
    adv = terms.advantages.expand_as(terms.logp).sum(-1) / per_len  # [n]: sequence advantage (mean over tokens)
    loss = -adv * seq_ratio  # [n]
    if terms.weights is not None:
        # verl: the token weights' geometric mean over the sequence (log(w + 1e-10) so a zero weight is finite).
        log_w = torch.log(terms.weights + 1e-10)  # [n, T']
        if terms.mask is not None:
            log_w = torch.where(terms.mask, log_w, 0.0)
        loss = loss * torch.exp(log_w.sum(-1) / per_len)
    return loss, lengths > 0


@register_policy_loss("geo_mean", settings=GeoMeanArgs, whole_sequences=True, level="sequence",
                      loss_agg="seq-mean-token-mean")
def geo_mean_loss(inputs: LossInputs, settings: LossSettings):
    """GMPO (Geometric-Mean Policy Optimization, https://arxiv.org/abs/2507.20673; verl
    ``compute_policy_loss_geo_mean``): a sequence's advantage times the *geometric* mean of its token
    ratios, each clipped in log space by PPO's pessimistic rule (``GeoMeanArgs``); needs
    ``algo.loss_agg: seq-mean-token-mean``.

    Per sequence i::

        l_i = -A_i * exp(mean_t sign(A_t) min(sign(A_t) log r_t, sign(A_t) clip(log r_t, -low, high)))

    with ``A_i`` the mean of the sequence's token advantages (GMPO is defined for one advantage per
    sequence; token-level ones, e.g. a critic's, are averaged, as in verl). An outlier token moves a
    geometric mean less than an arithmetic one. Sequences are averaged: ``algo.loss_agg`` must be
    ``seq-mean-token-mean`` (checked where the config loads); verl takes a plain ``mean`` over its
    micro-batch's rows, here the sum over the micro-batch's sequences with a trained token is divided by
    the mini-batch's count (``inputs.denominator``), so micro-batch shares add up. Needs whole sequences."""
    if settings.loss_agg != "seq-mean-token-mean":
        raise ValueError(f"geo_mean averages sequences: loss_agg must be 'seq-mean-token-mean', got {settings.loss_agg!r}")
    if inputs.seq_lengths is not None:
        raise ValueError("geo_mean needs whole sequences: seq_lengths (a column piece) is not allowed")
    args = settings.args or GeoMeanArgs()
    per_seq, has_tokens = geo_mean_per_sequence(_terms(inputs), args.log_clip_low, args.log_clip_high)  # [n]
    loss = aggregate(per_seq.unsqueeze(-1), has_tokens.unsqueeze(-1), "seq-mean-token-mean",
                     denominator=inputs.denominator)
    return loss, {"loss/policy": loss.detach()}
