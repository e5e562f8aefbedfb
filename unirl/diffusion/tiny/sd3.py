"""A toy-size Stable Diffusion 3 pipeline, built from configs with a fixed seed, for tests and demos.

Nothing is downloaded. ``build_tiny_sd3`` instantiates the real classes a Stable Diffusion 3 / 3.5
checkpoint uses (``SD3Transformer2DModel``, ``AutoencoderKL``, two ``CLIPTextModelWithProjection``
with ``CLIPTokenizer``, ``T5EncoderModel`` with ``T5Tokenizer``, ``FlowMatchEulerDiscreteScheduler``
with SD3's ``shift=3.0``) at toy sizes, and saves them as a diffusers pipeline directory, so that
``StableDiffusion3Pipeline.from_pretrained(path)`` and every code path that loads a real checkpoint
load it too.

Sizes (see ``TINY_SD3_SPEC``): 16x16x4 latents and 32x32 RGB images (VAE scale factor 2); a 2-layer
MMDiT with 2 heads of 8 dims, ``qk_norm="rms_norm"`` as in SD3.5; CLIP encoders of width 16 whose
concatenation (32) is exactly the T5 width and ``joint_attention_dim``, as 768 + 1280 <= 4096 in the
real model; CLIP context of 16 tokens (the real one has 77), so a prompt embedding is
``[N, 16 + max_sequence_length, 32]``. The tokenizers are character level: a byte-level BPE without
merges for CLIP and a unigram vocabulary of single characters for T5. The weights are random except the
VAE decoder's, which gets a short fit (``fit_decoder``, a few seconds) to a fixed linear latent -> RGB
map: a random decoder's GroupNorms erase the mean of a latent, so nothing the transformer learns could
change the brightness of an image. The model draws smooth noise-like colour fields; a demo reward such
as ``brightness`` can move them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from unirl.models.cache import default_cache_dir
from unirl.diffusion.tiny.common import TOY_VAE, cached_build, clip_char_tokenizer, fit_decoder, t5_char_tokenizer, variant_spec

#: Everything that changes the built artefacts goes into the cache key.
TINY_SD3_SPEC = {
    "version": 2,
    "transformer": dict(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,  # must equal num_attention_heads * attention_head_dim
        pooled_projection_dim=32,  # two CLIP projections of 16
        pos_embed_max_size=32,
        qk_norm="rms_norm",
    ),
    "vae": dict(TOY_VAE, scaling_factor=1.5305, shift_factor=0.0609),  # SD3's latent normalisation
    "clip": dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=16,
        max_position_embeddings=16,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    ),
    "t5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8),
    "scheduler": dict(num_train_timesteps=1000, shift=3.0),
    # A random decoder's GroupNorms erase a latent's mean: no latent makes the image brighter. A short
    # fit makes the decoder a smooth, roughly linear latent -> RGB map (SD3's latents have such an
    # approximate linear RGB preview too), so a demo reward like brightness can be moved.
    "decoder_fit": dict(steps=150, batch_size=16, lr=3e-3),
}

_MARKER = "unirl_tiny_sd3.json"
def build_tiny_sd3(directory: str | Path | None = None, seed: int = 0, variant: str = "tiny") -> Path:
    """Build (or reuse) the toy SD3 pipeline in ``directory`` and return its path.

    ``variant``: ``tiny`` (random weights) or ``tiny-colour`` (the same, then the text encoders' short
    warm start of ``unirl/diffusion/tiny/colour.py``). ``directory`` defaults to
    ``default_cache_dir() / "tiny-sd3-seed{seed}"`` (``tiny-sd3-colour-seed{seed}``). See ``cached_build``.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    spec, name = variant_spec(TINY_SD3_SPEC, variant, seed)
    directory = Path(directory) if directory is not None else default_cache_dir() / f"tiny-sd3{name}-seed{seed}"

    def build(directory: Path) -> None:
        # 1. Tokenizers: character level, built in memory.
        clip_tokenizer = clip_char_tokenizer(model_max_length=TINY_SD3_SPEC["clip"]["max_position_embeddings"])
        t5_tokenizer = t5_char_tokenizer()

        # 2. Models, each from its own seed so that adding one does not change the others.
        clip_config = CLIPTextConfig(
            vocab_size=len(clip_tokenizer),
            bos_token_id=clip_tokenizer.bos_token_id,
            eos_token_id=clip_tokenizer.eos_token_id,
            pad_token_id=clip_tokenizer.pad_token_id,
            **TINY_SD3_SPEC["clip"],
        )
        torch.manual_seed(seed)
        text_encoder = CLIPTextModelWithProjection(clip_config)
        torch.manual_seed(seed + 1)
        text_encoder_2 = CLIPTextModelWithProjection(clip_config)
        torch.manual_seed(seed + 2)
        t5_config = T5Config(
            vocab_size=len(t5_tokenizer),
            pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id,
            decoder_start_token_id=t5_tokenizer.pad_token_id,
            **TINY_SD3_SPEC["t5"],
        )
        text_encoder_3 = T5EncoderModel(t5_config)
        torch.manual_seed(seed + 3)
        transformer = SD3Transformer2DModel(**TINY_SD3_SPEC["transformer"])
        torch.manual_seed(seed + 4)
        vae = AutoencoderKL(**TINY_SD3_SPEC["vae"])
        fit_decoder(vae, seed=seed + 5, **TINY_SD3_SPEC["decoder_fit"])
        scheduler = FlowMatchEulerDiscreteScheduler(**TINY_SD3_SPEC["scheduler"])

        # 3. Save as a pipeline directory (after the warm start of the colour variant).
        pipe = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=clip_tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=clip_tokenizer,
            text_encoder_3=text_encoder_3,
            tokenizer_3=t5_tokenizer,
        )
        if "warm_start" in spec:
            from unirl.diffusion.tiny.colour import warm_start_text_encoders

            warm_start_text_encoders(pipe, "sd3", seed=seed + 6, **spec["warm_start"])
        pipe.save_pretrained(directory)

    return cached_build(directory, spec, _MARKER, build)
