"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1 editing an input image given with each prompt.

Everything is FLUX.1's (``families/flux.py``: prompts, packing, schedule, embedded guidance, decoding)
but the transformer's image stream, which is the noisy latent's packed tokens followed by the input
image's (diffusers' ``pipeline_flux_kontext.py`` is the reference for each point):

* **The input image**: every data row names one (``image``, a file beside the prompt file; see
  ``docs/diffusion.md``). It is resized to ``sampling.resolution`` square, as FlowGRPO's
  ``train_flux_kontext.py`` resizes its reference images (the pipeline's own ``_auto_resize`` to its
  preferred ~1 MP sizes is not applied), scaled to [-1, 1] by the pipeline's image processor,
  encoded by the VAE (the posterior's mode, ``sample_mode="argmax"``), normalised with FLUX's scaling
  and shift, and packed like the latents: ``image_latents`` ``[n, tokens, 4C]``, encoded once per row.
* **Rotary ids**: the input image's tokens get the latents' ``(0, row, column)`` ids with the first
  coordinate set to 1, so the two images share positions but not the first axis.
* **Output**: the transformer returns a velocity for every token; only the latents' own are kept.
  The schedule's shift ``mu`` counts the latents' tokens only, as the pipeline does.
"""

from __future__ import annotations

import torch

from unirl.diffusion.families.base import cast, compute_dtype
from unirl.diffusion.families.flux import FluxFamily, _side, latent_image_ids, pack_latents


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    title = "FLUX.1 Kontext"
    pipeline_class_name = "FluxKontextPipeline"
    cond_keys = ("prompt_embeds", "pooled", "image_latents")
    conditioning_image = True

    @torch.no_grad()
    def encode_images(self, pipe, images: list[str], *, resolution: int, device) -> dict[str, torch.Tensor]:
        from unirl.image_files import load_rgb

        pictures = [load_rgb(path, (resolution, resolution)) for path in images]  # a bad file is named
        vae = pipe.vae
        pixels = pipe.image_processor.preprocess(pictures, resolution, resolution)  # [n, 3, H, W] in [-1, 1]
        latents = vae.encode(cast(pixels.to(device), compute_dtype(vae))).latent_dist.mode()  # [n, C, h, w]
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        return {"image_latents": pack_latents(latents)}  # [n, tokens, 4C]

    def image_stream(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        image = cond["image_latents"]  # [n, tokens_in, 4C]
        side, image_side = _side(latents.shape[1:]), _side(image.shape[1:])
        image_ids = latent_image_ids(image_side, image_side)
        image_ids[:, 0] = 1  # the input image's first rotary axis
        tokens = torch.cat([latents, cast(image, latents.dtype)], dim=1)  # [n, tokens + tokens_in, 4C]
        return tokens, torch.cat([latent_image_ids(side, side), image_ids])  # [tokens + tokens_in, 3]
