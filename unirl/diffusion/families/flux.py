"""FLUX.1 (``FluxPipeline``): one guidance-distilled transformer over packed 2x2 latent patches.

What differs from SD3 (diffusers' ``pipeline_flux.py`` is the reference for each point):

* **Prompts**: CLIP's pooled output ``pooled`` ``[n, 768]`` and T5's tokens ``prompt_embeds``
  ``[n, L, 4096]`` (``FluxPipeline.encode_prompt``). Text position ids are zeros ``[L, 3]``.
* **Latents**: the VAE latent ``[C, h, w]`` is cut into 2x2 patches and packed into tokens,
  ``[h/2 * w/2, 4C]`` (``_pack_latents``); each token's rotary image id is ``(0, row, column)``
  (``_prepare_latent_image_ids``). The sampler and the SDE step work on the packed tensor: the SDE
  is elementwise and the log-prob is a mean over all non-batch elements, so packing (a permutation of
  the elements) changes neither (FlowGRPO's ``flux_pipeline_with_logprob.py`` and DanceGRPO's
  ``train_grpo_flux.py`` also step on packed latents).
* **Schedule**: ``sigmas = linspace(1, 1/S, S)`` shifted by ``exp(mu) / (exp(mu) + 1/sigma - 1)``
  with ``mu`` linear in the number of image tokens (``calculate_shift``), as
  ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=..., mu=...)`` does for the pipeline.
* **Guidance**: no classifier-free guidance; FLUX.1-dev embeds a guidance value (``guidance``,
  3.5 by default; ``sampling.distilled_guidance``) like a second timestep. Checkpoints without
  ``guidance_embeds`` (FLUX.1-schnell) get ``guidance=None``.
* **Timestep**: the transformer takes ``sigma`` (the pipeline passes ``timestep / 1000``) and
  multiplies by 1000 itself.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from unirl.diffusion.families.base import ModelFamily, cast, check_resolution, compute_dtype, tokenize, vae_decode
from unirl.diffusion.sampling import sigma_schedule


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift: ``mu`` on the line through ``(base_seq_len, base_shift)`` and
    ``(max_seq_len, max_shift)`` at ``image_seq_len`` packed tokens (diffusers' ``calculate_shift``).

    >>> calculate_shift(256), round(calculate_shift(4096), 6), round(calculate_shift(1024), 4)
    (0.5, 1.15, 0.63)
    """
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (image_seq_len - base_seq_len)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[n, C, h, w]`` -> ``[n, h/2 * w/2, 4C]``: each token a 2x2 patch, channel-major (``_pack_latents``)."""
    n, c, h, w = latents.shape
    x = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # [n, h/2, w/2, C, 2, 2]
    return x.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[n, h/2 * w/2, 4C]`` -> ``[n, C, h, w]`` for latent ``height`` x ``width`` (inverse of ``pack_latents``)."""
    n, _, channels = packed.shape
    x = packed.view(n, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # [n, C, h/2, 2, w/2, 2]
    return x.reshape(n, channels // 4, height, width)


def latent_image_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[h/2 * w/2, 3]`` rotary ids ``(0, row, column)`` of the packed tokens (``_prepare_latent_image_ids``)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def _side(latent_shape: tuple[int, ...]) -> int:
    """Latent height (= width) of a square image from the packed shape ``(tokens, 4C)``."""
    return 2 * math.isqrt(latent_shape[0])


def _module_config(transformer):
    # DDP wraps the module in ``.module``; a PEFT model forwards ``config`` to the transformer.
    while not hasattr(transformer, "config") and hasattr(transformer, "module"):
        transformer = transformer.module
    return transformer.config


class FluxFamily(ModelFamily):
    name = "flux"
    title = "FLUX.1"
    pipeline_class_name = "FluxPipeline"
    cond_keys = ("prompt_embeds", "pooled")
    guidance_mode = "distilled"

    def __init__(self, guidance: float = 3.5):
        self.guidance = guidance  # the embedded guidance value

    @classmethod
    def from_config(cls, cfg) -> "FluxFamily":
        return cls(guidance=cfg.sampling.distilled_guidance)

    def latent_shape(self, pipe, resolution: int) -> tuple[int, ...]:
        check_resolution(resolution, pipe.vae_scale_factor * 2)
        side = resolution // pipe.vae_scale_factor
        return ((side // 2) ** 2, pipe.transformer.config.in_channels)  # (tokens, 4C)

    def schedule(self, scheduler, num_steps: int, latent_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        c = scheduler.config
        mu = calculate_shift(latent_shape[0], c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        return sigma_schedule(scheduler, num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)

    def noise(self, n: int, latent_shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        # Drawn unpacked and packed, as FluxPipeline.prepare_latents does, so a seed gives the pipeline's noise.
        side, channels = _side(latent_shape), latent_shape[1] // 4
        return pack_latents(torch.randn((n, channels, side, side), generator=generator))  # [n, tokens, 4C]

    def encode(self, pipe, prompts: list[str], *, max_sequence_length: int, device) -> dict[str, torch.Tensor]:
        """``FluxPipeline.encode_prompt`` for one image per prompt, with each tokenizer run once
        (``base.tokenize``): CLIP's pooled output and T5's last hidden states, the same bit for bit
        (``tests/test_flux.py``). Multi-vector textual-inversion tokens are expanded as the pipeline
        does, when the tokenizer has any."""
        ids = tokenize(pipe.tokenizer, _textual_inversion(pipe, prompts, pipe.tokenizer), pipe.tokenizer_max_length,
                       "CLIP")  # [n, 77]
        pooled = pipe.text_encoder(ids.to(device), output_hidden_states=False).pooler_output
        pooled = pooled.to(dtype=pipe.text_encoder.dtype, device=device)  # [n, P]
        ids = tokenize(pipe.tokenizer_2, _textual_inversion(pipe, prompts, pipe.tokenizer_2), max_sequence_length,
                       "T5 (sampling.max_sequence_length)")  # [n, L]
        embeds = pipe.text_encoder_2(ids.to(device), output_hidden_states=False)[0]
        return {"prompt_embeds": embeds.to(dtype=pipe.text_encoder_2.dtype, device=device), "pooled": pooled}  # [n, L, D], [n, P]

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 cond: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = compute_dtype(transformer)
        (n, tokens), device = latents.shape[:2], latents.device
        hidden, img_ids = self.image_stream(latents, cond)  # [n, tokens', 4C], [tokens', 3]
        embeds = cond["prompt_embeds"]  # [n, L, D]
        guidance = None
        if _module_config(transformer).guidance_embeds:
            guidance = torch.full((n,), self.guidance, device=device, dtype=torch.float32)  # [n]
        return transformer(
            hidden_states=cast(hidden, dtype), timestep=timestep / 1000, guidance=guidance,
            pooled_projections=cast(cond["pooled"], dtype), encoder_hidden_states=cast(embeds, dtype),
            txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),  # [L, 3]
            img_ids=img_ids.to(device=device, dtype=dtype), return_dict=False,
        )[0][:, :tokens]  # [n, tokens, 4C]: the velocity of the latents' own tokens

    def image_stream(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's image tokens ``[n, tokens', 4C]`` and their rotary ids ``[tokens', 3]``: the packed
        latents alone here; a variant that conditions on more image tokens (Kontext) appends them."""
        side = _side(latents.shape[1:])
        return latents, latent_image_ids(side, side)  # [n, tokens, 4C], [tokens, 3]

    @torch.no_grad()
    def decode(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        side = _side(latents.shape[1:])
        return vae_decode(pipe.vae, unpack_latents(latents, side, side))


def _textual_inversion(pipe, prompts: list[str], tokenizer) -> list[str]:
    """The pipeline's ``maybe_convert_prompt``, which re-tokenizes every prompt, called only when
    ``tokenizer`` holds a multi-vector token (``<t>`` with ``<t>_1``), the one case where it changes a prompt."""
    added = tokenizer.added_tokens_encoder
    if hasattr(pipe, "maybe_convert_prompt") and any(f"{token}_1" in added for token in added):
        return pipe.maybe_convert_prompt(prompts, tokenizer)
    return prompts
