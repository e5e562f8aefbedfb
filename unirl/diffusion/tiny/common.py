"""What the toy pipelines share: their cache, character-level tokenizers, the VAE decoder's fit and the variants.

Each family's toy (``sd3.py``, ``flux.py``, ...) builds the real diffusers classes of its checkpoints
at toy sizes from a fixed seed; these pieces make them alike: the same tokenizers (so the same
prompts give comparable conditionings), the same latent -> RGB map fitted into each VAE decoder (so
a demo reward such as ``brightness`` can be moved whatever the family), one cache layout keyed by
the hash of the toy's spec, and the variants (``tiny``, ``tiny-colour``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from unirl.models.cache import cached_build  # noqa: F401 - the toys' builds (once, under a lock, renamed into place)

#: The toys' VAE (``AutoencoderKL``): 3 -> 4 channels, scale factor 2, 32 px; each family adds its
#: latents' ``scaling_factor`` and ``shift_factor``.
TOY_VAE = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        block_out_channels=[8, 16],
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
)

# Rows: R, G, B; columns: the 4 latent channels. The decoder is fit to tanh(upsample(_LATENT_RGB @ z)).
_LATENT_RGB = [[0.8, 0.3, -0.2, 0.1], [0.2, 0.8, 0.3, -0.1], [-0.1, 0.2, 0.8, 0.3]]

# Characters the T5 vocabulary knows (others map to <unk>); CLIP's byte-level BPE knows every byte.
_T5_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"-+*/=()&#%$@"


def variant_spec(base: dict, variant: str, seed: int) -> tuple[dict, str]:
    """The cache spec of a toy ``variant`` and its directory-name infix. ``tiny`` keeps the plain spec
    (so its cache key never changes when variants are added)."""
    if variant == "tiny":
        return {"seed": seed, **base}, ""
    if variant == "tiny-colour":
        from unirl.diffusion.tiny.colour import COLOUR_WARM_START

        return {"seed": seed, **base, "warm_start": COLOUR_WARM_START}, "-colour"
    raise ValueError(f"unknown toy model {variant!r}; expected 'tiny' or 'tiny-colour'")


def fit_decoder(vae, *, seed: int, steps: int, batch_size: int, lr: float, through_scaling: bool = False) -> None:
    """Fit an ``AutoencoderKL``'s decoder to the fixed map ``tanh(upsample(_LATENT_RGB @ z))`` (``fit_latent_rgb``).

    ``through_scaling``: the decoder is fed ``z / scaling_factor + shift_factor``, what a pipeline
    decodes, so that a pipeline latent z maps to that colour whatever the VAE's scaling (the toy FLUX,
    whose FLUX scaling 0.3611 would otherwise push latents far outside the fit); the toy SD3 was fit on
    z itself (False, kept so its weights and cache key stay as they were). The encoder stays random:
    FlowGRPO never encodes.
    """

    def decode(z: torch.Tensor) -> torch.Tensor:
        return vae.decoder(z / vae.config.scaling_factor + vae.config.shift_factor if through_scaling else z)

    fit_latent_rgb(decode, vae.decoder.parameters(), channels=vae.config.latent_channels,
                   size=vae.config.sample_size // 2, seed=seed, steps=steps, batch_size=batch_size, lr=lr)
    vae.requires_grad_(True).zero_grad(set_to_none=True)


def fit_latent_rgb(decode, params, *, channels: int, size: int, seed: int, steps: int, batch_size: int,
                   lr: float) -> None:
    """Fit ``params`` so that ``decode(z)`` (images ``[n, 3, 2 size, 2 size]`` in [-1, 1]) is the fixed map
    ``tanh(upsample(_LATENT_RGB @ z))`` on random latents z ``[n, channels, size, size]``: any toy VAE,
    whatever its layout (``decode`` adds a frame axis for a video VAE), then draws the same colours.

    The latents are unit Gaussians plus a per-sample offset per channel, so that the decoder sees
    latents of different means (what a policy moves).
    """
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    weight = torch.tensor(_LATENT_RGB)  # [3, C]
    optimizer = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        z = torch.randn(batch_size, channels, size, size, generator=generator)  # [n, C, h, w]
        z = z + 0.5 * torch.randn(batch_size, channels, 1, 1, generator=generator)
        target = torch.tanh(F.interpolate(torch.einsum("rc,nchw->nrhw", weight, z), scale_factor=2, mode="bilinear"))
        loss = (decode(z) - target).square().mean()  # images in [-1, 1], like the VAE's
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def clip_char_tokenizer(model_max_length: int):
    """CLIP's byte-level BPE with every byte (plain and word-final) in the vocabulary and no merges."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in sorted(ByteLevel.alphabet()):  # the 256 characters standing for the bytes
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def t5_char_tokenizer():
    """T5's unigram model over single characters (with and without the word-start mark)."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]  # T5's order: pad, eos, unk
    vocab += [(c, -3.0) for c in _T5_CHARS] + [("\u2581" + c, -2.5) for c in _T5_CHARS]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)
