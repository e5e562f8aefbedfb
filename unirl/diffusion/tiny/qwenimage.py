"""A toy-size Qwen-Image pipeline, built from configs with a fixed seed, for tests and demos.

Nothing is downloaded. ``build_tiny_qwenimage`` instantiates the real classes a Qwen-Image checkpoint
uses (``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage``, ``Qwen2_5_VLForConditionalGeneration``
with a ``Qwen2Tokenizer``, ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's dynamic shifting) at toy
sizes and saves them as a diffusers pipeline directory, so ``QwenImagePipeline.from_pretrained(path)``
loads it like a real one.

Sizes (``TINY_QWENIMAGE_SPEC``): 4-channel 16x16 latents for 32x32 RGB images (VAE scale factor 2;
Qwen-Image has 16 channels and factor 8), packed into 8x8 = 64 tokens of 16 channels; one transformer
block with 2 heads of 16 dims (rotary axes 4 + 6 + 6 = 16); a 2-layer Qwen2.5-VL language model of
width 32 = ``joint_attention_dim`` (its vision tower, which text prompts never reach, is one block of
width 16).

The tokenizer is byte-level BPE like Qwen's, with every byte in the vocabulary and merges only for the
words of the pipeline's chat template, so that the template's system part is exactly the 34 tokens the
pipeline drops (``prompt_template_encode_start_idx``) and a prompt is spelt a character or two per token.
The VAE decoder gets the other toys' fit (``common.fit_latent_rgb``) through Qwen-Image's per-channel
latent normalisation, so every toy draws the same kind of smooth colour fields.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from unirl.models.cache import default_cache_dir
from unirl.diffusion.tiny.common import cached_build, fit_latent_rgb, variant_spec

#: Everything that changes the built artefacts goes into the cache key.
TINY_QWENIMAGE_SPEC = {
    "version": 1,
    "transformer": dict(
        patch_size=2,
        in_channels=16,  # 4 latent channels x a 2x2 patch
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # the text encoder's width
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    ),
    # One temporal-downsample entry = spatial factor 2; the per-channel normalisation is not the identity,
    # so that decoding exercises it.
    "vae": dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False],
                latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0]),
    "text": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "mrope_section": [2, 3, 3]}),  # 2 + 3 + 3 = 16 / 2
    "vision": dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                   fullatt_block_indexes=[0]),
    # Qwen-Image's scheduler_config.json.
    "scheduler": dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                      base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                      time_shift_type="exponential"),
    # Fewer and smaller batches than the 2-D toys' 150 x 16: the causal 3-D convolutions cost about 3x, and
    # this fit already maps latent offsets of -1 / 0 / +1 to mean pixel values of about -0.8 / 0 / +0.8.
    "decoder_fit": dict(steps=100, batch_size=8, lr=3e-3),
}

_MARKER = "unirl_tiny_qwenimage.json"
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def qwen_char_tokenizer(template: str, system_tokens: int):
    """A ``Qwen2Tokenizer`` (byte-level BPE) whose merges spell each word of ``template`` as one token and
    every other text a byte or two per token; checked to cut ``template``'s system part into ``system_tokens``."""
    from tokenizers import pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {char: i for i, char in enumerate(sorted(ByteLevel.alphabet()))}
    merges = []
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = {piece for part in re.split(r"<\|im_start\|>|<\|im_end\|>", template.replace("{}", ""))
             for piece, _ in split.pre_tokenize_str(part)}
    for word in sorted(words):  # each word grown one byte at a time, left to right
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                merges.append((word[: end - 1], word[end - 1]))
                vocab[word[:end]] = len(vocab)
    for token in _SPECIALS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": _SPECIALS[1:]})
    prefix = template.split("{}")[0]
    if len(tokenizer(prefix).input_ids) != system_tokens:
        raise RuntimeError(f"the toy tokenizer cuts the template's system part into {len(tokenizer(prefix).input_ids)} "
                           f"tokens, the pipeline drops {system_tokens}")
    return tokenizer


def build_tiny_qwenimage(directory: str | Path | None = None, seed: int = 0, variant: str = "tiny") -> Path:
    """Build (or reuse) the toy Qwen-Image pipeline in ``directory`` and return its path.

    ``variant``: ``tiny`` (random weights) or ``tiny-colour`` (then the text encoder's warm start of
    ``unirl/diffusion/tiny/colour.py``). ``directory`` defaults to
    ``default_cache_dir() / "tiny-qwenimage-seed{seed}"``; the cache is keyed by the hash of the spec
    and seed (``common.cached_build``).
    """
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec, name = variant_spec(TINY_QWENIMAGE_SPEC, variant, seed)
    directory = Path(directory) if directory is not None else default_cache_dir() / f"tiny-qwenimage{name}-seed{seed}"

    def build(directory: Path) -> None:
        # 1. The tokenizer, for the template the pipeline class writes prompts into.
        template, drop = _pipeline_template(QwenImagePipeline)
        tokenizer = qwen_char_tokenizer(template, drop)

        # 2. Models, each from its own seed.
        torch.manual_seed(seed)
        ids = dict(bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                   eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id)
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tokenizer), **ids, **TINY_QWENIMAGE_SPEC["text"]),
            vision_config=TINY_QWENIMAGE_SPEC["vision"], **ids))
        torch.manual_seed(seed + 1)
        transformer = QwenImageTransformer2DModel(**TINY_QWENIMAGE_SPEC["transformer"])
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLQwenImage(**TINY_QWENIMAGE_SPEC["vae"])
        _fit_vae_decoder(vae, seed=seed + 3, **TINY_QWENIMAGE_SPEC["decoder_fit"])
        scheduler = FlowMatchEulerDiscreteScheduler(**TINY_QWENIMAGE_SPEC["scheduler"])

        # 3. Save as a pipeline directory (after the warm start of the colour variant).
        pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                 transformer=transformer)
        if "warm_start" in spec:
            from unirl.diffusion.tiny.colour import warm_start_text_encoders

            warm_start_text_encoders(pipe, "qwenimage", seed=seed + 4, **spec["warm_start"])
        pipe.save_pretrained(directory)

    return cached_build(directory, spec, _MARKER, build)


def _pipeline_template(pipeline_class) -> tuple[str, int]:
    """``(prompt_template_encode, prompt_template_encode_start_idx)``: the pipeline sets them in its
    ``__init__`` (they are not part of a checkpoint), so they are read from one built without components."""
    pipe = pipeline_class(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx


def _fit_vae_decoder(vae, *, seed: int, steps: int, batch_size: int, lr: float) -> None:
    """``common.fit_latent_rgb`` through what ``QwenImagePipeline`` decodes: a pipeline latent z ``[n, C, h, w]``
    becomes the one-frame VAE latent ``z * latents_std + latents_mean`` ``[n, C, 1, h, w]``."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean, std = torch.tensor(vae.config.latents_mean).view(shape), torch.tensor(vae.config.latents_std).view(shape)

    def decode(z: torch.Tensor) -> torch.Tensor:
        return vae.decode(z.unsqueeze(2) * std + mean, return_dict=False)[0][:, :, 0]  # [n, 3, H, W]

    params = [*vae.post_quant_conv.parameters(), *vae.decoder.parameters()]
    fit_latent_rgb(decode, params, channels=vae.config.z_dim, size=16, seed=seed, steps=steps, batch_size=batch_size,
                   lr=lr)
    vae.zero_grad(set_to_none=True)
