"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): MMDiT over ``[C, h, w]`` latents.

Prompts go through the pipeline's two CLIP encoders and T5 (``encode_prompt``): ``prompt_embeds``
``[n, 77 + L, 4096]`` (CLIP tokens, then T5 tokens) and ``pooled`` ``[n, 2048]``. The scheduler's
fixed ``shift`` (3.0) gives the sigmas; the transformer is conditioned on ``timestep = sigma * 1000``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from unirl.diffusion.families.base import ModelFamily, check_resolution, vae_decode
from unirl.diffusion.sampling import sigma_schedule


class SD3Family(ModelFamily):
    name = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    cond_keys = ("prompt_embeds", "pooled")
    supports_cfg = True

    def build_tiny(self, variant: str) -> Path:
        from unirl.diffusion.tiny import build_tiny_sd3

        return build_tiny_sd3(variant=variant)

    def latent_shape(self, pipe, resolution: int) -> tuple[int, ...]:
        check_resolution(resolution, pipe.vae_scale_factor * pipe.transformer.config.patch_size)
        size = resolution // pipe.vae_scale_factor
        return (pipe.transformer.config.in_channels, size, size)

    def schedule(self, scheduler, num_steps: int, latent_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return sigma_schedule(scheduler, num_steps)

    def encode(self, pipe, prompts: list[str], *, max_sequence_length: int, device) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device,
            do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled": pooled}  # [n, L, D], [n, P]

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 cond: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = next(p.dtype for p in transformer.parameters())
        return transformer(hidden_states=latents.to(dtype), timestep=timestep,
                           encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                           pooled_projections=cond["pooled"].to(dtype), return_dict=False)[0]  # [n, C, h, w]

    @torch.no_grad()
    def decode(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(pipe.vae, latents)
