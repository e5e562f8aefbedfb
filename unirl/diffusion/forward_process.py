"""The data path of the forward-process methods (DiffusionNFT, AWM, DGPO): their rollout mode's shared part.

These methods never score the sampler's steps. A rollout samples each prompt G times with the
deterministic ODE (no per-step log-probs, no CFG) and keeps only the clean latents ``x0``, with, per
sample, T noise levels from the sampling schedule and their Gaussian noise ``eps``; the update noises
each clean latent afresh, ``x_t = (1 - t) x0 + t eps`` (the flow-matching interpolation, t the sigma),
and runs the transformer there (``noisy_input``). What a method adds is which weights sample
(``sampling_weights``: NFT's and DGPO's old policy), how the noise levels and the noise are drawn
(``training_inputs``: DGPO shares them within a group) and what its forward returns for its loss.

Everything is drawn at rollout time from the rollout's seed (NVlabs draws its training noise in the
update), so a resumed run and 1 or 2 processes see the same inputs and ``trainer.ppo_epochs > 1`` reuses
them. The rollout solver is the Euler ODE step (NVlabs' SD3 configs use DPM-Solver 2).

Shapes: B prompts, G group size, N = B*G, S sampling steps, T trained noise levels per sample,
latents ``[*latent]`` in the family's layout.
"""

from __future__ import annotations

import contextlib

import torch

from unirl.diffusion.rollout_mode import RolloutMode
from unirl.diffusion.sampling import sample_with_logprob
from unirl.env import Rollout


class ForwardProcessRollout(RolloutMode):
    """ODE rollouts keeping clean latents and noise levels (module docstring); subclasses give the forward."""

    @classmethod
    def check_config(cls, cfg) -> None:
        """No SDE steps, no log-probs of steps and no CFG in training: settings for those are refused."""
        name = cfg.algorithm
        if cfg.sampling.train_cfg:
            raise ValueError(f"algorithm={name} trains CFG-free (its rollouts and training forward are unguided): "
                             "set sampling.train_cfg: false")
        if cfg.sampling.sde_window.size:
            raise ValueError(f"algorithm={name} samples with the ODE (no SDE steps): set sampling.sde_window.size: 0")
        if cfg.algo.kl_coef > 0 or cfg.algo.use_kl_in_reward:
            raise ValueError(f"algorithm={name} has no step KL: its KL to the reference, where its loss has one, is "
                             f"algo.loss_args.kl_coef; set algo.kl_coef: 0 and algo.use_kl_in_reward: false")

    def sampling_weights(self):
        """The context in which the rollout samples: the current weights unless the method has an old policy."""
        return contextlib.nullcontext()

    def training_inputs(self, N: int, B: int, G: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(steps [N, T], noise [N, T, *latent])``: the schedule steps whose sigmas are the noise levels and
        their noise. NVlabs' draw: per sample a random permutation of the S steps, the first
        ``T = int(S * timestep_fraction)``, and fresh noise for each."""
        env, s = self.env, self.env.cfg.sampling
        S = s.num_steps
        T = max(1, int(S * s.timestep_fraction))
        picked = torch.rand(N, S, generator=generator).argsort(dim=1)[:, :T]  # [N, T] step indices
        noise = env.family.noise(N * T, env.latent_shape, generator).view(N, T, *env.latent_shape)
        return picked, noise

    def rollout(self, rows: list[dict], group_size: int) -> tuple[Rollout, list, dict[str, float]]:
        env = self.env
        cfg, s = env.cfg, env.cfg.sampling
        device = env.accelerator.device
        B, G = len(rows), group_size
        N = B * G
        seed = cfg.trainer.seed * 1_000_003 + env.accelerator.process_index * 10_007 + env.step
        generator = torch.Generator().manual_seed(seed)
        # 1. Prompts (and input images): encoded once per row, repeated for the group.
        prompts = [row["prompt"] for row in rows for _ in range(G)]  # [N]
        encoded = {k: v.repeat_interleave(G, 0) for k, v in env.encode(rows).items()}  # each [N, ...]
        noise = env.family.noise(B if s.same_noise_per_group else N, env.latent_shape, generator)
        if s.same_noise_per_group:
            noise = noise.repeat_interleave(G, 0)  # [N, *latent]
        # 2. The sampling weights (NFT: the old policy, after taking the last training step's weights)
        #    sample with the ODE, chunk by chunk; finished chunks are scored while the next samples.
        sigmas, timesteps = env.train_sigmas.to(device), env.train_timesteps.to(device)
        ode = torch.zeros(s.num_steps, dtype=torch.bool)  # no stochastic step
        columns = {k: [row.get(k) for row in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        finals, images, futures = [], [], []
        with self.sampling_weights():
            for lo in range(0, N, s.chunk_size):
                hi = min(lo + s.chunk_size, N)
                cond = {k: v[lo:hi] for k, v in encoded.items()}
                out = sample_with_logprob(env.family, env.model, noise[lo:hi].to(device), sigmas, timesteps, cond,
                                          guidance_scale=1.0, noise_level=0.0, stochastic=ode)
                images += env.sampler.decode_and_queue(out.final, prompts, columns, lo, hi, last=hi == N, futures=futures)
                finals.append(out.final.cpu())
        # 3. The training inputs: T noise levels per sample from the sampling schedule and their noise.
        picked, train_noise = self.training_inputs(N, B, G, generator)
        tensors = {
            "clean": torch.cat(finals),  # [N, *latent]: the only thing kept of the sampling
            "noise": train_noise,  # [N, T, *latent]
            "sigma": env.train_sigmas.cpu()[picked].float(),  # [N, T]
            "timestep": env.train_timesteps.cpu()[picked],  # [N, T]
            **{k: v.cpu() for k, v in encoded.items()},  # the family's conditioning, each [N, ...]
        }
        rollout = Rollout(tensors=tensors, group_ids=torch.arange(B).repeat_interleave(G), prompts=prompts,
                          samples=images, columns=columns)
        return rollout, futures, {}

    # ------------------------------------------------------------ the forward
    def noisy_input(self, batch: Rollout, j: int, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Noise level j of ``batch``: ``(x_t [n, *latent], sigma [n], timestep [n])`` on the device, with
        ``x_t = (1 - t) x0 + t eps`` from ``clean`` [n, *latent] (float32, on the device)."""
        device = self.env.accelerator.device
        sigma = batch.tensors["sigma"][:, j].to(device)  # [n]
        t = sigma.view(-1, *([1] * (clean.ndim - 1)))
        noisy = (1 - t) * clean + t * batch.tensors["noise"][:, j].to(device).float()  # [n, *latent]
        return noisy, sigma, batch.tensors["timestep"][:, j].to(device)

    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        return torch.ones_like(batch.tensors["sigma"], dtype=torch.bool)  # [n, T]: every noise level is trained

    def column_slices(self, batch: Rollout) -> list[slice]:
        # One noise level at a time, backward after each (NVlabs' order): one forward's graph alive at a time.
        return [slice(j, j + 1) for j in range(batch.tensors["sigma"].shape[1])]

    def kl(self, current: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError(f"algorithm={self.env.cfg.algorithm} has no step KL (the config refuses "
                                  f"algo.kl_coef > 0): its KL, if any, is in its loss")
