"""AWM's rollout mode (``algorithm: awm``): Advantage Weighted Matching on DiffusionNFT's data path.

AWM (Xue et al., 2025, https://arxiv.org/abs/2509.25050; Flow-Factory ``src/flow_factory/trainers/awm.py``,
commit a0b2bc5) aligns RL with pretraining: the flow-matching loss of a clean sample noised afresh is its
log-likelihood, and the policy gradient weights it by the sample's advantage.

1. rollout: the current policy samples each prompt G times with the ODE; the clean latents, T noise
   levels per sample and their noise are kept (``forward_process.py``, the data path NFT's uses);
2. forward: at each noise level ``x_t = (1 - t) x0 + t eps`` and the policy's matching log-prob
   ``log p = -w(t) mean((v(x_t) - (eps - x0))^2)`` (``unirl.core.flow_methods.matching_log_prob``);
3. loss: the clipped ratio of ``algo`` over those log-probs (Flow-Factory's PPO clip, its clip range 1e-4),
   the old log-probs the pre-update weights' (on-policy: the update's first forward).

Differences from Flow-Factory: its noise levels are stratified over the schedule and shared by the
batch, drawn in the update, here NVlabs' per-sample draw of NFT's data path at rollout time; its old
log-probs are recomputed before each micro-batch (later timesteps of a batch see the optimizer steps
of earlier ones), here once for the rollout, before the update; no ``off_policy`` EMA sampling and no
KL (its defaults: off and 0).

Shapes: B prompts, G group size, N = B*G, T noise levels per sample, latents ``[*latent]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.flow_methods import AWM_WEIGHTINGS, matching_log_prob
from unirl.diffusion.forward_process import ForwardProcessRollout
from unirl.diffusion.rollout_mode import register_rollout_mode
from unirl.diffusion.sampling import guided_velocity
from unirl.env import Rollout


@dataclass(frozen=True)
class AwmArgs:
    """AWM's settings (``mode_args`` with ``algorithm: awm``); defaults are Flow-Factory's ``AWMTrainingArguments``."""

    #: How the matching error is weighted by the noise level t: ``uniform`` (Flow-Factory's ``Uniform``),
    #: ``t``, ``t**2``, ``huber`` or ``ghuber``.
    weighting: str = "uniform"
    #: The power of ``ghuber``'s generalised Huber error (``ghuber_power``).
    ghuber_power: float = 0.25

    def __post_init__(self):
        if self.weighting not in AWM_WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(AWM_WEIGHTINGS)}, got {self.weighting!r}")
        if not isinstance(self.ghuber_power, (int, float)) or not self.ghuber_power > 0:
            raise ValueError(f"ghuber_power must be > 0, got {self.ghuber_power!r}")


@register_rollout_mode("awm", settings=AwmArgs)
class AWMRollout(ForwardProcessRollout):
    """AWM: the current policy's ODE samples noised afresh, trained by a ratio loss over their flow-matching
    log-probs (``unirl/diffusion/awm.py``)."""

    policy_loss = None  # the ratio loss of ``algo`` over the matching log-probs (Flow-Factory: PPO clip)
    offers = frozenset({"logp"})
    # The old log-probs are a forward of the stored samples (the sampler scores no steps): on-policy the
    # update's first forward gives them, otherwise the trainer's old log-prob pass before the update.
    recompute_old_logprobs = True

    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """``logp`` [n, T']: the matching log-prob at the noise levels ``columns`` (gradients flow into
        ``model``); ``mask`` None (every noise level is trained)."""
        env = self.env
        device = env.accelerator.device
        cond = {k: batch.tensors[k].to(device) for k in env.family.cond_keys}
        clean = batch.tensors["clean"].to(device).float()  # [n, *latent]
        logps = []
        for j in range(*columns.indices(batch.tensors["sigma"].shape[1])):
            noisy, sigma, timestep = self.noisy_input(batch, j, clean)
            target = batch.tensors["noise"][:, j].to(device).float() - clean  # u = eps - x0
            v = guided_velocity(env.family, model, noisy, timestep, cond, 1.0)
            logps.append(matching_log_prob(v, target, sigma, weighting=self.args.weighting,
                                           ghuber_power=self.args.ghuber_power))
        return {"logp": torch.stack(logps, dim=1), "mask": None}  # [n, T']
