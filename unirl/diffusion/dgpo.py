"""DGPO's rollout mode (``algorithm: dgpo``): group preference on the forward process; its loss is ``dgpo``.

DGPO, Direct Group Preference Optimization (Luo et al., 2025, https://arxiv.org/abs/2510.08425;
Flow-Factory ``src/flow_factory/trainers/dgpo.py``, commit a0b2bc5), learns from the group's
preference among its samples as DPO learns from a pair, with no per-step likelihood:

1. rollout: ODE samples of each prompt (the current weights; the old policy's after ``switch_old``
   optimizer steps), clean latents kept (``forward_process.py``); the T noise levels are shared by the
   whole batch and the noise by each group, the same at every level (Flow-Factory's
   ``_sample_shared_timesteps`` and ``use_shared_noise``), so the members of a group differ only in
   their clean latents;
2. forward: at each level the policy's velocity, the reference's (LoRA disabled: the DSM baseline) and
   the old policy's (a copy following the weights with decay ``min(old_decay_max, old_decay_rate * k)``,
   Flow-Factory's ``ema_ref``; the DSM clip's anchor);
3. loss: ``dgpo`` (``unirl.core.flow_methods``), which needs every member of a group in one micro-batch:
   the config keeps one mini-batch (no shuffle across groups) and micro-batches of whole groups.

Differences from Flow-Factory: the levels are drawn from the first ``timestep_range`` of the schedule
without replacement at rollout time (Flow-Factory stratifies them over that range in the update); the
reference's velocity is unguided (its ``kl_cfg`` 1, the default); no ``use_ema_ref`` / ``clip_kl`` switches.

Shapes: B prompts, G group size, N = B*G, T noise levels (shared), latents ``[*latent]``.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from unirl.diffusion.ema import OldPolicy
from unirl.diffusion.forward_process import ForwardProcessRollout
from unirl.diffusion.rollout_mode import register_rollout_mode
from unirl.diffusion.sampling import guided_velocity
from unirl.env import Rollout


@dataclass(frozen=True)
class DgpoModeArgs:
    """DGPO's rollout settings (``mode_args`` with ``algorithm: dgpo``); defaults are Flow-Factory's
    ``DGPOTrainingArguments``. The loss's (beta, clip_dsm, kl_coef) are ``algo.loss_args``."""

    #: The noise levels are drawn from the steps of the first ``timestep_range`` of the schedule (the
    #: noisiest: 0.6 is sigma >= 0.4 on a 0..1 schedule; Flow-Factory's ``timestep_range``).
    timestep_range: float = 0.6
    #: After this many optimizer steps the old policy samples instead of the current weights (``switch_ema_ref``).
    switch_old: int = 200
    #: The ceiling of the old policy's decay ``min(old_decay_max, old_decay_rate * k)`` after k optimizer
    #: steps (``ema_ref_max_decay``).
    old_decay_max: float = 0.3
    #: The decay's rise per optimizer step (``ema_ref_ramp_rate``).
    old_decay_rate: float = 0.001

    def __post_init__(self):
        if not 0 < self.timestep_range <= 1:
            raise ValueError(f"timestep_range must lie in (0, 1], got {self.timestep_range!r}")
        if not 0 <= self.old_decay_max < 1 or self.old_decay_rate < 0 or self.switch_old < 0:
            raise ValueError("old_decay_max must lie in [0, 1), old_decay_rate and switch_old must be >= 0")


@register_rollout_mode("dgpo", settings=DgpoModeArgs)
class DGPORollout(ForwardProcessRollout):
    """DGPO: ODE samples with batch-shared noise levels and group-shared noise; the policy's, the reference's
    and the old policy's velocities there for the group-preference loss (``unirl/diffusion/dgpo.py``)."""

    policy_loss = "dgpo"
    offers = frozenset({"velocity", "ref_velocity", "old_velocity", "target", "group"})

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        t, G = cfg.trainer, cfg.trainer.group_size
        if t.mini_batch_size != t.prompts_per_step * G or t.micro_batch_size % G:
            raise ValueError(f"algorithm=dgpo compares each group's members in one micro-batch: set "
                             f"trainer.mini_batch_size to prompts_per_step x group_size ({t.prompts_per_step * G}) "
                             f"and trainer.micro_batch_size to a multiple of group_size ({G})")

    def setup(self) -> None:
        env = self.env
        if not env.cfg.model.lora.enabled and env.ref is None:  # the DSM baseline: the untrained weights
            env.ref = copy.deepcopy(env.model).requires_grad_(False).eval()
        self.old = OldPolicy([p for p in env.model.parameters() if p.requires_grad], flat=0,
                             rate=self.args.old_decay_rate, ceiling=self.args.old_decay_max)

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        self.old.saw(optimizer_steps)

    def checkpoint_objects(self) -> dict:
        return {"old_policy": self.old}

    def sampling_weights(self):
        self.old.catch_up()  # Flow-Factory moves its ema_ref after every optimizer step; one a training step here
        return self.old.swapped() if self.old.seen > self.args.switch_old else contextlib.nullcontext()

    def training_inputs(self, N: int, B: int, G: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """T steps shared by the batch, drawn without replacement from the first ``timestep_range`` of the
        schedule (at least one step), and one noise a group, the same at every level."""
        env, s = self.env, self.env.cfg.sampling
        candidates = max(1, int(s.num_steps * self.args.timestep_range))
        T = min(candidates, max(1, int(s.num_steps * s.timestep_fraction)))
        steps = torch.randperm(candidates, generator=generator)[:T].sort().values  # [T]
        noise = env.family.noise(B, env.latent_shape, generator)  # [B, *latent]
        noise = noise.repeat_interleave(G, 0).unsqueeze(1).expand(N, T, *env.latent_shape).contiguous()
        return steps.expand(N, T).clone(), noise  # [N, T], [N, T, *latent]

    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """What the ``dgpo`` loss reads at the noise levels ``columns``: ``velocity`` [n, T', *latent]
        (gradients flow into ``model``), the reference's ``ref_velocity`` and the old policy's
        ``old_velocity`` (detached), ``target`` ``eps - x0`` [n, T', *latent], ``group`` [n]."""
        env = self.env
        device = env.accelerator.device
        cond = {k: batch.tensors[k].to(device) for k in env.family.cond_keys}
        clean = batch.tensors["clean"].to(device).float()  # [n, *latent]
        out = {"velocity": [], "ref_velocity": [], "old_velocity": [], "target": []}
        for j in range(*columns.indices(batch.tensors["sigma"].shape[1])):
            noisy, _, timestep = self.noisy_input(batch, j, clean)
            with torch.no_grad():
                with self.old.swapped():
                    out["old_velocity"].append(guided_velocity(env.family, env.accelerator.unwrap_model(model), noisy,
                                                               timestep, cond, 1.0))
                with env.models.reference() as ref:
                    out["ref_velocity"].append(guided_velocity(env.family, ref, noisy, timestep, cond, 1.0))
            out["velocity"].append(guided_velocity(env.family, model, noisy, timestep, cond, 1.0))
            out["target"].append(batch.tensors["noise"][:, j].to(device).float() - clean)
        return {**{k: torch.stack(v, dim=1) for k, v in out.items()}, "group": batch.group_ids.to(device), "mask": None}
