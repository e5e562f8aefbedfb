"""DiffusionNFT in the shared loop (``algorithm: nft``): the environment's stages for it.

DiffusionNFT (Zheng et al., 2025, https://arxiv.org/abs/2509.16117; code github.com/NVlabs/DiffusionNFT,
``scripts/train_nft_sd3.py``) trains on the forward process instead of the sampler's steps:

1. rollout: the *old* policy samples each prompt G times with a deterministic solver (the ODE; no
   per-step log-probs, no CFG), and only the clean latents are kept, with, per sample, T noise levels
   drawn from the sampling schedule (a random permutation's first ``int(S * timestep_fraction)``) and
   their fresh Gaussian noise;
2. score and advantages: the loop's, as for FlowGRPO (group-relative advantages);
3. update: at each kept noise level the clean latent is noised afresh, ``x_t = (1 - t) x0 + t eps``, and
   the current and old policies' velocities at ``x_t`` (``score_actions``) enter the registered ``nft``
   policy loss (``unirl.core.policy_losses``: ``unirl.core.nft.nft_loss`` plus ``nft.kl_coef`` times the
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

from unirl.diffusion.ema import ParamEMA
from unirl.diffusion.env import DiffusionEnvironment
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


class NFTEnvironment(DiffusionEnvironment):
    """``DiffusionEnvironment`` with DiffusionNFT's rollout and loss (module docstring); setup, prompts,
    rewards, the EMA, evaluation and saving are FlowGRPO's."""

    policy_loss = "nft"  # score_actions returns the velocities the registered ``nft`` loss reads

    def setup(self, accelerator) -> None:
        super().setup(accelerator)
        n = self.cfg.nft
        if n.kl_coef > 0 and not self.cfg.model.lora.enabled and self.ref is None:
            self.ref = copy.deepcopy(self._model).requires_grad_(False).eval()  # the untrained weights
        self.old = OldPolicy([p for p in self._model.parameters() if p.requires_grad], n.old_decay_flat,
                             n.old_decay_rate, n.old_decay_max)

    @property
    def train_guidance(self) -> float:
        return 1.0  # CFG-free: rollouts and training forwards are unguided

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        super().after_optimizer_step(optimizer_steps)  # the evaluation EMA
        self.old.saw(optimizer_steps)

    def checkpoint_objects(self) -> list:
        return [*super().checkpoint_objects(), self.old]

    # ---------------------------------------------------------------- rollout
    @torch.no_grad()
    def rollout(self, rows: list[dict], group_size: int) -> Rollout:
        cfg, s = self.cfg, self.cfg.sampling
        device = self.accelerator.device
        B, G = len(rows), group_size
        N = B * G
        seed = cfg.trainer.seed * 1_000_003 + self.accelerator.process_index * 10_007 + self._step
        generator = torch.Generator().manual_seed(seed)
        # 1. Prompts (and input images): encoded once per row, repeated for the group.
        prompts = [row["prompt"] for row in rows for _ in range(G)]  # [N]
        encoded = {k: v.repeat_interleave(G, 0) for k, v in self._encode(rows).items()}  # each [N, ...]
        noise = self.family.noise(B if s.same_noise_per_group else N, self.latent_shape, generator)
        if s.same_noise_per_group:
            noise = noise.repeat_interleave(G, 0)  # [N, *latent]
        # 2. The old policy takes the last training step's weights (its decay), then samples with the ODE,
        #    chunk by chunk; finished chunks are scored while the next samples (as FlowGRPO's rollout).
        self.old.catch_up()
        self.forwards.take()  # count this rollout's transformer rows only
        sigmas, timesteps = self.train_sigmas.to(device), self.train_timesteps.to(device)
        ode = torch.zeros(s.num_steps, dtype=torch.bool)  # no stochastic step
        columns = {k: [row.get(k) for row in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        finals, images, futures = [], [], []
        with self.old.swapped():
            for lo in range(0, N, s.chunk_size):
                hi = min(lo + s.chunk_size, N)
                cond = {k: v[lo:hi] for k, v in encoded.items()}
                out = sample_with_logprob(self.family, self._model, noise[lo:hi].to(device), sigmas, timesteps, cond,
                                          guidance_scale=1.0, noise_level=0.0, stochastic=ode)
                images += self._decode_and_queue(out.final, prompts, columns, lo, hi, last=hi == N, futures=futures)
                finals.append(out.final.cpu())
        self._rollout_figures = {"rollout/transformer_calls": float(self.forwards.take())}
        # 3. The training inputs: T noise levels per sample from the sampling schedule (NVlabs: a random
        #    permutation of its S timesteps, the first int(S * timestep_fraction)) and their fresh noise.
        S = s.num_steps
        T = max(1, int(S * s.timestep_fraction))
        picked = torch.rand(N, S, generator=generator).argsort(dim=1)[:, :T]  # [N, T] step indices
        train_noise = self.family.noise(N * T, self.latent_shape, generator).view(N, T, *self.latent_shape)
        tensors = {
            "clean": torch.cat(finals),  # [N, *latent]: the only thing kept of the sampling
            "noise": train_noise,  # [N, T, *latent]
            "sigma": self.train_sigmas.cpu()[picked].float(),  # [N, T]
            "timestep": self.train_timesteps.cpu()[picked],  # [N, T]
            **{k: v.cpu() for k, v in encoded.items()},  # the family's conditioning, each [N, ...]
        }
        rollout = Rollout(tensors=tensors, group_ids=torch.arange(B).repeat_interleave(G), prompts=prompts,
                          samples=images, columns=columns)
        self._pending = (id(rollout), futures)
        return rollout

    # ------------------------------------------------------------ the forward
    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """What the ``nft`` policy loss (``unirl.core.policy_losses``) reads at the noise levels ``columns``:
        ``velocity`` [n, T', *latent] (gradients flow into ``model``), the old policy's ``old_velocity``
        (and the reference's ``ref_velocity`` with ``nft.kl_coef``) at the same noised inputs, detached;
        ``clean`` [n, *latent], ``noisy`` [n, T', *latent], ``sigma`` [n, T']; ``mask`` None (every noise
        level is trained)."""
        device = self.accelerator.device
        cond = {k: batch.tensors[k].to(device) for k in self.family.cond_keys}
        clean = batch.tensors["clean"].to(device).float()  # [n, *latent]
        out = {"velocity": [], "old_velocity": [], "noisy": [], "sigma": []}
        if self.cfg.nft.kl_coef > 0:
            out["ref_velocity"] = []
        for j in range(*columns.indices(batch.tensors["sigma"].shape[1])):
            sigma = batch.tensors["sigma"][:, j].to(device)  # [n]
            t = sigma.view(-1, *([1] * (clean.ndim - 1)))
            noisy = (1 - t) * clean + t * batch.tensors["noise"][:, j].to(device).float()  # [n, *latent]
            timestep = batch.tensors["timestep"][:, j].to(device)  # [n]
            with torch.no_grad(), self.old.swapped():
                out["old_velocity"].append(guided_velocity(self.family, self.accelerator.unwrap_model(model), noisy,
                                                           timestep, cond, 1.0))
            out["velocity"].append(guided_velocity(self.family, model, noisy, timestep, cond, 1.0))
            if "ref_velocity" in out:
                with torch.no_grad(), self.reference_model() as ref:
                    out["ref_velocity"].append(guided_velocity(self.family, ref, noisy, timestep, cond, 1.0))
            out["noisy"].append(noisy)
            out["sigma"].append(sigma)
        return {**{k: torch.stack(v, dim=1) for k, v in out.items()}, "clean": clean, "mask": None}

    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        return torch.ones_like(batch.tensors["sigma"], dtype=torch.bool)  # [n, T]: every noise level is trained

    def column_slices(self, batch: Rollout) -> list[slice]:
        # One noise level at a time, backward after each (NVlabs' order): one forward's graph alive at a time.
        return [slice(j, j + 1) for j in range(batch.tensors["sigma"].shape[1])]

    def kl(self, current: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError("algorithm=nft puts its KL (nft.kl_coef) in its own loss; algo.kl_coef must be 0")
