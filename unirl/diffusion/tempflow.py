"""TempFlow-GRPO's rollout mode (``algorithm: tempflow``): per-step credit by branching; its loss is ``tempflow``.

TempFlow-GRPO (He et al., 2025, https://arxiv.org/abs/2508.04324; code ``Shredded-Pork/TempFlow-GRPO``
``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_perstep.py``, commit e66824e; Tencent UniRL
``unirl/algorithms/tempflowgrpo.py``, commit 5e3dfd8) gives each denoising step its own credit: the
prompt's trajectory is deterministic (the ODE) but for one step k, where its G members branch with
one SDE step each and then finish with the ODE. Their rewards differ only through that step, so the
group's advantages credit step k alone, and only step k is trained (T = 1). The loss weights each step
by its noise (``tempflow``: ``weight_scale`` times the step's std).

Here each prompt of a rollout branches at its own step, drawn uniformly from ``mode_args.branch_range``
(by default every step but the last, as the code's ``timesteps[:-1]``), so one batch credits several
steps; a prompt's ODE prefix runs once (the prompts still on it together), then its G branches. The code
branches every prompt at every step (S images a prompt and step) and Tencent UniRL at a set of steps
per rollout: both train more rows per prompt than the B*G here, which keeps the loop's batch shape.
A prompt's branches share its initial noise whatever ``sampling.same_noise_per_group`` says (they
share the trajectory up to k); the stored steps, their log-probs and the re-scoring are FlowGRPO's
(``flowgrpo.py``), so the first update's ratio is exactly 1.

Shapes: B prompts, G group size, N = B*G, T = 1 trained step a sample, latents ``[*latent]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from unirl.diffusion.flowgrpo import FlowGRPORollout
from unirl.diffusion.rollout_mode import register_rollout_mode
from unirl.diffusion.sampling import sample_with_logprob
from unirl.diffusion.window import window_mask
from unirl.env import Rollout


@dataclass(frozen=True)
class TempflowModeArgs:
    """TempFlow-GRPO's branching (``mode_args`` with ``algorithm: tempflow``)."""

    #: ``[lo, hi)``: the steps a prompt may branch at; null: every step but the last (the code's
    #: ``timesteps[:-1]``, whose last step's std is nearly 0).
    branch_range: Optional[tuple[int, int]] = None


@register_rollout_mode("tempflow", settings=TempflowModeArgs)
class TempFlowRollout(FlowGRPORollout):
    """TempFlow-GRPO: a deterministic trajectory per prompt whose G members branch at one SDE step, that
    step alone trained (``unirl/diffusion/tempflow.py``)."""

    policy_loss = "tempflow"

    @classmethod
    def check_config(cls, cfg) -> None:
        s = cfg.sampling
        if s.sde_window.size or s.ode_solver != "euler" or s.tail_step_ratio != 1:
            raise ValueError("algorithm=tempflow picks each prompt's one SDE step itself (mode_args.branch_range): set "
                             "sampling.sde_window.size: 0, sampling.ode_solver: euler, sampling.tail_step_ratio: 1")
        lo, hi = cls.branch_bounds(cfg.mode_args.get("branch_range"), s.num_steps)
        if not 0 <= lo < hi <= s.num_steps:
            raise ValueError(f"mode_args.branch_range: [{lo}, {hi}) must be a non-empty range of the "
                             f"{s.num_steps} steps (sampling.num_steps)")

    @staticmethod
    def branch_bounds(branch_range, num_steps: int) -> tuple[int, int]:
        return tuple(branch_range) if branch_range is not None else (0, max(1, num_steps - 1))

    def rollout(self, rows: list[dict], group_size: int) -> tuple[Rollout, list, dict[str, float]]:
        env = self.env
        cfg, s = env.cfg, env.cfg.sampling
        device = env.accelerator.device
        B, G = len(rows), group_size
        N = B * G
        seed = cfg.trainer.seed * 1_000_003 + env.accelerator.process_index * 10_007 + env.step
        generator = torch.Generator().manual_seed(seed)
        # 1. One initial noise and one branch step per prompt; the prompts in the order of their steps.
        encoded = env.encode(rows)  # each [B, ...]
        latents = env.family.noise(B, env.latent_shape, generator).to(device)  # [B, *latent] at step 0
        lo, hi = self.branch_bounds(self.args.branch_range, s.num_steps)
        branch = lo + torch.randint(hi - lo, (B,), generator=generator)  # [B]
        order = sorted(range(B), key=lambda b: int(branch[b]))
        prompts = [rows[b]["prompt"] for b in order for _ in range(G)]  # [N]
        columns = {k: [rows[b].get(k) for b in order for _ in range(G)] for k in rows[0] if k != "prompt"}
        sigmas, timesteps = env.train_sigmas.to(device), env.train_timesteps.to(device)
        # 2. Step by step in the branch steps' order: the prompts still on their ODE trajectory advance to
        #    step k together, then the prompts branching at k run their G members (one SDE step at k, then
        #    the ODE), chunk by chunk, each chunk's images scored while the next samples.
        outs, images, futures, at, done = [], [], [], 0, 0
        for k in sorted(set(branch.tolist())):
            if k > at:
                waiting = (branch >= k).nonzero().squeeze(1)  # [b'] prompts not branched yet
                latents[waiting] = self._ode(latents[waiting], {n: v[waiting] for n, v in encoded.items()}, at, k)
                at = k
            members = torch.tensor([b for b in order if branch[b] == k])
            rows_latent = latents[members].repeat_interleave(G, 0)  # [m*G, *latent]
            rows_cond = {n: v[members].repeat_interleave(G, 0) for n, v in encoded.items()}
            stochastic = window_mask(s.num_steps, k, k + 1)
            record = torch.full((len(members) * G, 1), k, dtype=torch.long)
            for lo_row in range(0, len(rows_latent), s.chunk_size):
                hi_row = min(lo_row + s.chunk_size, len(rows_latent))
                cond = env.cond({n: v[lo_row:hi_row] for n, v in rows_cond.items()}, env.train_guidance)
                out = sample_with_logprob(env.family, env.model, rows_latent[lo_row:hi_row], sigmas, timesteps, cond,
                                          guidance_scale=env.train_guidance, noise_level=s.noise_level,
                                          stochastic=stochastic, record=record[lo_row:hi_row], sde_type=s.sde_type,
                                          generator=generator, coefficients=self.coefficients, start=k,
                                          keep_means=self.keep_old_means)
                images += env.sampler.decode_and_queue(out.final, prompts, columns, done + lo_row, done + hi_row,
                                                last=done + hi_row == N, futures=futures)
                outs.append(out)
            done += len(rows_latent)
        # 3. What training re-scores: each sample's branch step.
        steps = branch[order].repeat_interleave(G).unsqueeze(1)  # [N, 1]
        sig = sigmas.cpu()
        tensors = {
            "latents": torch.cat([o.latents for o in outs]).cpu(),  # [N, 1, *latent]
            "next_latents": torch.cat([o.next_latents for o in outs]).cpu(),  # [N, 1, *latent]
            "step_index": steps,  # [N, 1]
            "sigma": sig[steps],  # [N, 1]
            "sigma_next": sig[steps + 1],  # [N, 1]
            "timestep": timesteps.cpu()[steps],  # [N, 1]
            **{n: v[order].repeat_interleave(G, 0).cpu() for n, v in encoded.items()},  # each [N, ...]
        }
        if self.keep_old_means:
            tensors["old_mean"] = torch.cat([o.means for o in outs]).cpu()  # [N, 1, *latent]
        rollout = Rollout(tensors=tensors, group_ids=torch.arange(B).repeat_interleave(G), prompts=prompts,
                          samples=images, columns=columns, old_logp=torch.cat([o.logp for o in outs]).cpu())  # [N, 1]
        return rollout, futures, {"rollout/branch_step_mean": float(branch.float().mean())}

    def _ode(self, latents: torch.Tensor, encoded: dict[str, torch.Tensor], start: int, stop: int) -> torch.Tensor:
        """``latents`` [b, *latent] at step ``start`` taken to step ``stop`` with the ODE, in chunks."""
        env, s = self.env, self.env.cfg.sampling
        sigmas, timesteps = env.train_sigmas.to(latents.device), env.train_timesteps.to(latents.device)
        parts = []
        for lo in range(0, latents.shape[0], s.chunk_size):
            hi = min(lo + s.chunk_size, latents.shape[0])
            cond = env.cond({n: v[lo:hi] for n, v in encoded.items()}, env.train_guidance)
            out = sample_with_logprob(env.family, env.model, latents[lo:hi], sigmas, timesteps, cond,
                                      guidance_scale=env.train_guidance, noise_level=s.noise_level,
                                      stochastic=torch.zeros(s.num_steps, dtype=torch.bool), sde_type=s.sde_type,
                                      coefficients=self.coefficients, start=start, stop=stop)
            parts.append(out.final)
        return torch.cat(parts)
