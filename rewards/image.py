"""Image rewards that need no model: JPEG (in)compressibility from DDPO, and a brightness demo reward.

DDPO (Black et al., 2023, https://arxiv.org/abs/2305.13301) rewards the *file size* of an image
saved as JPEG at quality 95: ``jpeg_incompressibility`` is the size in kilobytes (1 kB = 1000
bytes), ``jpeg_compressibility`` its negation. The scale depends on the resolution: a 512x512 image
of smooth colour is a few kB, a detailed one 50-150 kB; a 32x32 toy image is about 1 kB. The
advantages normalise the scale away within a group.

``brightness`` is a *demo* reward: the mean pixel value in [0, 1]. It is what a toy-size random
model (``unirl/diffusion/tiny.py``) can move within a few minutes on a CPU, so the tiny config can
show learning; it says nothing about image quality.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

from rewards.registry import register_reward


def jpeg_size_kb(image, quality: int = 95) -> float:
    """Size in kB (1000 bytes) of ``image`` saved as an RGB JPEG at ``quality``.

    >>> from PIL import Image
    >>> jpeg_size_kb(Image.new("RGB", (64, 64), "gray")) < jpeg_size_kb(Image.effect_noise((64, 64), 64))
    True
    """
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


@register_reward("jpeg_incompressibility", modality="image",
                 description="DDPO: JPEG size (kB, quality 95); rewards detail")
def jpeg_incompressibility(images: Sequence[Any], *, quality: int = 95, **kwargs: Any) -> list[float]:
    """DDPO's incompressibility: the JPEG size in kB at ``quality`` (larger = more detail)."""
    return [jpeg_size_kb(image, quality) for image in images]


@register_reward("jpeg_compressibility", modality="image",
                 description="DDPO: minus the JPEG size (kB, quality 95); rewards simple images")
def jpeg_compressibility(images: Sequence[Any], *, quality: int = 95, **kwargs: Any) -> list[float]:
    """DDPO's compressibility: minus the JPEG size in kB at ``quality`` (closer to 0 = simpler image).

    >>> from PIL import Image
    >>> jpeg_compressibility([Image.new("RGB", (64, 64), "gray")])[0] > -1.0
    True
    """
    return [-jpeg_size_kb(image, quality) for image in images]


@register_reward("brightness", modality="image",
                 description="demo: mean pixel value in [0, 1] (for the tiny model)")
def brightness(images: Sequence[Any], **kwargs: Any) -> list[float]:
    """Demo reward: the mean of all RGB pixel values, scaled to [0, 1] (black 0, white 1).

    >>> from PIL import Image
    >>> brightness([Image.new("RGB", (8, 8), "black"), Image.new("RGB", (8, 8), "white"), Image.new("RGB", (8, 8), (255, 0, 0))])
    [0.0, 1.0, 0.3333333333333333]
    """
    import numpy as np

    return [float(np.asarray(image.convert("RGB"), dtype=np.float64).mean() / 255.0) for image in images]
