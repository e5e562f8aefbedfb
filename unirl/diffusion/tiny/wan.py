"""A toy-size Wan 2.1 text-to-video pipeline, built from configs with a fixed seed, for tests and demos.

Nothing is downloaded. ``build_tiny_wan`` instantiates the real classes a Wan2.1-T2V-1.3B-Diffusers
checkpoint uses (``WanTransformer3DModel``, ``AutoencoderKLWan`` with Wan's per-channel latent mean and
std, ``UMT5EncoderModel`` with a T5 tokenizer) at toy sizes and saves them as a diffusers pipeline
directory, so ``WanPipeline.from_pretrained(path)`` loads it like a real one. The scheduler is
``FlowMatchEulerDiscreteScheduler`` with Wan 2.1's ``shift=3.0`` (the shift the Wan authors give for
480p): the real checkpoint ships ``UniPCMultistepScheduler`` with ``use_flow_sigmas`` and the same
shift, whose sigmas the sampler reads the same way (``families/wan.py``); the Euler scheduler lets the
tests compare a step with the stock pipeline's.

Sizes (``TINY_WAN_SPEC``): the VAE keeps Wan's factors (8 in space, 4 in time: ``1 + 4k`` frames make
``1 + k`` latent frames) with 16 latent channels and 4 base channels; a 32 px, 5-frame video is a
``[16, 2, 4, 4]`` latent, 2x2 patches give 8 tokens. A 2-layer transformer with 2 heads of 8 dims
(rotary axes 2 + 3 + 3); UMT5 width 32 = ``text_dim``. The tokenizer is the toys' character-level T5
(``common.t5_char_tokenizer``). All weights are random: unlike the image toys' decoders
(``common.fit_decoder``), Wan's causal 3D decoder did not take a short fit to a linear latent -> RGB
map (the loss plateaued and the brightness stayed put when the latents moved), so its demo reward is
scored on what a random decoder draws.
"""

from __future__ import annotations

from pathlib import Path

import torch

from unirl.cache import default_cache_dir
from unirl.diffusion.tiny.common import cached_build, t5_char_tokenizer, variant_spec

#: Everything that changes the built artefacts goes into the cache key.
TINY_WAN_SPEC = {
    "version": 1,
    "transformer": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=32,  # UMT5 width
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ),
    # Wan's latent normalisation (latents_mean / latents_std) is AutoencoderKLWan's default: Wan 2.1's.
    "vae": dict(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]),
    "umt5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8),
    "scheduler": dict(num_train_timesteps=1000, shift=3.0),
}

_MARKER = "unirl_tiny_wan.json"


def build_tiny_wan(directory: str | Path | None = None, seed: int = 0, variant: str = "tiny") -> Path:
    """Build (or reuse) the toy Wan 2.1 pipeline in ``directory`` and return its path.

    ``variant``: ``tiny`` (random weights) or ``tiny-colour`` (then the text encoder's warm start of
    ``unirl/diffusion/tiny/colour.py``). ``directory`` defaults to ``default_cache_dir() /
    "tiny-wan-seed{seed}"`` (``tiny-wan-colour-seed{seed}``); see ``common.cached_build``.
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    spec, name = variant_spec(TINY_WAN_SPEC, variant, seed)
    directory = Path(directory) if directory is not None else default_cache_dir() / f"tiny-wan{name}-seed{seed}"

    def build(directory: Path) -> None:
        # 1. Tokenizer: character level, built in memory (the other toys' T5).
        tokenizer = t5_char_tokenizer()

        # 2. Models, each from its own seed.
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id, **TINY_WAN_SPEC["umt5"]))
        torch.manual_seed(seed + 1)
        transformer = WanTransformer3DModel(**TINY_WAN_SPEC["transformer"])
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLWan(**TINY_WAN_SPEC["vae"])
        scheduler = FlowMatchEulerDiscreteScheduler(**TINY_WAN_SPEC["scheduler"])

        # 3. Save as a pipeline directory (after the warm start of the colour variant).
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                           transformer=transformer)
        if "warm_start" in spec:
            from unirl.diffusion.tiny.colour import warm_start_text_encoders

            warm_start_text_encoders(pipe, "wan", seed=seed + 4, **spec["warm_start"])
        pipe.save_pretrained(directory)

    return cached_build(directory, spec, _MARKER, build)
