"""Guards against over-optimisation for FlowGRPO's per-step ratio loss, as registered policy losses.

Both read, besides each trained step's log-prob under the current and the sampling policy, the step's
Gaussian mean under both (``mean``, ``old_mean`` [n, T', *latent]) and its std (``std`` [n, T']): the
two policies' steps share that std and differ only in the mean, so their divergence is known exactly.

* **GRPO-Guard** (Wang et al., 2025, https://arxiv.org/abs/2510.22319), ``algo.policy_loss: grpo_guard``.
  With ``x' = mu_old + s eps`` the sampled next latent, the log-ratio of one step is
  ``log r = -mean((mu - mu_old)^2) / (2 s^2) + mean(eps (mu - mu_old)) / s``: its mean over the noise is
  *negative* (the first term) and its spread is ``|mu - mu_old| / s``, which grows as the step's std s
  shrinks. So the ratio sits below 1 and positive-advantage samples rarely reach ``1 + clip``
  (the paper's "implicit over-optimisation"). RatioNorm adds the bias back and rescales by s::

      log r~ = (log r + mean((mu - mu_old)^2) / (2 s^2)) * s        (= mean(eps (mu - mu_old)), mean 0)

  and the gradient re-weighting divides each step's clipped loss by ``|dt|`` (the step's
  ``sqrt(-dt)^2``), so the steps' gradients have one scale. Reference: verl-omni
  ``verl_omni/trainer/diffusion/diffusion_algos.py`` ``GRPOGuardLoss.compute_loss`` (commit a1139ba),
  which takes s and dt as one scalar per step for its batch (every sample of a micro-batch at the same
  step); here they are per sample (equal when the samples share the step, as with the default
  ``timestep_selection: first``). Flow-Factory's ``GRPOGuardTrainer`` (``trainers/grpo.py``) has the
  same ratio without the ``1/|dt|`` factor (``dt_reweight: false``).
* **Flow-DPPO** (arXiv 2606.11025), ``algo.policy_loss: flow_dppo``: no ratio clip; the exact Gaussian
  KL between the two steps, ``D = mean((mu - mu_old)^2) / (2 s^2)``, is a trust region: a step whose
  ``D >= kl_threshold`` and whose ratio still moves the way its advantage pushes (``r > 1, A > 0`` or
  ``r < 1, A < 0``) is masked out; corrective moves stay. The loss is ``-A r`` on the kept steps.
  Reference: Tencent UniRL ``unirl/algorithms/flowdppo.py`` ``_flowdppo_kl_adv_loss`` (commit 1a7b501)
  and verl-omni ``FlowDPPOLoss.compute_loss`` (commit a1139ba), the same mask.

Both aggregate their per-step losses with ``algo.loss_agg`` as the clipped loss does, and take the
clip range from ``algo.clip_low`` / ``clip_high`` (GRPO-Guard; verl-omni's GRPO-Guard script uses 2e-6).

Shapes: n samples, T' trained steps of the piece, latents ``[*latent]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.losses import aggregate
from unirl.core.policy_losses import LossInputs, LossSettings, register_policy_loss


def step_mean_kl(mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``mean((mu - mu_old)^2) / (2 s^2)`` [n, T'] over the latent: the KL between two Gaussian steps of
    std ``s`` [n, T'] (``mean``, ``old_mean`` [n, T', *latent]), per latent element."""
    diff = (mean.float() - old_mean.detach().float()).square()
    return diff.flatten(2).mean(dim=2) / (2 * std.float().square())


def guard_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                    std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's RatioNorm log-ratio [n, T']: ``(logp - old_logp + D) * s`` with ``D = step_mean_kl``
    (module docstring: the bias of the log-ratio added back, its scale made the same at every step)."""
    return (logp.float() - old_logp.float() + step_mean_kl(mean, old_mean, std)) * std.float()


@dataclass(frozen=True)
class GrpoGuardArgs:
    """GRPO-Guard's switches (``algo.loss_args`` with ``algo.policy_loss: grpo_guard``); both on is the
    paper's method and verl-omni's ``GRPOGuardLoss``."""

    #: RatioNorm: the ratio ``exp((log r + D) s)`` instead of ``exp(log r)``.
    ratio_norm: bool = True
    #: Divide each step's clipped loss by ``|dt|`` (verl-omni's ``/ sqrt_dt**2``; Flow-Factory: off).
    dt_reweight: bool = True


@register_policy_loss("grpo_guard", settings=GrpoGuardArgs, reads=("mean", "old_mean", "std", "sigma", "sigma_next"))
def grpo_guard_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard's clipped loss (module docstring), aggregated with ``loss_agg``."""
    f, s, args = inputs.forward, settings, settings.args or GrpoGuardArgs()
    if s.dual_clip is not None:
        raise ValueError("algo.policy_loss=grpo_guard has no dual clip: set algo.dual_clip: null")
    log_ratio = (guard_log_ratio(f["logp"], inputs.old_logp, f["mean"], f["old_mean"], f["std"]) if args.ratio_norm
                 else f["logp"].float() - inputs.old_logp.float())  # [n, T']
    ratio = torch.exp(log_ratio)
    adv = inputs.advantages.float()
    per_step = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - s.clip_low, 1 + s.clip_high))  # [n, T']
    if args.dt_reweight:
        per_step = per_step / (f["sigma"].float() - f["sigma_next"].float())  # 1 / |dt|
    if inputs.weights is not None:
        per_step = per_step * inputs.weights
    agg = dict(denominator=inputs.denominator, seq_lengths=inputs.seq_lengths)
    loss = aggregate(per_step, inputs.mask, s.loss_agg, **agg)
    with torch.no_grad():
        clipped = ((ratio < 1 - s.clip_low) | (ratio > 1 + s.clip_high)).float()
        figures = {"loss/policy": loss.detach(), "loss/guard_ratio": aggregate(ratio, inputs.mask, s.loss_agg, **agg),
                   "loss/guard_clip_frac": aggregate(clipped, inputs.mask, s.loss_agg, **agg)}
    return loss, figures


@dataclass(frozen=True)
class FlowDppoArgs:
    """Flow-DPPO's trust region (``algo.loss_args`` with ``algo.policy_loss: flow_dppo``). Defaults are
    Tencent UniRL's ``FlowDPPOConfig`` and verl-omni's ``DiffusionLossConfig`` (the same values)."""

    #: The KL from the sampling policy's step at or above which an update that moves further is masked.
    kl_threshold: float = 1e-5
    #: Divide the mean gap by the step's variance (the exact KL; UniRL's ``add_kl_coefficient``); false:
    #: ``mean((mu - mu_old)^2) / 2``.
    exact_kl: bool = True

    def __post_init__(self):
        value = self.kl_threshold
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"kl_threshold must be > 0, got {value!r}")


def flow_dppo_per_step(logp: torch.Tensor, old_logp: torch.Tensor, kl: torch.Tensor, advantages: torch.Tensor,
                       threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-A r on the kept steps, 0 elsewhere, keep)`` [n, T'] each: a step is dropped when ``kl >= threshold``
    and its ratio moves the way its advantage pushes (module docstring)."""
    ratio = torch.exp(logp.float() - old_logp.float())
    adv = advantages.float()
    high = kl >= threshold
    drop = high & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    keep = ~drop
    # where, not a product: a ratio that overflowed to inf must not give inf * 0 = nan.
    return torch.where(keep, -adv * ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device)), keep


@register_policy_loss("flow_dppo", settings=FlowDppoArgs, reads=("mean", "old_mean", "std"))
def flow_dppo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO's KL-masked loss (module docstring), aggregated with ``loss_agg``."""
    f, s, args = inputs.forward, settings, settings.args or FlowDppoArgs()
    std = f["std"] if args.exact_kl else torch.full_like(f["std"], 2 ** -0.5)  # 2 s^2 = 1: the gap / 2
    kl = step_mean_kl(f["mean"], f["old_mean"], std)  # [n, T']
    per_step, keep = flow_dppo_per_step(f["logp"], inputs.old_logp, kl.detach(), inputs.advantages, args.kl_threshold)
    if inputs.weights is not None:
        per_step = per_step * inputs.weights
    agg = dict(denominator=inputs.denominator, seq_lengths=inputs.seq_lengths)
    loss = aggregate(per_step, inputs.mask, s.loss_agg, **agg)
    with torch.no_grad():
        figures = {"loss/policy": loss.detach(), "loss/dppo_kl": aggregate(kl, inputs.mask, s.loss_agg, **agg),
                   "loss/dppo_masked_frac": aggregate((~keep).float(), inputs.mask, s.loss_agg, **agg)}
    return loss, figures
