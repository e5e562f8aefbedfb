"""Qwen-Image (``QwenImagePipeline``): an MMDiT over packed 2x2 latent patches, prompted by Qwen2.5-VL.

What differs from FLUX.1 (diffusers' ``pipeline_qwenimage.py`` is the reference for each point):

* **Prompts**: one text encoder, the language model of Qwen2.5-VL. Each prompt is put into the
  pipeline's chat template (``prompt_template_encode``); the last hidden states of its tokens,
  without the template's first ``prompt_template_encode_start_idx`` (34) system-prompt tokens, are
  the conditioning, cut to ``max_sequence_length``. Prompts differ in length, so the pipeline pads
  them to the longest with zeros and a mask; here every prompt is padded to ``max_sequence_length``
  (``prompt_embeds`` ``[n, L, D]`` and ``prompt_mask`` ``[n, L]``), so that a rollout can store them and
  concatenate them with the negative prompt. Masked tokens are not attended to and the text's rotary
  positions count from the first token, so the padding changes the velocity only by float rounding
  (``tests/test_qwenimage.py``).
* **Latents**: the VAE (``AutoencoderKLQwenImage``, a causal video VAE) has a frame axis
  ``[C, 1, h, w]``; the transformer takes FLUX's 2x2 packing of the one frame, ``[h/2 * w/2, 4C]``,
  with rotary positions from ``img_shapes = (1, h/2, w/2)``. Latents are normalised per channel
  (``latents_mean``, ``latents_std``) instead of one scaling and shift factor.
* **Schedule**: FLUX's code (``linspace(1, 1/S, S)`` shifted by ``mu`` linear in the token count),
  with Qwen-Image's scheduler settings (a larger ``max_image_seq_len``, ``shift_terminal``).
* **Guidance**: "true" classifier-free guidance with a negative prompt (FlowGRPO and the pipeline's
  example use ``" "``), whose combination is rescaled to the conditional velocity's norm per token:
  ``v = c * |v_c| / |c|`` with ``c = v_u + g (v_c - v_u)``.
* **Timestep**: the transformer takes ``sigma`` (the pipeline passes ``timestep / 1000``).
"""

from __future__ import annotations

import torch

from unirl.diffusion.families.base import ModelFamily, cast, compute_dtype
from unirl.diffusion.families.flux import FluxFamily, _side, unpack_latents


class QwenImageFamily(ModelFamily):
    name = "qwenimage"
    title = "Qwen-Image"
    pipeline_class_name = "QwenImagePipeline"
    cond_keys = ("prompt_embeds", "prompt_mask")
    guidance_mode = "cfg"
    negative_prompt = " "

    # The latent layout, the noise and the schedule are FLUX's: the same 2x2 packing (the pipelines'
    # ``_pack_latents`` are the same code), noise drawn unpacked then packed, and ``calculate_shift``.
    latent_shape = FluxFamily.latent_shape
    noise = FluxFamily.noise
    schedule = FluxFamily.schedule

    def encode(self, pipe, prompts: list[str], *, max_sequence_length: int, device) -> dict[str, torch.Tensor]:
        """``QwenImagePipeline.encode_prompt`` for one image per prompt, padded to ``max_sequence_length``."""
        drop = pipe.prompt_template_encode_start_idx
        texts = [pipe.prompt_template_encode.format(p) for p in prompts]
        tokens = pipe.tokenizer(texts, max_length=pipe.tokenizer_max_length + drop, padding=True, truncation=True,
                                return_tensors="pt").to(device)
        hidden = pipe.text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                   output_hidden_states=True).hidden_states[-1]  # [n, T, D]
        embeds = hidden.new_zeros(len(prompts), max_sequence_length, hidden.shape[-1])  # [n, L, D]
        mask = torch.zeros(len(prompts), max_sequence_length, dtype=torch.bool, device=device)  # [n, L]
        for i, keep in enumerate(tokens.attention_mask.bool()):
            text = hidden[i][keep][drop:drop + max_sequence_length]  # the prompt's tokens, template prefix dropped
            embeds[i, : len(text)], mask[i, : len(text)] = text, True
        return {"prompt_embeds": embeds.to(dtype=pipe.text_encoder.dtype), "prompt_mask": mask}

    def combine_guidance(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
        combined = v_uncond + scale * (v_cond - v_uncond)
        # Rescaled to the conditional prediction's norm per token, as QwenImagePipeline.__call__ does.
        return combined * (v_cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 cond: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = compute_dtype(transformer)
        side = _side(latents.shape[1:])
        return transformer(
            hidden_states=cast(latents, dtype), timestep=timestep / 1000,
            encoder_hidden_states=cast(cond["prompt_embeds"], dtype), encoder_hidden_states_mask=cond["prompt_mask"],
            img_shapes=[(1, side // 2, side // 2)] * latents.shape[0], return_dict=False,
        )[0]  # [n, tokens, 4C]

    @torch.no_grad()
    def decode(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        vae = pipe.vae
        side = _side(latents.shape[1:])
        z = unpack_latents(latents, side, side).unsqueeze(2)  # [n, C, 1, h, w]: one frame
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device)
        std = torch.tensor(vae.config.latents_std).view(shape).to(z.device)
        images = vae.decode(cast(z * std + mean, compute_dtype(vae)), return_dict=False)[0][:, :, 0]  # [n, 3, H, W]
        return (images.float() / 2 + 0.5).clamp(0, 1).cpu()

