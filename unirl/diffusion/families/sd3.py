"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): MMDiT over ``[C, h, w]`` latents.

Prompts go through the pipeline's two CLIP encoders and T5 (``encode_prompt``): ``prompt_embeds``
``[n, 77 + L, 4096]`` (CLIP tokens, then T5 tokens) and ``pooled`` ``[n, 2048]``. The scheduler's
fixed ``shift`` (3.0) gives the sigmas; the transformer is conditioned on ``timestep = sigma * 1000``.
"""

from __future__ import annotations

import torch

from unirl.diffusion.families.base import ModelFamily, cast, check_resolution, compute_dtype, tokenize, vae_decode
from unirl.diffusion.sampling import sigma_schedule


class SD3Family(ModelFamily):
    name = "sd3"
    title = "Stable Diffusion 3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    cond_keys = ("prompt_embeds", "pooled")
    guidance_mode = "cfg"

    def latent_shape(self, pipe, resolution: int) -> tuple[int, ...]:
        check_resolution(resolution, pipe.vae_scale_factor * pipe.transformer.config.patch_size)
        size = resolution // pipe.vae_scale_factor
        return (pipe.transformer.config.in_channels, size, size)

    def schedule(self, scheduler, num_steps: int, latent_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return sigma_schedule(scheduler, num_steps)

    def encode(self, pipe, prompts: list[str], *, max_sequence_length: int, device) -> dict[str, torch.Tensor]:
        """``StableDiffusion3Pipeline.encode_prompt`` for one image per prompt, no CFG and no clip_skip,
        with each tokenizer run once (the pipeline tokenizes every prompt a second time, untruncated,
        only to log what was cut, at every call; ``base.tokenize``). The same embeddings, tested bit for
        bit against the pipeline (``tests/test_diffusion_speed_paths.py``)."""
        embeds, pooled = [], []
        for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
            ids = tokenize(tokenizer, prompts, pipe.tokenizer_max_length, "CLIP")  # [n, 77]
            out = encoder(ids.to(device), output_hidden_states=True)
            pooled.append(out[0])  # [n, P_i]
            embeds.append(out.hidden_states[-2].to(dtype=pipe.text_encoder.dtype, device=device))  # [n, 77, D_i]
        clip = torch.cat(embeds, dim=-1)  # [n, 77, D_1 + D_2]
        if pipe.text_encoder_3 is None:
            t5 = torch.zeros(len(prompts), max_sequence_length, pipe.transformer.config.joint_attention_dim,
                             device=device, dtype=pipe.text_encoder.dtype)  # [n, L, 4096]
        else:
            ids = tokenize(pipe.tokenizer_3, prompts, max_sequence_length, "T5 (sampling.max_sequence_length)",
                           add_special_tokens=True)  # [n, L]
            t5 = pipe.text_encoder_3(ids.to(device))[0].to(dtype=pipe.text_encoder_3.dtype, device=device)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))  # [n, 77, 4096]
        return {"prompt_embeds": torch.cat([clip, t5], dim=-2), "pooled": torch.cat(pooled, dim=-1)}  # [n, 77 + L, 4096], [n, P]

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 cond: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = compute_dtype(transformer)
        return transformer(hidden_states=cast(latents, dtype), timestep=timestep,
                           encoder_hidden_states=cast(cond["prompt_embeds"], dtype),
                           pooled_projections=cast(cond["pooled"], dtype), return_dict=False)[0]  # [n, C, h, w]

    @torch.no_grad()
    def decode(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(pipe.vae, latents)
