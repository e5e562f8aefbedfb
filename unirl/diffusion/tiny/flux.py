"""A toy-size FLUX.1 pipeline, built from configs with a fixed seed, for tests and demos.

Nothing is downloaded. ``build_tiny_flux`` instantiates the real classes a FLUX.1-dev checkpoint uses
(``FluxTransformer2DModel`` with ``guidance_embeds=True``, ``AutoencoderKL`` with FLUX's scaling and
shift factors, ``CLIPTextModel`` with ``CLIPTokenizer``, ``T5EncoderModel`` with ``T5Tokenizer``,
``FlowMatchEulerDiscreteScheduler`` with FLUX.1-dev's dynamic shifting) at toy sizes and saves them as
a diffusers pipeline directory, so ``FluxPipeline.from_pretrained(path)`` loads it like a real one.

Sizes (``TINY_FLUX_SPEC``): 4-channel 16x16 latents for 32x32 RGB images (VAE scale factor 2; FLUX has
16 channels and factor 8), packed into 8x8 = 64 tokens of 16 channels; one double-stream and two
single-stream blocks with 2 heads of 16 dims (rotary axes 4 + 6 + 6 = 16); T5 width 32 =
``joint_attention_dim``; CLIP width 16 = ``pooled_projection_dim`` (FLUX uses CLIP's pooled output,
without projection). The tokenizers, the prompts and the VAE decoder's fit (through FLUX's scaling) are
the toy SD3's (``common.py``, ``prompts.py``), so both toys draw the same kind of smooth colour fields.
At 64 tokens FLUX's shift is ``mu = 0.4675`` (``families.flux.calculate_shift``); 256 tokens (64 px) give 0.5.
"""

from __future__ import annotations

from pathlib import Path

import torch

from unirl.models.cache import default_cache_dir
from unirl.diffusion.tiny.common import TOY_VAE, cached_build, clip_char_tokenizer, fit_decoder, t5_char_tokenizer, variant_spec

#: Everything that changes the built artefacts goes into the cache key.
TINY_FLUX_SPEC = {
    "version": 1,
    "transformer": dict(
        patch_size=1,
        in_channels=16,  # 4 latent channels x a 2x2 patch
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # T5 width
        pooled_projection_dim=16,  # CLIP width
        guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    ),
    "vae": dict(TOY_VAE, scaling_factor=0.3611, shift_factor=0.1159),  # FLUX's latent normalisation
    "clip": dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    ),
    "t5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8),
    # FLUX.1-dev's scheduler_config.json (``shift`` is unused with dynamic shifting).
    "scheduler": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                      max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
    "decoder_fit": dict(steps=150, batch_size=16, lr=3e-3, through_scaling=True),
}

_MARKER = "unirl_tiny_flux.json"


def build_tiny_flux(directory: str | Path | None = None, seed: int = 0, variant: str = "tiny") -> Path:
    """Build (or reuse) the toy FLUX.1 pipeline in ``directory`` and return its path.

    ``variant``: ``tiny`` (random weights) or ``tiny-colour`` (then the text encoders' warm start of
    ``unirl/diffusion/tiny/colour.py``). ``directory`` defaults to
    ``default_cache_dir() / "tiny-flux-seed{seed}"`` (``tiny-flux-colour-seed{seed}``); the cache is
    keyed by the hash of the spec and seed (``common.cached_build``).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    spec, name = variant_spec(TINY_FLUX_SPEC, variant, seed)
    directory = Path(directory) if directory is not None else default_cache_dir() / f"tiny-flux{name}-seed{seed}"

    def build(directory: Path) -> None:
        # 1. Tokenizers: character level, built in memory (the toy SD3's).
        clip_tokenizer = clip_char_tokenizer(model_max_length=TINY_FLUX_SPEC["clip"]["max_position_embeddings"])
        t5_tokenizer = t5_char_tokenizer()

        # 2. Models, each from its own seed.
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tokenizer), bos_token_id=clip_tokenizer.bos_token_id,
            eos_token_id=clip_tokenizer.eos_token_id, pad_token_id=clip_tokenizer.pad_token_id,
            **TINY_FLUX_SPEC["clip"]))
        torch.manual_seed(seed + 1)
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tokenizer), pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id, decoder_start_token_id=t5_tokenizer.pad_token_id,
            **TINY_FLUX_SPEC["t5"]))
        torch.manual_seed(seed + 2)
        transformer = FluxTransformer2DModel(**TINY_FLUX_SPEC["transformer"])
        torch.manual_seed(seed + 3)
        vae = AutoencoderKL(**TINY_FLUX_SPEC["vae"])
        fit_decoder(vae, seed=seed + 4, **TINY_FLUX_SPEC["decoder_fit"])
        scheduler = FlowMatchEulerDiscreteScheduler(**TINY_FLUX_SPEC["scheduler"])

        # 3. Save as a pipeline directory (after the warm start of the colour variant).
        pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=clip_tokenizer,
                            text_encoder_2=text_encoder_2, tokenizer_2=t5_tokenizer, transformer=transformer)
        if "warm_start" in spec:
            from unirl.diffusion.tiny.colour import warm_start_text_encoders

            warm_start_text_encoders(pipe, "flux", seed=seed + 5, **spec["warm_start"])
        pipe.save_pretrained(directory)

    return cached_build(directory, spec, _MARKER, build)
