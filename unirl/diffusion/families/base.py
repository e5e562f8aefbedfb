"""The seam between the FlowGRPO environment and one model family (SD3, FLUX.1, ...).

What differs between flow-matching text-to-image families sits behind ``ModelFamily``: which
diffusers pipeline loads the checkpoint, how prompts become conditioning tensors, the shape of the
latent the transformer denoises (SD3: ``[C, h, w]``; FLUX: 2x2 patches packed into ``[h/2 * w/2, 4C]``),
the sigma schedule (SD3: a fixed shift; FLUX: a shift ``mu`` that grows with the image's token count),
one transformer forward giving the velocity, and decoding to pixels. The sampler
(``unirl.diffusion.sampling``), the SDE step (``unirl.diffusion.sde``), the environment and the loop
never branch on the family: what they must know (the kind of guidance, a conditioning image, a frame
axis) the adapter says in attributes. A third family (Qwen-Image, SANA, a video model) is one new file
in this package, one line registering it in ``__init__.py``, and a toy in ``unirl/diffusion/tiny/``.

Conditioning is a dict of per-sample tensors (leading dimension n) named by ``cond_keys``, so the
environment can repeat them per group, store them in a rollout, slice micro-batches and concatenate a
negative prompt for classifier-free guidance without knowing what they are.

Shapes: n samples, latents ``[n, *latent_shape]``, L text tokens.
"""

from __future__ import annotations

import warnings
import weakref
from abc import ABC, abstractmethod

import numpy as np
import torch


class ModelFamily(ABC):
    """One family's components behind a common interface; instances are cheap and stateless."""

    #: ``model.family`` in the config.
    name: str = ""
    #: The family as people name it, in messages (``FLUX.1``).
    title: str = ""
    #: The diffusers pipeline class that loads the checkpoint (``model_index.json``'s ``_class_name``).
    pipeline_class_name: str = ""
    #: Keys of the conditioning dict ``encode`` returns (each ``[n, ...]``).
    cond_keys: tuple[str, ...] = ()

    # Capabilities: what the config, the data loader and the sampler read instead of the family's name.
    #: ``"cfg"``: classifier-free guidance with ``negative_prompt`` as the negative (``sampling.guidance_scale``);
    #: ``"distilled"``: the transformer embeds a guidance value itself (``sampling.distilled_guidance``,
    #: read by the adapter) and ``sampling.guidance_scale`` must be 1.
    guidance_mode: str = "cfg"
    #: The negative prompt of classifier-free guidance, encoded once per run.
    negative_prompt: str = ""
    #: Whether each prompt comes with a conditioning image (image editing): every data row then names
    #: one in its ``image`` field.
    conditioning_image: bool = False
    #: Whether a sample is a video (latents with a frame axis): only then may ``sampling.num_frames`` exceed 1.
    frames: bool = False

    @classmethod
    def from_config(cls, cfg) -> "ModelFamily":
        """The adapter for a ``DiffusionConfig`` (a family with settings of its own reads them here)."""
        return cls()

    def pipeline_class(self):
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    @abstractmethod
    def latent_shape(self, pipe, resolution: int) -> tuple[int, ...]:
        """Per-sample shape of the latent the transformer denoises at ``resolution`` px; raises on a bad resolution."""

    @abstractmethod
    def schedule(self, scheduler, num_steps: int, latent_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas [S + 1] ending in 0, timesteps [S])`` as the family's pipeline sets them for S steps."""

    @abstractmethod
    def encode(self, pipe, prompts: list[str], *, max_sequence_length: int, device) -> dict[str, torch.Tensor]:
        """Conditioning ``{key: [n, ...]}`` for ``prompts`` (keys ``cond_keys``); differentiable in the
        text encoders (the environment calls it under ``torch.no_grad``, the toy warm start does not)."""

    def encode_images(self, pipe, images: list[str], *, resolution: int, device) -> dict[str, torch.Tensor]:
        """Conditioning ``{key: [n, ...]}`` (keys among ``cond_keys``) from each prompt's input image, a file
        path, for a family with ``conditioning_image``; the environment adds it to ``encode``'s. Others have none."""
        return {}

    @abstractmethod
    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """One forward: the velocity ``[n, *latent_shape]`` at ``latents`` and the scheduler's ``timestep`` [n]
        (``sigma * num_train_timesteps``), in the transformer's dtype."""

    @abstractmethod
    def decode(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        """Images ``[n, 3, H, W]`` in [0, 1] (float32, CPU) from latents ``[n, *latent_shape]``; videos
        ``[n, frames, 3, H, W]`` for a family with ``frames``."""

    def combine_guidance(self, v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance ``v_u + g (v_c - v_u)`` (https://arxiv.org/abs/2207.12598); a family
        whose pipeline combines the two velocities otherwise overrides it."""
        return v_uncond + scale * (v_cond - v_uncond)

    def noise(self, n: int, latent_shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """Initial noise ``[n, *latent_shape]`` (standard normal, drawn on the CPU from ``generator``)."""
        return torch.randn((n, *latent_shape), generator=generator)


def vae_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Images ``[n, 3, H, W]`` in [0, 1] (float32, CPU) from VAE latents ``[n, C, h, w]``, undoing the
    pipeline's ``scaling_factor`` and ``shift_factor`` (SD3 and FLUX both normalise latents this way)."""
    scaled = latents / vae.config.scaling_factor + vae.config.shift_factor
    images = vae.decode(cast(scaled, compute_dtype(vae)), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1).cpu()


def check_resolution(resolution: int, factor: int) -> None:
    if resolution % factor:
        raise ValueError(f"sampling.resolution={resolution} must be a multiple of {factor} for this model")


_first_parameters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its first parameter


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first parameter: what a family casts the transformer's inputs to.

    The parameter is looked up once per module (``next(module.parameters())`` walks submodules, ~10 us
    at each of a step's forwards otherwise) and its dtype read at every call: ``module.to(dtype)``
    converts parameters in place, keeping the same ``Parameter`` objects, so the answer follows it
    (tested)."""
    param = _first_parameters.get(module)
    if param is None:
        param = _first_parameters[module] = next(module.parameters())
    return param.dtype


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the call when ``t`` has it already (the usual case at every forward:
    ``.to`` parses its arguments before finding nothing to do, ~5 us a call inside a training step)."""
    return t if t.dtype == dtype else t.to(dtype)


_warned: set[tuple[str, int]] = set()


def tokenize(tokenizer, prompts: list[str], max_length: int, encoder: str, add_special_tokens: bool = True) -> torch.Tensor:
    """Token ids ``[n, max_length]``, padded and cut to ``max_length`` as diffusers' pipelines tokenize
    for their text encoders, once (the pipelines tokenize every prompt a second time, untruncated, only
    to log what was cut). A prompt that fills every position, and so may have been cut, is warned
    about once per run and ``encoder``/length.

    A fast tokenizer's ``tokenizers`` backend is called directly, through a copy set up once to pad
    and cut as ``tokenizer(prompts, padding="max_length", truncation=True, max_length=max_length)``
    sets the tokenizer's own backend at every call: the same ids (tested against that call) without
    ~0.4 ms of ``transformers`` Python per call, three calls a rollout for SD3. Other tokenizers are
    called as they are."""
    backend = _padded_backend(tokenizer, max_length)
    if backend is None:
        tokens = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt",
                           add_special_tokens=add_special_tokens)
        ids, filled = tokens.input_ids, bool(tokens.attention_mask[:, -1].any())
    else:
        # One prompt at a time: encode_batch spreads a batch over a thread pool, whose threads competed
        # with torch's for the cores (0.8 ms a call inside a training step against 0.3 ms alone).
        encodings = [backend.encode(p, add_special_tokens=add_special_tokens) for p in prompts]
        # Through numpy: torch.tensor walks nested lists of Python ints about 3x slower.
        ids = torch.from_numpy(np.array([e.ids for e in encodings], dtype=np.int64)).reshape(len(prompts), max_length)
        filled = any(e.attention_mask[-1] for e in encodings)
    if (encoder, max_length) not in _warned and filled:
        _warned.add((encoder, max_length))
        warnings.warn(f"some prompts fill {encoder}'s {max_length} tokens and may have been truncated there "
                      f"(said once per run)", stacklevel=3)
    return ids


_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {settings: backend copy}


def _padded_backend(tokenizer, max_length: int):
    """A copy of ``tokenizer``'s ``tokenizers`` backend that pads and cuts to ``max_length`` (the
    settings ``transformers`` gives its own backend for ``padding="max_length", truncation=True``), or
    None when the tokenizer has no such backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or tokenizer.pad_token is None:  # the tokenizer's own call says what is missing
        return None
    # Rebuilt when the tokenizer changes in a way the copy would miss (tokens added, e.g. by textual
    # inversion; another pad token or side).
    key = (max_length, len(tokenizer), tokenizer.pad_token_id, tokenizer.padding_side, tokenizer.truncation_side,
           getattr(tokenizer, "split_special_tokens", False), getattr(tokenizer, "add_bos_token", None),
           getattr(tokenizer, "add_eos_token", None))
    per_length = _backends.setdefault(tokenizer, {})
    if key not in per_length:
        from tokenizers import Tokenizer

        try:
            copy = Tokenizer.from_str(backend.to_str())
        except Exception:  # e.g. a custom Python pre-tokenizer does not serialise: the tokenizer's own call
            per_length[key] = None
            return None
        copy.enable_truncation(max_length=max_length, stride=0, strategy="longest_first",
                               direction=tokenizer.truncation_side)
        copy.enable_padding(length=max_length, direction=tokenizer.padding_side, pad_id=tokenizer.pad_token_id,
                            pad_token=tokenizer.pad_token, pad_type_id=tokenizer.pad_token_type_id)
        copy.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        per_length[key] = copy
    return per_length[key]
