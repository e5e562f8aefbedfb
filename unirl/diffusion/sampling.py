"""Sampling a flow-matching text-to-image model with per-step log-probabilities, and re-scoring steps.

FlowGRPO (https://arxiv.org/abs/2505.05470) samples with an SDE whose steps are Gaussians
(``unirl.diffusion.sde``), keeps the latents before and after each trained step with the step's
log-prob, and in training re-evaluates exactly those steps (the stored next latent is the action).
This module drives diffusers' components itself instead of forking ``StableDiffusion3Pipeline.__call__``:
the pipeline encodes prompts (``encode_prompt``), the scheduler provides the shifted sigmas
(``set_timesteps``), the transformer predicts velocities and the VAE decodes.

The same function, ``predict_velocity``, runs the transformer at sampling and at training time, so
a re-scored step reproduces the sampled log-prob bit for bit when the model has not changed (the
on-policy check in ``tests/test_diffusion_env.py``).

Shapes: N = B*G samples, S sampling steps, T trained steps per sample, latents ``[C, h, w]``,
L text tokens of width D, P pooled width.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from unirl.diffusion.sde import sde_step_with_logprob


@dataclass
class SampleOutput:
    """What a rollout keeps. ``latents``/``next_latents`` are the trained steps' inputs and outputs."""

    final: torch.Tensor  # [N, C, h, w] the last latent (to decode)
    latents: torch.Tensor  # [N, T, C, h, w]
    next_latents: torch.Tensor  # [N, T, C, h, w]
    logp: torch.Tensor  # [N, T]


# ----------------------------------------------------------------------------- schedule
def sigma_schedule(scheduler, num_steps: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheduler's shifted sigmas ``[S + 1]`` (ending in 0) and model timesteps ``[S]`` for S steps.

    ``FlowMatchEulerDiscreteScheduler.set_timesteps`` applies the checkpoint's ``shift`` (3.0 for SD3);
    the transformer is conditioned on ``timestep = sigma * num_train_timesteps``.
    """
    scheduler.set_timesteps(num_steps, device=device)
    sigmas = scheduler.sigmas.detach().clone().float()  # [S + 1]
    timesteps = scheduler.timesteps.detach().clone().float()  # [S]
    if sigmas.shape[0] != num_steps + 1 or timesteps.shape[0] != num_steps:
        raise ValueError(f"scheduler gave {sigmas.shape[0]} sigmas for {num_steps} steps (expected {num_steps + 1})")
    return sigmas, timesteps


def stochastic_steps(num_steps: int, window_size: int = 0, window_range: tuple[int, int] | None = None,
                     rng: random.Random | None = None) -> torch.Tensor:
    """``[S]`` bool: which steps are SDE steps (the rest are deterministic ODE steps).

    ``window_size=0``: all steps (FlowGRPO). Otherwise Flow-GRPO-Fast's window: ``window_size``
    consecutive steps starting uniformly in ``[lo, hi - window_size]``, shared by the whole batch.
    """
    mask = torch.zeros(num_steps, dtype=torch.bool)
    if window_size == 0:
        return mask.fill_(True)
    lo, hi = window_range if window_range is not None else (0, num_steps)
    if not 0 <= lo <= hi - window_size and hi <= num_steps:
        raise ValueError(f"a window of {window_size} steps does not fit in [{lo}, {hi}) of {num_steps} steps")
    start = (rng or random).randint(lo, hi - window_size)
    mask[start:start + window_size] = True
    return mask


def trained_steps(n: int, stochastic: torch.Tensor, fraction: float, generator: torch.Generator,
                  selection: str = "first") -> torch.Tensor:
    """``[N, T]`` sorted step indices trained per sample, ``T = max(1, int(K * fraction))`` of the K
    stochastic steps (FlowGRPO's ``timestep_fraction``; all K when it is 1).

    ``selection="first"``: the first T stochastic steps in sampling order, for every sample, as
    FlowGRPO's ``train_sd3.py`` trains them. ``"random"``: a random subset of T per sample."""
    if selection not in ("first", "random"):
        raise ValueError(f"selection must be 'first' or 'random', got {selection!r}")
    candidates = stochastic.nonzero().squeeze(-1)  # [K]
    k = len(candidates)
    t = max(1, int(k * fraction))
    if t == k or selection == "first":
        return candidates[:t].expand(n, t).clone()
    order = torch.stack([torch.randperm(k, generator=generator)[:t] for _ in range(n)])  # [N, T]
    return candidates[order].sort(dim=-1).values


# ------------------------------------------------------------------------------ prompts
@torch.no_grad()
def encode_prompts(pipe, prompts: list[str], *, max_sequence_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_embeds [n, L, D], pooled [n, P])`` from the pipeline's three text encoders."""
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, device=device,
        do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
    )
    return embeds, pooled


# ---------------------------------------------------------------------------- velocity
def predict_velocity(transformer, latents: torch.Tensor, timestep: torch.Tensor, cond: dict[str, torch.Tensor],
                     guidance_scale: float) -> torch.Tensor:
    """The (guided) velocity ``[n, C, h, w]`` at ``latents`` and per-sample ``timestep`` [n].

    ``cond`` holds ``prompt_embeds`` [n, L, D] and ``pooled`` [n, P], plus ``neg_prompt_embeds`` and
    ``neg_pooled`` (same shapes) when ``guidance_scale > 1``: classifier-free guidance
    ``v_u + g (v_c - v_u)`` (https://arxiv.org/abs/2207.12598) with one batched forward, negative first,
    as the SD3 pipeline does.
    """
    dtype = next(p.dtype for p in transformer.parameters())
    if guidance_scale > 1:
        x = torch.cat([latents, latents]).to(dtype)  # [2n, C, h, w]
        t = torch.cat([timestep, timestep])  # [2n]
        embeds = torch.cat([cond["neg_prompt_embeds"], cond["prompt_embeds"]])  # [2n, L, D]
        pooled = torch.cat([cond["neg_pooled"], cond["pooled"]])  # [2n, P]
    else:
        x, t, embeds, pooled = latents.to(dtype), timestep, cond["prompt_embeds"], cond["pooled"]
    v = transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds.to(dtype),
                    pooled_projections=pooled.to(dtype), return_dict=False)[0]
    if guidance_scale > 1:
        v_uncond, v_cond = v.chunk(2)
        v = v_uncond + guidance_scale * (v_cond - v_uncond)
    return v  # [n, C, h, w]


# ----------------------------------------------------------------------------- sampling
@torch.no_grad()
def sample_with_logprob(
    transformer,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    timesteps: torch.Tensor,
    cond: dict[str, torch.Tensor],
    *,
    guidance_scale: float,
    noise_level: float,
    stochastic: torch.Tensor,
    record: torch.Tensor | None = None,
    sde_type: str = "flow",
    generator: torch.Generator | None = None,
) -> SampleOutput:
    """Run the S denoising steps from ``noise`` [N, C, h, w], keeping the recorded steps.

    Args:
        sigmas: ``[S + 1]`` and ``timesteps`` ``[S]`` from ``sigma_schedule``.
        stochastic: ``[S]`` bool, the SDE steps (``noise_level``); the others take the ODE step
            (``noise_level=0``, the scheduler's Euler step). All False: deterministic sampling.
        record: ``[N, T]`` step indices whose input latent, next latent and log-prob are kept
            (each must be a stochastic step); None keeps nothing (T = 0).
        generator: CPU generator for the SDE noise.
    """
    n = noise.shape[0]
    record = torch.zeros(n, 0, dtype=torch.long) if record is None else record.cpu()
    if record.numel() and not bool(stochastic[record].all()):
        raise ValueError("only stochastic steps can be recorded (an ODE step has no density)")
    latents = noise.float()  # [N, C, h, w]
    kept_in = torch.zeros(n, record.shape[1], *latents.shape[1:], device=latents.device)  # [N, T, C, h, w]
    kept_out = torch.zeros_like(kept_in)
    kept_logp = torch.zeros(n, record.shape[1], device=latents.device)  # [N, T]
    for i in range(len(timesteps)):
        v = predict_velocity(transformer, latents, timesteps[i].expand(n), cond, guidance_scale)
        nxt, logp, _, _ = sde_step_with_logprob(
            v, latents, sigmas[i], sigmas[i + 1], noise_level=noise_level if stochastic[i] else 0.0,
            generator=generator, sde_type=sde_type,
        )
        rows, cols = (record == i).nonzero(as_tuple=True)  # samples recording step i, and where
        if len(rows):
            rows, cols = rows.to(latents.device), cols.to(latents.device)
            kept_in[rows, cols] = latents[rows]
            kept_out[rows, cols] = nxt[rows]
            kept_logp[rows, cols] = logp[rows]
        latents = nxt
    return SampleOutput(final=latents, latents=kept_in, next_latents=kept_out, logp=kept_logp)


def rescore_steps(
    transformer,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    timestep: torch.Tensor,
    cond: dict[str, torch.Tensor],
    *,
    guidance_scale: float,
    noise_level: float,
    sde_type: str = "flow",
) -> dict[str, torch.Tensor]:
    """Log-probs of stored steps under ``transformer`` (with gradients), the stored next latent as the action.

    Args:
        latents, next_latents: ``[n, T, C, h, w]``; ``sigma``, ``sigma_next``, ``timestep``: ``[n, T]``.

    Returns:
        ``logp`` [n, T], ``mean`` [n, T, C, h, w] and ``std`` [n, T] of each step's Gaussian.
    """
    logps, means, stds = [], [], []
    for j in range(latents.shape[1]):
        v = predict_velocity(transformer, latents[:, j], timestep[:, j], cond, guidance_scale)
        _, logp, mean, std = sde_step_with_logprob(
            v, latents[:, j], sigma[:, j], sigma_next[:, j], noise_level=noise_level,
            prev_sample=next_latents[:, j], sde_type=sde_type,
        )
        logps.append(logp)  # [n]
        means.append(mean)  # [n, C, h, w]
        stds.append(std.flatten())  # [n]
    return {"logp": torch.stack(logps, 1), "mean": torch.stack(means, 1), "std": torch.stack(stds, 1)}


# ------------------------------------------------------------------------------ decoding
@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` in [0, 1] (float32, CPU) from SD3 latents ``[N, C, h, w]``."""
    scaled = latents / vae.config.scaling_factor + vae.config.shift_factor
    images = vae.decode(scaled.to(next(vae.parameters()).dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1).cpu()


def to_pil(images: torch.Tensor) -> list:
    """PIL RGB images from ``[N, 3, H, W]`` in [0, 1]."""
    from PIL import Image

    arrays = (images.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()  # [N, H, W, 3]
    return [Image.fromarray(a) for a in arrays]
