"""The terms every per-token policy loss starts from and the aggregation it ends with, shared by the
registered losses of ``is_weighted_losses``, ``smooth_ratio_losses`` and ``covariance_losses`` so none
of them repeats the masking.

Masked positions never reach a value or a gradient: each input is replaced with ``torch.where`` before
any arithmetic (not multiplied by 0, as verl does: junk or -inf there would turn into NaN), so finite or
infinite junk in a masked-out log-prob, advantage or weight changes nothing (tested per loss).

Shapes: n samples of the micro-batch, T' the columns of the piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.losses import _bool_mask, _check_same_shape, _masked, aggregate

#: verl's clamp of the token log-ratio before ``exp`` in ``cispo``, ``sapo``, ``dppo_tv`` and ``dppo_kl``
#: (``torch.clamp(negative_approx_kl, min=-20.0, max=20.0)``, "for stability").
LOG_RATIO_CLAMP = 20.0


@dataclass
class TokenTerms:
    """A ratio loss's inputs with the masked positions replaced (module docstring).

    ``mask`` [n, T'] boolean or None (every position counts); ``logp`` [n, T'] with gradients and
    ``old_logp`` [n, T'] detached, both 0 where masked; ``log_ratio`` = ``logp - old_logp`` [n, T']
    (0 where masked); ``advantages`` detached, [n, T'] (or [n, 1] for per-sample advantages without a
    mask), 0 where masked; ``weights`` the rollout-correction weights [n, T'] detached, 0 where masked, or
    None."""

    mask: torch.Tensor | None
    logp: torch.Tensor
    old_logp: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor | None


def token_terms(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None,
                weights: torch.Tensor | None = None) -> TokenTerms:
    """``TokenTerms`` from a loss's inputs (``LossInputs``: ``forward["logp"]``, ``old_logp``, ``advantages``
    [n] or [n, T'], ``mask``, ``weights``), after checking their shapes (one ``ValueError`` naming them)."""
    if logp.ndim != 2:
        raise ValueError(f"logp must be 2-D [n, T], got shape {tuple(logp.shape)}")
    _check_same_shape(logp=logp, old_logp=old_logp, mask=mask, weights=weights)
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [n] or [n, T] with [n, T] = {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    mask = _bool_mask(mask)
    logp = _masked(mask, logp)  # [n, T']
    old_logp = _masked(mask, old_logp.detach())  # [n, T']
    adv = advantages.detach()
    adv = _masked(mask, adv.unsqueeze(-1) if adv.ndim == 1 else adv)  # [n, T'] ([n, 1] without a mask)
    if weights is not None:
        weights = _masked(mask, weights.detach())  # [n, T']
    return TokenTerms(mask, logp, old_logp, logp - old_logp, adv, weights)


def aggregate_tokens(per_token: torch.Tensor, terms: TokenTerms, mode: str, *,
                     denominator: torch.Tensor | float | None, seq_lengths: torch.Tensor | None) -> torch.Tensor:
    """The per-token loss [n, T'] times the rollout-correction weights (verl multiplies every loss's
    matrix by ``rollout_is_weights`` before ``agg_loss``), reduced with ``aggregate``: the micro-batch's
    share of the mini-batch loss when ``denominator`` (and, for a column piece, ``seq_lengths``) are the
    mini-batch's, so micro-batch shares add up."""
    if terms.weights is not None:
        per_token = per_token * terms.weights
    return aggregate(per_token, terms.mask, mode, denominator=denominator, seq_lengths=seq_lengths)


def check_number(owner: object, name: str, *, low: float | None = None, low_open: bool = False,
                 high: float | None = None, optional: bool = False) -> None:
    """Raise ``ValueError`` ("<name> must be ..., got ...") unless ``owner.<name>`` is a real number in the
    range (``low``/``high`` inclusive unless ``low_open``), or None when ``optional``: a loss's settings
    dataclass calls it from ``__post_init__``, so a bad ``algo.loss_args`` value fails where the config loads."""
    value = getattr(owner, name)
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bounds = [f"{'>' if low_open else '>='} {low}"] if low is not None else []
        bounds += [f"<= {high}"] if high is not None else []
        wanted = f"a number {' and '.join(bounds)}".strip() + (" or null" if optional else "")
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
