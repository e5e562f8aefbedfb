"""KL penalties against a frozen reference policy.

``kl_divergence`` gives per-token estimates of KL(pi || pi_ref) from the log-probabilities of the
sampled tokens (text); ``gaussian_kl`` gives the closed form between the Gaussian transition kernels
of an SDE denoising step (diffusion), as FlowGRPO does.

Legend: N = B*G samples, T tokens or denoising steps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from unirl.registry import Registry

KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator")

# verl clamps the exponent of k3 to this bound before ``exp`` when it clamps at all.
_EXP_BOUND = 20.0


# Each estimator maps the log-ratio ``d = logp - ref_logp`` (samples drawn from pi) to an estimate of
# KL(pi || pi_ref). http://joschu.net/blog/kl-approx.html
@KL_ESTIMATORS.register("k1")
def _k1(d: torch.Tensor) -> torch.Tensor:
    # log(pi / pi_ref): unbiased, but a single sample is negative about half the time.
    return d


@KL_ESTIMATORS.register("k2")
def _k2(d: torch.Tensor) -> torch.Tensor:
    # 0.5 * log(pi / pi_ref)^2: biased, non-negative, and its gradient is the gradient of KL in
    # expectation (https://arxiv.org/abs/2505.17508).
    return 0.5 * d.square()


@KL_ESTIMATORS.register("k3")
def _k3(d: torch.Tensor) -> torch.Tensor:
    # r - log r - 1 with r = pi_ref / pi = exp(-d): unbiased, non-negative, low variance.
    # expm1(x) - x keeps precision for small x, where exp(x) - 1 - x cancels.
    return torch.expm1(-d) + d


@KL_ESTIMATORS.register("k3+")
def _k3_plus(d: torch.Tensor) -> torch.Tensor:
    # Straight-through (verl's "+" suffix): the value of k3, the gradient of k2.
    k2 = _k2(d)
    return k2 - k2.detach() + _k3(d).detach()


def kl_divergence(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: str = "k3",
    *,
    clamp: float | None = None,
) -> torch.Tensor:
    """Elementwise estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    With ``d = logp - ref_logp``:

    * ``"k1"``: ``d``.
    * ``"k2"``: ``0.5 * d**2``.
    * ``"k3"``: ``exp(-d) + d - 1``, Schulman's low-variance unbiased estimator
      (http://joschu.net/blog/kl-approx.html), verl's ``low_var_kl``; always >= 0.
    * ``"k3+"``: the value of k3 with the gradient of k2 (straight-through, as verl's ``kl_penalty``
      does for names ending in ``+``). The expected gradient of k1/k3 is not the gradient of KL; that
      of k2 is (https://arxiv.org/abs/2505.17508), so ``k3+`` logs and penalises with k3's low-variance
      value but optimises with the right gradient.

    Args:
        logp: [...] log-probs under the current policy (e.g. [N, T]).
        ref_logp: log-probs under the reference, same shape.
        estimator: one of ``KL_ESTIMATORS`` (``k1``, ``k2``, ``k3``, ``k3+``).
        clamp: off by default (exact formulas). A positive float ``c`` reproduces verl's ``low_var_kl``
            safety clamp (``c=10`` there): the exponent of k3 is clamped to [-20, 20] and the k3 value
            to at most ``c``. Only valid with ``k3`` and ``k3+`` (for ``k3+`` it clamps the value; the
            gradient stays k2's).

    Returns:
        Per-element KL estimate, shape of ``logp``.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp must have the same shape, got logp {tuple(logp.shape)}, "
            f"ref_logp {tuple(ref_logp.shape)}"
        )
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator: {KL_ESTIMATORS.unknown_message(estimator)}")
    d = logp - ref_logp
    if clamp is None:
        return KL_ESTIMATORS.get(estimator)(d)
    if estimator not in ("k3", "k3+"):
        raise ValueError(f"clamp applies to the k3 estimators only ('k3', 'k3+'), got estimator {estimator!r}")
    if not clamp > 0:
        raise ValueError(f"clamp must be positive or None, got {clamp!r}")
    value = _k3(d.clamp(-_EXP_BOUND, _EXP_BOUND)).clamp(max=clamp)
    if estimator == "k3":
        return value
    k2 = _k2(d)
    return k2 - k2.detach() + value.detach()


def gaussian_kl(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: torch.Tensor | float,
    *,
    reduce_dims: Sequence[int] | None = None,
) -> torch.Tensor:
    """Closed-form KL between Gaussians with the same std, averaged over the non-batch dims.

    ``KL(N(mean, std^2) || N(ref_mean, std^2)) = (mean - ref_mean)^2 / (2 std^2)`` per element, then the
    mean over ``reduce_dims``. An SDE denoising step of the current and the reference policy shares its
    noise level and differs only in the predicted mean, so this is the form of FlowGRPO's KL
    (https://arxiv.org/abs/2505.05470, ``(mean - ref_mean)**2.mean(dims) / (2 std**2)``; identical when
    std is constant over the reduced dims). Which std goes in is the caller's choice: the step's own
    gives the exact KL, FlowGRPO passes the SDE's diffusion coefficient (see
    ``unirl.diffusion.sde.step_kl``).

    Args:
        mean: [N, ...] mean of the current policy's transition, e.g. [N, C, H, W] latents.
        ref_mean: same shape, the reference policy's.
        std: a float, a tensor broadcastable to ``mean``, or a per-sample tensor [N] (a 1-D tensor of
            length N is always read as per-sample when ``mean`` has more than one dim).
        reduce_dims: dims to average over; default every dim but the first.

    Returns:
        [N] per-sample KL (shape of ``mean`` without ``reduce_dims``).
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"mean and ref_mean must have the same shape, got mean {tuple(mean.shape)}, "
            f"ref_mean {tuple(ref_mean.shape)}"
        )
    if mean.ndim < 1:
        raise ValueError(f"mean must have a batch dim [N, ...], got shape {tuple(mean.shape)}")
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    if std.ndim == 1 and mean.ndim > 1 and std.shape[0] == mean.shape[0]:
        std = std.reshape(-1, *([1] * (mean.ndim - 1)))  # [N] -> [N, 1, ..., 1]
    try:
        broadcast = torch.broadcast_shapes(std.shape, mean.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != mean.shape:
        raise ValueError(
            f"std must be a float, per-sample [N] or broadcastable to mean {tuple(mean.shape)}, "
            f"got std {tuple(std.shape)}"
        )
    dims = tuple(range(1, mean.ndim)) if reduce_dims is None else tuple(reduce_dims)
    per_element = (mean - ref_mean).square() / (2 * std.square())  # shape of mean
    return per_element.mean(dim=dims) if dims else per_element
