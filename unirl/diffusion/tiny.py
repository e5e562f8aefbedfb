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

import hashlib
import json
import shutil
from pathlib import Path

import torch

from unirl.cache import default_cache_dir

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
    "vae": dict(
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
        scaling_factor=1.5305,  # SD3's values
        shift_factor=0.0609,
    ),
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

# Rows: R, G, B; columns: the 4 latent channels. The decoder is fit to tanh(upsample(_LATENT_RGB @ z)).
_LATENT_RGB = [[0.8, 0.3, -0.2, 0.1], [0.2, 0.8, 0.3, -0.1], [-0.1, 0.2, 0.8, 0.3]]

_MARKER = "unirl_tiny_sd3.json"
# Characters the T5 vocabulary knows (others map to <unk>); CLIP's byte-level BPE knows every byte.
_T5_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"-+*/=()&#%$@"


def build_tiny_sd3(directory: str | Path | None = None, seed: int = 0, variant: str = "tiny") -> Path:
    """Build (or reuse) the toy SD3 pipeline in ``directory`` and return its path.

    ``variant``: ``tiny`` (random weights) or ``tiny-colour`` (the same, then the text encoders' short
    warm start of ``unirl/diffusion/tiny_colour.py``). ``directory`` defaults to
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
            from unirl.diffusion.tiny_colour import warm_start_text_encoders

            warm_start_text_encoders(pipe, "sd3", seed=seed + 6, **spec["warm_start"])
        pipe.save_pretrained(directory)

    return cached_build(directory, spec, _MARKER, build)


def variant_spec(base: dict, variant: str, seed: int) -> tuple[dict, str]:
    """The cache spec of a toy ``variant`` and its directory-name infix. ``tiny`` keeps the plain spec
    (so its cache key never changes when variants are added)."""
    if variant == "tiny":
        return {"seed": seed, **base}, ""
    if variant == "tiny-colour":
        from unirl.diffusion.tiny_colour import COLOUR_WARM_START

        return {"seed": seed, **base, "warm_start": COLOUR_WARM_START}, "-colour"
    raise ValueError(f"unknown toy model {variant!r}; expected 'tiny' or 'tiny-colour'")


def cached_build(directory: Path, spec: dict, marker_name: str, build) -> Path:
    """``build(directory)`` unless ``directory`` already holds this ``spec``'s build; returns ``directory``.

    A marker file holding the hash of ``spec`` is written last; a directory with a matching marker is
    returned at once, anything else (stale or half-written) is removed and rebuilt from scratch.
    """
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    marker = directory / marker_name
    if marker.exists() and json.loads(marker.read_text()).get("digest") == digest:
        return directory
    if directory.exists():
        shutil.rmtree(directory)
    # The builds seed the global RNG; a run that builds (a cold cache) must draw the same afterwards
    # as one that finds the build, so they run in a fork of the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        build(directory)
    marker.write_text(json.dumps({"digest": digest, "spec": spec}, indent=1))
    return directory


def fit_decoder(vae, *, seed: int, steps: int, batch_size: int, lr: float, through_scaling: bool = False) -> None:
    """Fit the VAE decoder to the fixed map ``tanh(upsample(_LATENT_RGB @ z))`` on random latents z.

    The latents are unit Gaussians plus a per-sample offset per channel, so that the decoder sees
    latents of different means (what a policy moves). ``through_scaling``: the decoder is fed
    ``z / scaling_factor + shift_factor``, what a pipeline decodes, so that a pipeline latent z maps to
    that colour whatever the VAE's scaling (the toy FLUX, whose FLUX scaling 0.3611 would otherwise
    push latents far outside the fit); the toy SD3 was fit on z itself (False, kept so its weights and
    cache key stay as they were). The encoder stays random: FlowGRPO never encodes.
    """
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    weight = torch.tensor(_LATENT_RGB)  # [3, C]
    channels, size = vae.config.latent_channels, vae.config.sample_size // 2
    optimizer = torch.optim.Adam(vae.decoder.parameters(), lr=lr)
    for _ in range(steps):
        z = torch.randn(batch_size, channels, size, size, generator=generator)  # [n, C, h, w]
        z = z + 0.5 * torch.randn(batch_size, channels, 1, 1, generator=generator)
        target = torch.tanh(F.interpolate(torch.einsum("rc,nchw->nrhw", weight, z), scale_factor=2, mode="bilinear"))
        fed = z / vae.config.scaling_factor + vae.config.shift_factor if through_scaling else z
        loss = (vae.decoder(fed) - target).square().mean()  # images in [-1, 1], like the VAE's
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vae.requires_grad_(True).zero_grad(set_to_none=True)


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


# Prompts of the tiny demo: built in code, so the demo needs no data file. The toy model's text
# encoders are random, so the words matter only as distinct conditionings.
TINY_COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
TINY_THINGS = ["cat", "house", "tree", "car", "boat", "flower", "bird", "lamp"]


def tiny_prompts(split: str = "train") -> list[str]:
    """The tiny demo's prompts: 56 ``"a <colour> <thing>"`` prompts for ``train``, 8 held out for ``test``.

    >>> tiny_prompts("test")[:2]
    ['a red cat', 'a blue house']
    >>> len(tiny_prompts("train")), len(set(tiny_prompts("train")) & set(tiny_prompts("test")))
    (56, 0)
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pairs = [(c, t) for c in TINY_COLOURS for t in TINY_THINGS]  # 64
    held_out = {(TINY_COLOURS[i], TINY_THINGS[i]) for i in range(len(TINY_COLOURS))}  # the diagonal, 8
    chosen = [p for p in pairs if (p in held_out) == (split == "test")]
    if split == "test":
        chosen.sort(key=lambda p: TINY_COLOURS.index(p[0]))
    return [f"a {c} {t}" for c, t in chosen]
