"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", https://arxiv.org/abs/2505.22617; verl ``compute_policy_loss_clip_cov`` /
``compute_policy_loss_kl_cov``, adapted from PRIME-RL/Entropy-Mechanism-of-RL).

The policy's entropy falls at a rate set by the covariance between a token's log-prob and its
advantage; a few tokens with a large covariance drive the collapse. Both losses score every trained
token of the batch by ``cov_t = (A_t - mean A) (logp_t - mean logp)`` (means over the batch's trained
tokens) and treat a small share of the largest differently:

* ``clip_cov``: PPO's clipped loss, with up to ``clip_cov_ratio`` of the tokens drawn at random among
  those PPO did not clip and whose cov lies in ``(clip_cov_lb, clip_cov_ub)`` dropped from the loss
  (no gradient);
* ``kl_cov``: the unclipped ratio loss ``-A r``, plus ``ppo_kl_coef * |logp - old_logp|`` on the
  ``kl_cov_ratio`` share of tokens with the largest cov.

**Micro-batches**: the batch is the loss's input, i.e. one micro-batch, as in verl (whose loss function
sees one micro-batch): the means, the share and the chosen tokens are the micro-batch's. So, unlike
the other losses, the mini-batch's loss depends on how it is cut into micro-batches
(``trainer.micro_batch_size``): the accumulation adds up for a fixed choice of tokens only. Both need
whole sequences (the trainer does not cut them into column pieces). The counts are kept as tensors
(no ``.item()``): the random draw of ``clip_cov`` is a uniform subset as verl's ``randperm`` draws, but
another draw of the global generator.

Shapes: n samples of the micro-batch, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.loss_terms import TokenTerms, aggregate_tokens, check_number, token_terms
from unirl.core.policy_losses import LossInputs, LossSettings, register_policy_loss


def _terms(inputs: LossInputs) -> TokenTerms:
    return token_terms(inputs.forward["logp"], inputs.old_logp, inputs.advantages, inputs.mask, inputs.weights)


def token_covariance(terms: TokenTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cov [n, T], trained [n, T])``: ``(A_t - mean A)(logp_t - mean logp)`` (detached) with the means
    over the trained tokens, and the boolean trained-token mask (all True without a mask)."""
    logp = terms.logp.detach()
    trained = terms.mask if terms.mask is not None else torch.ones_like(logp, dtype=torch.bool)
    adv = terms.advantages.expand_as(logp)  # [n, T]
    count = trained.sum().clamp_min(1)
    mean_adv = torch.where(trained, adv, 0.0).sum() / count
    mean_logp = torch.where(trained, logp, 0.0).sum() / count
    return torch.where(trained, (adv - mean_adv) * (logp - mean_logp), 0.0), trained


def share_count(trained: torch.Tensor, share: float) -> torch.Tensor:
    """``max(floor(share * trained tokens), 1)`` as a 0-dim tensor (verl's ``max(int(r * n), 1)``, in float64
    as Python's product)."""
    return torch.floor(trained.sum().double() * share).clamp_min(1)


def _rank(keys: torch.Tensor, descending: bool) -> torch.Tensor:
    """[n, T] each position's rank (0 first) in the order of ``keys`` (stable)."""
    order = torch.argsort(keys.flatten(), descending=descending, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return rank.view_as(keys)


# ---- Clip-Cov -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipCovArgs:
    """Clip-Cov's settings (``algo.loss_args`` with ``algo.policy_loss: clip_cov``); defaults are verl's
    ``PolicyLossConfig``. Its PPO clip is ``algo.clip_low``/``clip_high`` (as verl's ``clip_ratio``)."""

    #: Share of the micro-batch's trained tokens whose gradient is dropped (verl: 0.0002; at least one).
    clip_cov_ratio: float = 0.0002
    #: Only tokens with cov above this are candidates (verl: 1.0).
    clip_cov_lb: float = 1.0
    #: ... and below this (verl: 5.0).
    clip_cov_ub: float = 5.0

    def __post_init__(self):
        check_number(self, "clip_cov_ratio", low=0, low_open=True, high=1)
        check_number(self, "clip_cov_lb")
        check_number(self, "clip_cov_ub")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {self.clip_cov_lb} and {self.clip_cov_ub}")


def clip_cov_per_token(terms: TokenTerms, clip_low: float, clip_high: float, args: ClipCovArgs
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [n, T], dropped [n, T])``: PPO's clipped per-token loss with the drawn tokens' set to 0."""
    ratio = torch.exp(terms.log_ratio)  # [n, T] (verl does not clamp the log-ratio here)
    unclipped = -terms.advantages * ratio  # [n, T]
    clipped = -terms.advantages * ratio.clamp(1 - clip_low, 1 + clip_high)  # [n, T]
    with torch.no_grad():
        cov, trained = token_covariance(terms)
        clipped_by_ppo = clipped > unclipped  # [n, T]
        candidates = trained & ~clipped_by_ppo & (cov > args.clip_cov_lb) & (cov < args.clip_cov_ub)
        # A uniform random subset of min(k, #candidates): the candidates ranked by a uniform key.
        keys = torch.where(candidates, torch.rand(cov.shape, device=cov.device, dtype=torch.float64), 2.0)
        dropped = candidates & (_rank(keys, descending=False) < share_count(trained, args.clip_cov_ratio))
    return torch.where(dropped, 0.0, torch.maximum(unclipped, clipped)), dropped


@register_policy_loss("clip_cov", settings=ClipCovArgs, whole_sequences=True)
def clip_cov_loss(inputs: LossInputs, settings: LossSettings):
    """Clip-Cov (https://arxiv.org/abs/2505.22617; verl ``compute_policy_loss_clip_cov``): PPO's clipped loss
    (``algo.clip_low``/``clip_high``; no dual clip, as verl) with a random ``clip_cov_ratio`` share of the
    micro-batch's high-covariance tokens left out of the gradient (``ClipCovArgs``), against entropy collapse.

    Aggregated with ``algo.loss_agg``; the tokens are chosen per micro-batch (module docstring)."""
    terms = _terms(inputs)
    args = settings.args or ClipCovArgs()
    per_token, _ = clip_cov_per_token(terms, settings.clip_low, settings.clip_high, args)
    loss = aggregate_tokens(per_token, terms, settings.loss_agg, denominator=inputs.denominator,
                            seq_lengths=inputs.seq_lengths)
    return loss, {"loss/policy": loss.detach()}


# ---- KL-Cov -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KlCovArgs:
    """KL-Cov's settings (``algo.loss_args`` with ``algo.policy_loss: kl_cov``); defaults are verl's
    ``PolicyLossConfig`` (its loss falls back to ``ppo_kl_coef`` 1 only when the config has none)."""

    #: Share of the micro-batch's trained tokens, those with the largest cov, that get the penalty
    #: (verl: 0.0002; at least one).
    kl_cov_ratio: float = 0.0002
    #: Weight of |logp - old_logp| on them (verl: 0.1).
    ppo_kl_coef: float = 0.1

    def __post_init__(self):
        check_number(self, "kl_cov_ratio", low=0, low_open=True, high=1)
        check_number(self, "ppo_kl_coef", low=0)


def kl_cov_per_token(terms: TokenTerms, args: KlCovArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [n, T], penalised [n, T])``: ``-A r``, plus ``ppo_kl_coef |log r|`` on the top-cov tokens."""
    loss = -terms.advantages * torch.exp(terms.log_ratio)  # [n, T] (no clip and no clamp, as verl)
    with torch.no_grad():
        cov, trained = token_covariance(terms)
        keys = torch.where(trained, cov, -torch.inf)  # [n, T]
        # The k largest (verl's topk; ties, which topk breaks arbitrarily, go to the first here).
        penalised = trained & (_rank(keys, descending=True) < share_count(trained, args.kl_cov_ratio))
    return torch.where(penalised, loss + args.ppo_kl_coef * terms.log_ratio.abs(), loss), penalised


@register_policy_loss("kl_cov", settings=KlCovArgs, whole_sequences=True)
def kl_cov_loss(inputs: LossInputs, settings: LossSettings):
    """KL-Cov (https://arxiv.org/abs/2505.22617; verl ``compute_policy_loss_kl_cov``): the unclipped ratio
    loss plus ``ppo_kl_coef * |logp - old_logp|`` on the ``kl_cov_ratio`` share of the micro-batch's tokens
    with the largest covariance (``KlCovArgs``), against entropy collapse.

    ``algo.clip_low``/``clip_high`` are not read (verl's has no clip either); aggregated with
    ``algo.loss_agg``; the tokens are chosen per micro-batch (module docstring)."""
    terms = _terms(inputs)
    per_token, _ = kl_cov_per_token(terms, settings.args or KlCovArgs())
    loss = aggregate_tokens(per_token, terms, settings.loss_agg, denominator=inputs.denominator,
                            seq_lengths=inputs.seq_lengths)
    return loss, {"loss/policy": loss.detach()}
