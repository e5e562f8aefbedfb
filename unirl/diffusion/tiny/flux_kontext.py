"""A toy-size FLUX.1 Kontext pipeline: the toy FLUX.1 (``flux.py``) with a VAE encoder fit to its decoder.

Nothing is downloaded. FLUX.1 Kontext checkpoints hold the same classes as FLUX.1-dev
(``FluxTransformer2DModel`` with a guidance embedding, ``AutoencoderKL``, CLIP, T5, the dynamically
shifted scheduler), so ``build_tiny_flux_kontext`` loads the toy FLUX.1 as a ``FluxKontextPipeline`` and
saves it under that class. One thing is added: the other toys never encode (FlowGRPO samples from
noise), so their VAE encoders are random, but Kontext encodes its input image. Its encoder gets a short
fit (``ENCODER_FIT``) to invert the toy decoder: for pipeline latents z drawn as the decoder's fit draws
them, the encoder's posterior mode, normalised as the pipeline normalises it, is regressed onto z.
The input image's colours then reach the transformer as the latents that would draw them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from unirl.models.cache import default_cache_dir
from unirl.diffusion.tiny.common import cached_build, variant_spec
from unirl.diffusion.tiny.flux import TINY_FLUX_SPEC, build_tiny_flux

#: The encoder's fit; with the toy FLUX.1's spec, the cache key.
ENCODER_FIT = dict(steps=150, batch_size=16, lr=3e-3)

_MARKER = "unirl_tiny_flux_kontext.json"


def build_tiny_flux_kontext(directory: str | Path | None = None, seed: int = 0, variant: str = "tiny") -> Path:
    """Build (or reuse) the toy FLUX.1 Kontext pipeline in ``directory`` and return its path.

    ``variant``: ``tiny`` or ``tiny-colour``, the toy FLUX.1's variant it starts from. ``directory``
    defaults to ``default_cache_dir() / "tiny-flux_kontext-seed{seed}"``; the cache is keyed by the hash
    of the FLUX.1 toy's spec, the encoder fit and the seed (``common.cached_build``).
    """
    from diffusers import FluxKontextPipeline

    flux_spec, name = variant_spec(TINY_FLUX_SPEC, variant, seed)
    spec = {"flux": flux_spec, "encoder_fit": ENCODER_FIT}
    directory = Path(directory) if directory is not None else default_cache_dir() / f"tiny-flux_kontext{name}-seed{seed}"

    def build(directory: Path) -> None:
        pipe = FluxKontextPipeline.from_pretrained(build_tiny_flux(seed=seed, variant=variant))
        fit_encoder(pipe.vae, seed=seed + 10, **ENCODER_FIT)
        pipe.save_pretrained(directory)

    return cached_build(directory, spec, _MARKER, build)


def fit_encoder(vae, *, seed: int, steps: int, batch_size: int, lr: float) -> None:
    """Fit ``vae``'s encoder so that encoding what the decoder draws from a pipeline latent z gives z back:
    ``(mode(encode(decode(z / scaling + shift))) - shift) * scaling ~ z``."""
    c = vae.config
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam([*vae.encoder.parameters(), *(vae.quant_conv.parameters() if vae.quant_conv else [])],
                                 lr=lr)
    size = c.sample_size // 2
    for _ in range(steps):
        z = torch.randn(batch_size, c.latent_channels, size, size, generator=generator)  # [n, C, h, w]
        z = z + 0.5 * torch.randn(batch_size, c.latent_channels, 1, 1, generator=generator)  # per-sample means
        with torch.no_grad():
            images = vae.decoder(z / c.scaling_factor + c.shift_factor)  # [n, 3, H, W]
        encoded = (vae.encode(images).latent_dist.mode() - c.shift_factor) * c.scaling_factor
        loss = (encoded - z).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vae.requires_grad_(False).zero_grad(set_to_none=True)
