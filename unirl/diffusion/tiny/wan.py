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
(``common.t5_char_tokenizer``). The weights are random except the VAE decoder's, which gets a fit
(``fit_video_decoder``) so that a latent's per-channel mean sets each frame's colour, as the image toys'
decoders are fit (``common.fit_decoder``): a demo reward such as ``brightness`` can then be moved. It is
the slow part of the build (300 steps, about 85 s on a busy 2-core machine; cached afterwards).
"""

from __future__ import annotations

from pathlib import Path

import torch

from unirl.models.cache import default_cache_dir
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
    "vae": dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]),
    "umt5": dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8),
    # The tokenizer's model_max_length: the colour warm start encodes its prompts at that length, so 16
    # as the other toys' CLIP context (T5's 512 made the warm start take minutes).
    "tokenizer_max_length": 16,
    "scheduler": dict(num_train_timesteps=1000, shift=3.0),
    # A random Wan decoder draws every latent as the same flat colour (the brightness of its videos
    # varied by 0.0002 across random latents), so no demo reward could be learnt; this fit makes a
    # latent's per-channel mean set each frame's colour. Fit on 2x2 latents (4x cheaper than the
    # config's 4x4), it carries over: on held-out 4x4 latents the decoded brightness correlates 0.90
    # with the target's (std 0.19). Per-pixel targets, batches of 4 or 80-200 steps did not take (r <= 0.35).
    "decoder_fit": dict(steps=300, batch_size=8, lr=1e-2, latent_frames=2, side=2, spatial_noise=0.3),
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
        tokenizer.model_max_length = TINY_WAN_SPEC["tokenizer_max_length"]

        # 2. Models, each from its own seed.
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id, **TINY_WAN_SPEC["umt5"]))
        torch.manual_seed(seed + 1)
        transformer = WanTransformer3DModel(**TINY_WAN_SPEC["transformer"])
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLWan(**TINY_WAN_SPEC["vae"])
        fit_video_decoder(vae, seed=seed + 3, **TINY_WAN_SPEC["decoder_fit"])
        scheduler = FlowMatchEulerDiscreteScheduler(**TINY_WAN_SPEC["scheduler"])

        # 3. Save as a pipeline directory (after the warm start of the colour variant).
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                           transformer=transformer)
        if "warm_start" in spec:
            from unirl.diffusion.tiny.colour import warm_start_text_encoders

            warm_start_text_encoders(pipe, "wan", seed=seed + 4, **spec["warm_start"])
        pipe.save_pretrained(directory)

    return cached_build(directory, spec, _MARKER, build)


#: Rows: R, G, B; columns: the first 4 of the 16 latent channels (the image toys' map, ``common._LATENT_RGB``).
_LATENT_RGB = [[0.8, 0.3, -0.2, 0.1], [0.2, 0.8, 0.3, -0.1], [-0.1, 0.2, 0.8, 0.3]]


def fit_video_decoder(vae, *, seed: int, steps: int, batch_size: int, lr: float, latent_frames: int, side: int,
                      spatial_noise: float) -> None:
    """Fit the Wan VAE's decoder so that a pipeline latent z decodes, frame by frame, to the flat colour
    ``tanh(_LATENT_RGB @ mean(z[:4]))``, the mean over the latent frame's positions: latent frame 0
    gives video frame 0 and latent frame k >= 1 the 4 frames ``4k - 3 .. 4k`` (the causal VAE's layout).

    The latents are a unit Gaussian per sample and channel plus ``spatial_noise`` times a Gaussian per
    position, so the decoder sees latents of many means (what a policy moves); it is fed what the
    pipeline decodes, ``z * latents_std + latents_mean``. The encoder stays random: FlowGRPO never encodes."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.zeros(3, vae.config.z_dim)
    weight[:, :4] = torch.tensor(_LATENT_RGB)  # [3, C]
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean, std = torch.tensor(vae.config.latents_mean).view(shape), torch.tensor(vae.config.latents_std).view(shape)
    repeats = torch.tensor([1] + [vae.config.scale_factor_temporal] * (latent_frames - 1))  # pixel frames per latent frame
    pixels = side * vae.config.scale_factor_spatial
    optimizer = torch.optim.Adam(vae.decoder.parameters(), lr=lr)
    for _ in range(steps):
        z = spatial_noise * torch.randn(batch_size, vae.config.z_dim, latent_frames, side, side, generator=generator)
        z = z + torch.randn(batch_size, vae.config.z_dim, 1, 1, 1, generator=generator)  # [n, C, f, h, w]
        colour = torch.tanh(torch.einsum("rc,ncf->nrf", weight, z.mean((-2, -1))))  # [n, 3, f]
        target = colour.repeat_interleave(repeats, dim=2)[..., None, None].expand(-1, -1, -1, pixels, pixels)
        video = vae.decode(z * std + mean, return_dict=False)[0]  # [n, 3, frames, H, W] in [-1, 1]
        loss = (video - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vae.requires_grad_(True).zero_grad(set_to_none=True)
