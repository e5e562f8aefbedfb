"""Image rewards that need no model: JPEG (in)compressibility from DDPO, and the brightness and colour demo rewards.

DDPO (Black et al., 2023, https://arxiv.org/abs/2305.13301) rewards the *file size* of an image
saved as JPEG at quality 95: ``jpeg_incompressibility`` is the size in kilobytes (1 kB = 1000
bytes), ``jpeg_compressibility`` its negation. The scale depends on the resolution: a 512x512 image
of smooth colour is a few kB, a detailed one 50-150 kB; a 32x32 toy image is about 1 kB. The
advantages normalise the scale away within a group.

``brightness`` is a *demo* reward: the mean pixel value in [0, 1]. It is what a toy-size random
model (``unirl/diffusion/tiny/sd3.py``) can move within a few minutes on a CPU, so the tiny config can
show learning; it says nothing about image quality. ``colour_share`` is a demo reward that depends on
the prompt: the share of pixels nearest to the colour the prompt names ("a red cat" -> red), so the
tiny colour demo can show per-prompt groups and advantages at work. ``input_similarity`` is a demo
reward for image editing (a family that takes an input image per prompt, FLUX.1 Kontext): how close
each image is to its input image, pixel by pixel, so the tiny editing demo rewards reading the input.

Image editing rewards see both images: the input image reaches a reward as the ``image`` column, the
path of the row's file (``docs/rewards.md``); ``input_images`` opens them.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

from unirl.rewards.registry import register_reward


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


#: The named colours ``colour_share`` knows, as RGB: the tiny demo's prompt colours ("a red cat").
PALETTE = {
    "red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 160, 50), "yellow": (235, 220, 40),
    "white": (245, 245, 245), "black": (15, 15, 15), "orange": (245, 140, 20), "purple": (130, 40, 170),
}


def named_colour(prompt: str) -> str | None:
    """The first ``PALETTE`` colour named in ``prompt`` (whole words, any case), or None.

    >>> named_colour("a Red cat"), named_colour("a reddish cat"), named_colour("a black and white cat")
    ('red', None, 'black')
    """
    for word in prompt.lower().replace(",", " ").replace(".", " ").split():
        if word in PALETTE:
            return word
    return None


@register_reward("colour_share", modality="image",
                 description="demo: share of pixels nearest to the colour the prompt names (for the tiny model)")
def colour_share(images: Sequence[Any], *, prompts: Sequence[str], **kwargs: Any) -> list[float | None]:
    """Demo reward that depends on the prompt: the share of pixels whose nearest ``PALETTE`` colour
    (Euclidean distance in RGB) is the one the prompt names; None when it names none.

    >>> from PIL import Image
    >>> red, blue = Image.new("RGB", (4, 4), (200, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 200))
    >>> colour_share([red, red, blue], prompts=["a red cat", "a blue cat", "a cat"])
    [1.0, 0.0, None]
    """
    import numpy as np

    palette = np.array(list(PALETTE.values()), dtype=np.float64)  # [K, 3]
    names = list(PALETTE)
    out: list[float | None] = []
    for image, prompt in zip(images, prompts, strict=True):
        colour = named_colour(prompt)
        if colour is None:
            out.append(None)
            continue
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64).reshape(-1, 1, 3)  # [P, 1, 3]
        nearest = np.square(pixels - palette).sum(-1).argmin(-1)  # [P]
        out.append(float((nearest == names.index(colour)).mean()))
    return out


def input_images(paths: Sequence[str], size: tuple[int, int] | None = None) -> list:
    """The input images of an editing run's samples (the ``image`` column: one file path each) as RGB PIL
    images, resized to ``size`` (width, height) when given; a missing column or file is named.

    >>> input_images(None)
    Traceback (most recent call last):
    ...
    ValueError: this reward compares each image with its input image: it needs the 'image' column (a file path per sample), which image-editing families give
    """
    from unirl.image_files import load_rgb

    if paths is None:
        raise ValueError("this reward compares each image with its input image: it needs the 'image' column "
                         "(a file path per sample), which image-editing families give")
    return [load_rgb(path, size) for path in paths]  # a missing, truncated or oversized file is named


@register_reward("input_similarity", modality="image",
                 description="demo (image editing): 1 - mean absolute pixel difference to the input image")
def input_similarity(images: Sequence[Any], *, image: Sequence[str] | None = None, **kwargs: Any) -> list[float]:
    """Demo reward that depends on the input image: ``1 - mean |x - x_in|`` over RGB pixels in [0, 1], the
    input resized to the image's size (1: the input returned unchanged; 0: every channel at the other extreme).

    >>> import tempfile, os
    >>> from PIL import Image
    >>> path = os.path.join(tempfile.mkdtemp(), "red.png"); Image.new("RGB", (8, 8), (255, 0, 0)).save(path)
    >>> input_similarity([Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 0))], image=[path, path])
    [1.0, 0.6666666666666667]
    """
    import numpy as np

    references = input_images(image, images[0].size if len(images) else None)  # a batch shares one size
    out = []
    for sample, reference in zip(images, references, strict=True):
        diff = np.abs(np.asarray(sample.convert("RGB"), dtype=np.float64) - np.asarray(reference, dtype=np.float64))
        out.append(float(1.0 - diff.mean() / 255.0))
    return out
