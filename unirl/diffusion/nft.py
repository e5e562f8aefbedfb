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

Differences from NVlabs' code: the training noise and noise levels are drawn at rollout time from the
rollout's seed (the code draws them in the update), so a resumed run and 1 or 2 processes see the same
ones and ``trainer.ppo_epochs > 1`` reuses them; the rollout solver is the Euler ODE step (the code's
SD3 configs use DPM-Solver 2, ``solver: dpm2``); the old policy is a copy of the trainable weights
swapped in for its forwards, not a second LoRA adapter (the same numbers; it also serves full fine-tuning).

Shapes: B prompts, G group size, N = B*G, S sampling steps, T trained noise levels per sample,
latents ``[*latent]`` in the family's layout.
"""

from __future__ import annotations

import copy

import torch

from unirl.core.policy_losses import build_loss_args
from unirl.diffusion.ema import ParamEMA
from unirl.diffusion.rollout_mode import RolloutMode, register_rollout_mode
from unirl.diffusion.sampling import guided_velocity, sample_with_logprob
from unirl.env import Rollout


class OldPolicy(ParamEMA):
    """DiffusionNFT's old policy: a copy of the trainable weights that follows them once per training
    step, ``old <- d old + (1 - d) new`` with ``d = 0`` for the first ``flat`` optimizer steps and then
    ``min(rate * (k - flat), ceiling)`` after k optimizer steps (NVlabs' ``return_decay``).

    ``saw(k)`` records each optimizer step; ``catch_up()`` (before a rollout) moves the copy once with the
    decay of the last step seen, if any step came since the last move: what the code does at the end of
    each epoch. Both counters are part of the state, so a resumed run moves it exactly as before."""

    def __init__(self, params: list[torch.nn.Parameter], flat: int, rate: float, ceiling: float):
        super().__init__(params, decay=ceiling, update_every=1)
        self.flat, self.rate = flat, rate
        self.seen = self.moved = 0  # optimizer steps seen, and the count at the last move

    def decay_at(self, optimizer_step: int) -> float:
        if optimizer_step < self.flat:
            return 0.0
        return min((optimizer_step - self.flat) * self.rate, self.decay)

    def saw(self, optimizer_step: int) -> None:
        self.seen = optimizer_step

    def catch_up(self) -> None:
        if self.seen != self.moved:
            self.step(self.seen)
            self.moved = self.seen

    def state_dict(self) -> dict:
        return {**super().state_dict(), "seen": self.seen, "moved": self.moved}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.seen, self.moved = int(state["seen"]), int(state["moved"])


@register_rollout_mode("nft")
class NFTRollout(RolloutMode):
    """DiffusionNFT's rollout (the old policy's ODE samples, clean latents and noise levels kept), the
    velocities its loss reads, and the old policy (module docstring). The environment's EMA, reference,
    rewards, evaluation and saving are shared with FlowGRPO; rollouts and training forwards are CFG-free
    (the config refuses ``sampling.train_cfg``)."""

    policy_loss = "nft"  # score_actions returns the velocities the registered ``nft`` loss reads
    offers = frozenset({"velocity", "old_velocity", "ref_velocity", "clean", "noisy", "sigma"})

    @classmethod
    def check_config(cls, cfg) -> None:
        """DiffusionNFT has no SDE steps, no log-probs and no CFG in training: settings for those are refused."""
        name = cfg.algorithm
        if cfg.sampling.train_cfg:
            raise ValueError(f"algorithm={name} trains CFG-free (its rollouts and training forward are unguided): "
                             "set sampling.train_cfg: false")
        if cfg.sampling.sde_window.size:
            raise ValueError(f"algorithm={name} samples with the ODE (no SDE steps): set sampling.sde_window.size: 0")
        if cfg.algo.kl_coef > 0 or cfg.algo.use_kl_in_reward:
            raise ValueError(f"algorithm={name}: the KL to the reference is algo.loss_args.kl_coef (on velocities); "
                             "set algo.kl_coef: 0 and algo.use_kl_in_reward: false")

    def setup(self) -> None:
        env, n = self.env, self.env.cfg.nft
        self.kl_coef = build_loss_args("nft", env.cfg.algo.loss_args).kl_coef  # with a KL the reference's velocities too
        if self.kl_coef > 0 and not env.cfg.model.lora.enabled and env.ref is None:
            env.ref = copy.deepcopy(env._model).requires_grad_(False).eval()  # the untrained weights
        self.old = OldPolicy([p for p in env._model.parameters() if p.requires_grad], n.old_decay_flat,
                             n.old_decay_rate, n.old_decay_max)

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        self.old.saw(optimizer_steps)  # after the environment's evaluation EMA

    def checkpoint_objects(self) -> list:
        return [self.old]

    # ---------------------------------------------------------------- rollout
    def rollout(self, rows: list[dict], group_size: int) -> tuple[Rollout, list, dict[str, float]]:
        env = self.env
        cfg, s = env.cfg, env.cfg.sampling
        device = env.accelerator.device
        B, G = len(rows), group_size
        N = B * G
        seed = cfg.trainer.seed * 1_000_003 + env.accelerator.process_index * 10_007 + env._step
        generator = torch.Generator().manual_seed(seed)
        # 1. Prompts (and input images): encoded once per row, repeated for the group.
        prompts = [row["prompt"] for row in rows for _ in range(G)]  # [N]
        encoded = {k: v.repeat_interleave(G, 0) for k, v in env._encode(rows).items()}  # each [N, ...]
        noise = env.family.noise(B if s.same_noise_per_group else N, env.latent_shape, generator)
        if s.same_noise_per_group:
            noise = noise.repeat_interleave(G, 0)  # [N, *latent]
        # 2. The old policy takes the last training step's weights (its decay), then samples with the ODE,
        #    chunk by chunk; finished chunks are scored while the next samples (as FlowGRPO's rollout).
        self.old.catch_up()
        sigmas, timesteps = env.train_sigmas.to(device), env.train_timesteps.to(device)
        ode = torch.zeros(s.num_steps, dtype=torch.bool)  # no stochastic step
        columns = {k: [row.get(k) for row in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        finals, images, futures = [], [], []
        with self.old.swapped():
            for lo in range(0, N, s.chunk_size):
                hi = min(lo + s.chunk_size, N)
                cond = {k: v[lo:hi] for k, v in encoded.items()}
                out = sample_with_logprob(env.family, env._model, noise[lo:hi].to(device), sigmas, timesteps, cond,
                                          guidance_scale=1.0, noise_level=0.0, stochastic=ode)
                images += env._decode_and_queue(out.final, prompts, columns, lo, hi, last=hi == N, futures=futures)
                finals.append(out.final.cpu())
        # 3. The training inputs: T noise levels per sample from the sampling schedule (NVlabs: a random
        #    permutation of its S timesteps, the first int(S * timestep_fraction)) and their fresh noise.
        S = s.num_steps
        T = max(1, int(S * s.timestep_fraction))
        picked = torch.rand(N, S, generator=generator).argsort(dim=1)[:, :T]  # [N, T] step indices
        train_noise = env.family.noise(N * T, env.latent_shape, generator).view(N, T, *env.latent_shape)
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
            sigma = batch.tensors["sigma"][:, j].to(device)  # [n]
            t = sigma.view(-1, *([1] * (clean.ndim - 1)))
            noisy = (1 - t) * clean + t * batch.tensors["noise"][:, j].to(device).float()  # [n, *latent]
            timestep = batch.tensors["timestep"][:, j].to(device)  # [n]
            with torch.no_grad(), self.old.swapped():
                out["old_velocity"].append(guided_velocity(env.family, env.accelerator.unwrap_model(model), noisy,
                                                           timestep, cond, 1.0))
            out["velocity"].append(guided_velocity(env.family, model, noisy, timestep, cond, 1.0))
            if "ref_velocity" in out:
                with torch.no_grad(), env.reference_model() as ref:
                    out["ref_velocity"].append(guided_velocity(env.family, ref, noisy, timestep, cond, 1.0))
            out["noisy"].append(noisy)
            out["sigma"].append(sigma)
        return {**{k: torch.stack(v, dim=1) for k, v in out.items()}, "clean": clean, "mask": None}

    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        return torch.ones_like(batch.tensors["sigma"], dtype=torch.bool)  # [n, T]: every noise level is trained

    def column_slices(self, batch: Rollout) -> list[slice]:
        # One noise level at a time, backward after each (NVlabs' order): one forward's graph alive at a time.
        return [slice(j, j + 1) for j in range(batch.tensors["sigma"].shape[1])]

    def kl(self, current: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError("algorithm=nft puts its KL (algo.loss_args.kl_coef) in its own loss; algo.kl_coef must be 0")
