"""Wan 2.1 text-to-video (``WanPipeline``): a 3D transformer over video latents with a frame axis.

What differs from the image families (diffusers' ``pipeline_wan.py`` is the reference for each point):

* **Samples are videos**: ``frames = True``. ``sampling.num_frames`` frames (``1 + 4k``: the causal VAE
  keeps the first frame and folds each later 4 into one latent frame) are the latent
  ``[C, 1 + k, h, w]`` (``prepare_latents``); the transformer cuts it into ``(1, 2, 2)`` patches
  itself. The sampler and the SDE step are elementwise with a mean over all non-batch elements, so the
  frame axis is one more latent axis to them.
* **Prompts**: one UMT5 encoder. The pipeline cleans each prompt (``prompt_clean``), encodes it with
  its attention mask and zeroes the states past its last token (``_get_t5_prompt_embeds``):
  ``prompt_embeds`` ``[n, L, D]``, no pooled vector. Classifier-free guidance with the empty prompt as
  the negative, as the pipeline's default.
* **Schedule**: the scheduler's own sigmas for S steps. The Wan 2.1 checkpoints ship
  ``UniPCMultistepScheduler`` with ``use_flow_sigmas`` and ``flow_shift`` 3.0 (480p; 5.0 for 720p),
  which sets the shifted sigmas ``shift s / (1 + (shift - 1) s)`` of ``linspace(1, 1/1000, S + 1)[:-1]``
  and ``timestep = sigma * 1000`` (rounded down to an integer). The sampler takes its own SDE / Euler
  steps on those sigmas, as FlowGRPO's ``train_wan2_1.py`` does, not UniPC's multistep update; the toy
  uses ``FlowMatchEulerDiscreteScheduler`` with shift 3.0, where the stock pipeline's step is that Euler step.
* **Decoding**: latents are de-normalised per channel (``z * latents_std + latents_mean``) and the
  VAE decodes them latent frame by latent frame (its causal cache): ``[n, frames, 3, H, W]``.
"""

from __future__ import annotations

import torch

from unirl.diffusion.families.base import ModelFamily, cast, check_resolution, compute_dtype, tokenize
from unirl.diffusion.sampling import sigma_schedule


class WanFamily(ModelFamily):
    name = "wan"
    title = "Wan 2.1"
    pipeline_class_name = "WanPipeline"
    cond_keys = ("prompt_embeds",)
    guidance_mode = "cfg"
    frames = True

    def __init__(self, num_frames: int = 81):
        self.num_frames = num_frames  # pixel frames per video (WanPipeline's default: 81)

    @classmethod
    def from_config(cls, cfg) -> "WanFamily":
        return cls(num_frames=cfg.sampling.num_frames)

    def latent_shape(self, pipe, resolution: int) -> tuple[int, ...]:
        check_resolution(resolution, pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1])
        temporal = pipe.vae_scale_factor_temporal
        if (self.num_frames - 1) % temporal:
            # The pipeline rounds silently; here the config says what it gets.
            raise ValueError(f"sampling.num_frames={self.num_frames}: Wan's VAE makes 1 + {temporal}k frames "
                             f"(e.g. {temporal + 1}, {8 * temporal + 1}, {20 * temporal + 1})")
        side = resolution // pipe.vae_scale_factor_spatial
        return (pipe.transformer.config.in_channels, (self.num_frames - 1) // temporal + 1, side, side)

    def schedule(self, scheduler, num_steps: int, latent_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return sigma_schedule(scheduler, num_steps)

    def encode(self, pipe, prompts: list[str], *, max_sequence_length: int, device) -> dict[str, torch.Tensor]:
        """``WanPipeline.encode_prompt`` for one video per prompt, with the tokenizer run once
        (``base.tokenize``); the same states bit for bit (``tests/test_wan.py``)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        ids = tokenize(pipe.tokenizer, [prompt_clean(p) for p in prompts], max_sequence_length,
                       "UMT5 (sampling.max_sequence_length)")  # [n, L]
        mask = ids.ne(pipe.tokenizer.pad_token_id)  # [n, L]: padding comes only after the prompt's tokens
        states = pipe.text_encoder(ids.to(device), mask.to(device)).last_hidden_state  # [n, L, D]
        states = torch.where(mask.to(device).unsqueeze(-1), states, torch.zeros((), dtype=states.dtype, device=device))
        return {"prompt_embeds": states.to(dtype=pipe.text_encoder.dtype, device=device)}  # [n, L, D]

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 cond: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = compute_dtype(transformer)
        return transformer(hidden_states=cast(latents, dtype), timestep=timestep,
                           encoder_hidden_states=cast(cond["prompt_embeds"], dtype), return_dict=False)[0]  # [n, C, f, h, w]

    @torch.no_grad()
    def decode(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        """Videos ``[n, frames, 3, H, W]`` in [0, 1] (float32, CPU) from latents ``[n, C, f, h, w]``."""
        vae = pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device)
        # z / (1 / std) + mean, in the pipeline's order of operations (the same bits).
        video = vae.decode(cast(latents / inverse_std + mean, compute_dtype(vae)), return_dict=False)[0]  # [n, 3, frames, H, W]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).cpu()
