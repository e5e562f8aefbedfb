"""The critic's loss and figures (PPO's value function, https://arxiv.org/abs/1707.06347).

Legend: N = B*G samples, T tokens. Masks are boolean (or 0/1) [N, T]; masked-out positions reach no
loss, gradient or figure (``torch.where``, not multiplication).
"""

from __future__ import annotations

import torch

from unirl.core.losses import aggregate, bool_mask, check_same_shape


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float,
    agg: str = "token-mean",
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, verl's ``compute_value_loss``::

        v_clip = clamp(v, v_old - clip, v_old + clip)
        loss   = 0.5 * aggregate(max((v - R)^2, (v_clip - R)^2))

    The clip keeps one update from moving a value far from the one its advantages were computed with
    (the value-clipping of OpenAI's baselines PPO2).

    Args:
        values: [N, T] the critic's current values (with gradient).
        old_values: [N, T] the values at rollout time (the advantages' baseline).
        returns: [N, T] the regression target (GAE's lambda-returns).
        mask: [N, T] boolean or 0/1.
        clip: the clip range around ``old_values`` (verl's ``cliprange_value``), > 0.
        agg: aggregation mode (``unirl.core.aggregate``).
        denominator: the mini-batch normaliser for gradient accumulation (see ``aggregate``).

    Returns:
        ``(loss, metrics)``; metrics are detached 0-dim tensors, masked means: ``vf_clipfrac`` (the
        clipped term is the larger one) and ``vpred_mean``.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip!r}")
    mask = bool_mask(mask)
    # Masked positions are zeroed before any arithmetic, as the policy loss does: a NaN or inf there
    # would otherwise reach the gradient through the squares (0 * NaN is NaN), whatever the mask does after.
    values = torch.where(mask, values, 0.0)  # [N, T]
    old = torch.where(mask, old_values.detach(), 0.0)  # [N, T]
    returns = torch.where(mask, returns, 0.0)  # [N, T]
    clipped = torch.maximum(torch.minimum(values, old + clip), old - clip)  # [N, T]
    unclipped_loss = (values - returns).square()  # [N, T]
    clipped_loss = (clipped - returns).square()  # [N, T]
    per_token = torch.maximum(unclipped_loss, clipped_loss)  # [N, T]
    loss = 0.5 * aggregate(per_token, mask, agg, denominator=denominator)
    with torch.no_grad():
        count = mask.sum().clamp_min(1)
        metrics = {
            "vf_clipfrac": torch.where(mask, clipped_loss > unclipped_loss, False).sum() / count,
            "vpred_mean": torch.where(mask, values.detach(), 0.0).sum() / count,
        }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked-in positions (Bessel-corrected variances; verl's
    ``critic/vf_explained_var`` adds 1e-5 to the denominator, as here): 1 when the critic predicts the
    returns exactly, 0 when it does no better than their mean, negative when worse. [N, T] -> 0-dim."""
    check_same_shape(values=values, returns=returns, mask=mask)
    mask = bool_mask(mask)
    count = mask.sum()
    if count < 2:
        return values.new_zeros(())

    def var(x):
        mean = torch.where(mask, x, 0.0).sum() / count
        return torch.where(mask, x - mean, 0.0).square().sum() / (count - 1)

    return 1 - var(returns - values) / (var(returns) + 1e-5)
