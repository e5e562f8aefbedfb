"""DiffusionNFT's negative-aware flow-matching loss (Zheng et al., 2025, https://arxiv.org/abs/2509.16117).

DiffusionNFT trains on the forward process: a clean sample ``x0`` of the old policy, noised afresh to
``x_t = (1 - t) x0 + t eps`` at a sampled time ``t`` (the flow-matching interpolation; t is the sigma),
is regressed with the flow-matching loss towards its target velocity ``u = eps - x0``, through two
*implicit* policies built from the current velocity ``v_theta`` and the old policy's ``v_old``::

    v+ = (1 - beta) v_old + beta v_theta        (the implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta        (the implicit negative policy)
    L  = r ||v+ - u||^2 + (1 - r) ||v- - u||^2   (the paper's policy-optimization objective)

``r`` in [0, 1] is the probability that the sample is "optimal", from its reward's group advantage:
``r = 1/2 + 1/2 clip(A / A_max, -1, 1)`` (paper sec. 4; NVlabs' ``train_nft_sd3.py``, ``adv_clip_max``).
Good samples pull ``v+`` towards them, bad ones push ``v-``; since ``v+ - v- = 2 beta (v_theta - v_old)``
the update moves ``v_theta`` along the direction that separates the two.

What this function computes, following NVlabs' code (``scripts/train_nft_sd3.py``) where the paper
leaves a choice open:

* the squared errors are taken in x0-space, ``x0_pred = x_t - t v`` (so ``x0_pred - x0 = -t (v - u)``),
  each divided by its own detached "adaptive weight" ``w = mean|x0_pred - x0|`` over the latent (clipped
  below at 1e-5), and averaged over the latent dimensions: per sample
  ``L+ = mean((x0_pred+ - x0)^2) / w+`` and the same for ``L-``;
* the loss is ``A_max / beta * (r L+ + (1 - r) L-)``: the code's scale, which the published learning
  rates assume.

With no reward signal (every advantage 0, so r = 1/2) and equal weights the loss is
``||v_old - u||^2 + beta^2 ||v_theta - v_old||^2`` (the parallelogram law): the old policy's
flow-matching loss plus a pull towards it, whose gradient vanishes at ``v_theta = v_old`` (no preference,
no update; tested).

Shapes: n samples, latents ``[n, *latent]``; per-sample results ``[n]``.
"""

from __future__ import annotations

import torch

#: NVlabs' lower bound on the adaptive weight (``.clip(min=0.00001)``).
WEIGHT_FLOOR = 1e-5


def optimality_probability(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """``r = 1/2 + 1/2 clip(A / A_max, -1, 1)`` [n] from advantages [n]: 1/2 for an average sample, 1
    for one ``A_max`` standard deviations above its group's mean, 0 below."""
    return (advantages.float().clamp(-adv_clip, adv_clip) / adv_clip / 2 + 0.5).clamp(0, 1)


def _weighted_x0_error(velocity: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor,
                       t: torch.Tensor) -> torch.Tensor:
    """Per sample ``mean((x0_pred - x0)^2) / w`` [n] with ``x0_pred = x_t - t v`` and the detached
    adaptive weight ``w = max(mean|x0_pred - x0|, 1e-5)`` (computed in float64, as NVlabs' code)."""
    dims = tuple(range(1, clean.ndim))
    error = noisy - t * velocity - clean  # [n, *latent]: x0_pred - x0
    with torch.no_grad():
        weight = error.double().abs().mean(dim=dims).clamp_min(WEIGHT_FLOOR)  # [n]
    return error.square().mean(dim=dims) / weight.to(error.dtype)


def nft_loss(velocity: torch.Tensor, old_velocity: torch.Tensor, clean: torch.Tensor, noisy: torch.Tensor,
             sigma: torch.Tensor, advantages: torch.Tensor, *, beta: float, adv_clip: float
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's policy loss per sample at one noise level (see the module docstring).

    Args:
        velocity: ``v_theta(x_t)`` [n, *latent], the current policy's (gradients flow through it).
        old_velocity: ``v_old(x_t)`` [n, *latent], the old policy's (treated as a constant).
        clean: the sampled clean latents ``x0`` [n, *latent].
        noisy: ``x_t = (1 - t) x0 + t eps`` [n, *latent].
        sigma: t [n], the noise level of ``noisy``.
        advantages: the samples' group advantages [n].
        beta: the implicit policies' step (paper's beta; NVlabs' ``config.beta``), > 0.
        adv_clip: A_max, the advantage that maps to r = 1 (NVlabs' ``adv_clip_max``), > 0.

    Returns:
        The loss [n] (float32) and detached figures [n]: ``r``, the optimality probability, and
        ``old_deviation``, ``mean((v_theta - v_old)^2)`` over the latent (how far the policy moved
        from the old one on this input).
    """
    # beta > 0 and adv_clip > 0 are checked where the config loads (the diffusion config's ``nft`` block).
    v, v_old = velocity.float(), old_velocity.detach().float()
    clean, noisy = clean.float(), noisy.float()
    t = sigma.float().reshape(-1, *([1] * (clean.ndim - 1)))  # [n, 1, ...]
    r = optimality_probability(advantages, adv_clip)  # [n]
    positive = beta * v + (1 - beta) * v_old  # [n, *latent]
    negative = (1 + beta) * v_old - beta * v
    loss = adv_clip / beta * (r * _weighted_x0_error(positive, noisy, clean, t)
                              + (1 - r) * _weighted_x0_error(negative, noisy, clean, t))  # [n]
    deviation = (v.detach() - v_old).square().mean(dim=tuple(range(1, v.ndim)))  # [n]
    return loss, {"r": r.detach(), "old_deviation": deviation}


def velocity_kl(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """DiffusionNFT's KL penalty to the reference model per sample, ``mean((v_theta - v_ref)^2)`` [n]
    over the latent (NVlabs' ``kl_div_loss``; for two Gaussian steps of equal variance the KL is
    proportional to it)."""
    v = velocity.float()
    return (v - ref_velocity.detach().float()).square().mean(dim=tuple(range(1, v.ndim)))
