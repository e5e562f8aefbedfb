"""DPM-Solver++(2M) for a flow-matching model: the deterministic steps MixGRPO-Flash takes after the SDE window.

DPM-Solver++ (Lu et al., 2022, https://arxiv.org/abs/2211.01095, Algorithm 2, the multistep
second-order solver with the "midpoint" form of its correction) integrates the probability-flow ODE in
the log-SNR ``lambda = log(alpha / sigma)`` with the model's data prediction ``x0``. For a rectified
flow ``x_sigma = (1 - sigma) x0 + sigma x1`` the signal scale is ``alpha = 1 - sigma`` and the data
prediction of a velocity ``v = x1 - x0`` is ``x0 = x - sigma v``; diffusers'
``DPMSolverMultistepScheduler`` with ``prediction_type="flow_prediction"`` and ``use_flow_sigmas=True``
is this configuration, and MixGRPO's ``dpm_step`` (``fastvideo/utils/sampling_utils.py``) the same
formulas. A step ``s0 -> t`` with ``h = lambda_t - lambda_s0``::

    first order (DDIM):  x_t = (sigma_t / sigma_s0) x + alpha_t (1 - e^{-h}) x0
    2M (midpoint):       x_t = (sigma_t / sigma_s0) x + alpha_t (1 - e^{-h}) (D0 + D1 / 2),
                         D0 = x0,  D1 = (x0 - x0_prev) h / h_prev,  h_prev = lambda_s0 - lambda_s1

where ``x0_prev`` is the data prediction of the previous step (at ``s1``). Without a previous step and at
the last step (``sigma_t = 0``, where ``x_t = x0``) the step is first order, as diffusers' scheduler does
with its default ``final_sigmas_type="zero"`` and as MixGRPO does at its last step.

``e^{-h} = (alpha_s0 sigma_t) / (sigma_s0 alpha_t)`` needs no logarithm, so ``sigma_s0 = 1`` (``alpha = 0``,
``lambda = -inf``) is fine: the first-order step from pure noise is then the Euler step. A previous step
at ``sigma = 1`` makes ``h_prev`` infinite and the correction vanish (the step is first order).

The scalars are computed in float64 on the host from the schedule's sigmas; the latents stay float32.
"""

from __future__ import annotations

import math

import torch


def data_prediction(sample: torch.Tensor, velocity: torch.Tensor, sigma: float) -> torch.Tensor:
    """``x0 = x - sigma v`` [N, ...] (float32): the flow model's prediction of the clean latent."""
    return sample.float() - sigma * velocity.float()


def _log_snr(sigma: float) -> float:
    """``lambda = log((1 - sigma) / sigma)``; ``-inf`` at ``sigma = 1``, ``+inf`` at ``sigma = 0``."""
    if sigma >= 1:
        return -math.inf
    if sigma <= 0:
        return math.inf
    return math.log(1 - sigma) - math.log(sigma)


def dpm_solver_pp_step(sample: torch.Tensor, x0: torch.Tensor, sigma: float, sigma_next: float, *,
                       prev_x0: torch.Tensor | None = None, prev_sigma: float | None = None) -> torch.Tensor:
    """One DPM-Solver++ step ``sigma -> sigma_next`` (``0 <= sigma_next < sigma <= 1``) of ``sample``
    [N, ...] with the data prediction ``x0`` at ``sigma`` (``data_prediction``): second order (2M, midpoint)
    when the previous step's ``prev_x0`` at ``prev_sigma`` is given and ``sigma_next > 0``, first order
    otherwise. Returns the next latent [N, ...], float32."""
    if not 0 <= sigma_next < sigma <= 1:
        raise ValueError(f"need 0 <= sigma_next < sigma <= 1, got sigma={sigma}, sigma_next={sigma_next}")
    alpha, alpha_next = 1 - sigma, 1 - sigma_next
    decay = (alpha * sigma_next) / (sigma * alpha_next)  # e^{-h}
    weight = alpha_next * (1 - decay)  # of D0 (and half of it of D1)
    x0 = x0.float()
    if prev_x0 is not None and sigma_next > 0:
        if prev_sigma is None or not sigma < prev_sigma <= 1:
            raise ValueError(f"prev_sigma must lie in (sigma, 1] = ({sigma}, 1], got {prev_sigma}")
        h = _log_snr(sigma_next) - _log_snr(sigma)
        h_prev = _log_snr(sigma) - _log_snr(prev_sigma)
        ratio = h / h_prev  # 1 / r0; 0 when the previous step started from pure noise (h_prev = inf)
        x0 = x0 + (0.5 * ratio) * (x0 - prev_x0.float())  # D0 + D1 / 2
    return torch.add(sample.float() * (sigma_next / sigma), x0, alpha=weight)
