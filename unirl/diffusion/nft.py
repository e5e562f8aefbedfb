"""DiffusionNFT's rollout mode (``algorithm: nft``) of ``DiffusionEnvironment``; its loss is the registered ``nft``.

DiffusionNFT (Zheng et al., 2025, https://arxiv.org/abs/2509.16117; code github.com/NVlabs/DiffusionNFT,
``scripts/train_nft_sd3.py``) trains on the forward process instead of the sampler's steps:

1. rollout: the *old* policy samples each prompt G times with a deterministic solver (the ODE; no
   per-step log-probs, no CFG), and only the clean latents are kept, with, per sample, T noise levels
   drawn from the sampling schedule (a random permutation's first ``int(S * timestep_fraction)``) and
   their fresh Gaussian noise;
2. score and advantages: the loop's, as for FlowGRPO (group-relative advantages);
3. update: at each kept noise level the clean latent is noised afresh, ``x_t = (1 - t) x0 + t eps``, and
   the current and old policies' velocities at ``x_t`` (``score_actions``) enter the registered ``nft``
   policy loss (``unirl.core.policy_losses``: ``unirl.core.nft.nft_loss`` plus ``kl_coef`` (``algo.loss_args``) times the
   velocity gap to the reference), one noise level a piece;
4. the old policy follows the trained weights once per training step, ``old <- d old + (1 - d) new``
   with NVlabs' rising decay ``d`` (``OldPolicy``), before the next rollout.

The rollout and the noised inputs are the forward-process data path shared with AWM and DGPO
(``forward_process.py``). Differences from NVlabs' code: the training noise and noise levels are drawn at
rollout time from the rollout's seed (the code draws them in the update), so a resumed run and 1 or 2
processes see the same ones and ``trainer.ppo_epochs > 1`` reuses them; the rollout solver is the Euler
ODE step (the code's SD3 configs use DPM-Solver 2, ``solver: dpm2``); the old policy is a copy of the
trainable weights swapped in for its forwards, not a second LoRA adapter (the same numbers; it also
serves full fine-tuning).

Shapes: B prompts, G group size, N = B*G, S sampling steps, T trained noise levels per sample,
latents ``[*latent]`` in the family's layout.
"""

from __future__ import annotations

import copy

import torch

from unirl.core.policy_losses import build_loss_args
from unirl.diffusion.ema import OldPolicy
from unirl.diffusion.forward_process import ForwardProcessRollout
from unirl.diffusion.rollout_mode import register_rollout_mode
from unirl.diffusion.sampling import guided_velocity
from unirl.env import Rollout


@register_rollout_mode("nft")
class NFTRollout(ForwardProcessRollout):
    """DiffusionNFT: the old policy's ODE samples (clean latents and noise levels kept), the velocities its
    loss reads, and the old policy (``unirl/diffusion/nft.py``). The environment's EMA, reference,
    rewards, evaluation and saving are shared with FlowGRPO; rollouts and training forwards are CFG-free
    (the config refuses ``sampling.train_cfg``)."""

    policy_loss = "nft"  # score_actions returns the velocities the registered ``nft`` loss reads
    offers = frozenset({"velocity", "old_velocity", "ref_velocity", "clean", "noisy", "sigma"})

    def setup(self) -> None:
        env, n = self.env, self.env.cfg.nft
        self.kl_coef = build_loss_args("nft", env.cfg.algo.loss_args).kl_coef  # with a KL the reference's velocities too
        if self.kl_coef > 0 and not env.cfg.model.lora.enabled and env.ref is None:
            env.ref = copy.deepcopy(env.model).requires_grad_(False).eval()  # the untrained weights
        self.old = OldPolicy([p for p in env.model.parameters() if p.requires_grad], n.old_decay_flat,
                             n.old_decay_rate, n.old_decay_max)

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        self.old.saw(optimizer_steps)  # after the environment's evaluation EMA

    def checkpoint_objects(self) -> dict:
        return {"old_policy": self.old}

    def sampling_weights(self):
        # The old policy takes the last training step's weights (its decay), then samples.
        self.old.catch_up()
        return self.old.swapped()

    # ------------------------------------------------------------ the forward
    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """What the ``nft`` policy loss (``unirl.core.policy_losses``) reads at the noise levels ``columns``:
        ``velocity`` [n, T', *latent] (gradients flow into ``model``), the old policy's ``old_velocity``
        (and the reference's ``ref_velocity`` with a ``kl_coef``) at the same noised inputs, detached;
        ``clean`` [n, *latent], ``noisy`` [n, T', *latent], ``sigma`` [n, T']; ``mask`` None (every noise
        level is trained)."""
        env = self.env
        device = env.accelerator.device
        cond = {k: batch.tensors[k].to(device) for k in env.family.cond_keys}
        clean = batch.tensors["clean"].to(device).float()  # [n, *latent]
        out = {"velocity": [], "old_velocity": [], "noisy": [], "sigma": []}
        if self.kl_coef > 0:
            out["ref_velocity"] = []
        for j in range(*columns.indices(batch.tensors["sigma"].shape[1])):
            noisy, sigma, timestep = self.noisy_input(batch, j, clean)
            with torch.no_grad(), self.old.swapped():
                out["old_velocity"].append(guided_velocity(env.family, env.accelerator.unwrap_model(model), noisy,
                                                           timestep, cond, 1.0))
            out["velocity"].append(guided_velocity(env.family, model, noisy, timestep, cond, 1.0))
            if "ref_velocity" in out:
                with torch.no_grad(), env.models.reference() as ref:
                    out["ref_velocity"].append(guided_velocity(env.family, ref, noisy, timestep, cond, 1.0))
            out["noisy"].append(noisy)
            out["sigma"].append(sigma)
        return {**{k: torch.stack(v, dim=1) for k, v in out.items()}, "clean": clean, "mask": None}
