"""Image files a run reads (an editing family's input images, a reward's ``image`` column), opened so that a
bad file is one error naming it: not found, not an image, truncated or corrupt, or a header claiming more
pixels than PIL's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, 89 million: an image that
large is an attack or a mistake, never an input to resize to a training resolution).

``check_image_file`` is the dry run's check: the header and the file's structure (PNG chunk checksums)
are read, the pixels are not decoded.
"""

from __future__ import annotations

from pathlib import Path


def check_image_file(path: str | Path) -> None:
    """Raise ``ValueError`` naming ``path`` unless it is a readable, complete image of a sane size."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            _check_size(image, path)
            image.verify()  # structure and checksums, no decoding
    except ValueError:
        raise
    except (OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise ValueError(_message(path, err)) from None


def load_rgb(path: str | Path, size: tuple[int, int] | None = None):
    """The image at ``path`` as RGB PIL, resized to ``size`` (width, height) when given and different;
    a bad file raises ``ValueError`` naming it."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            _check_size(image, path)
            rgb = image.convert("RGB")  # decodes: a truncated file fails here
    except ValueError:
        raise
    except (OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise ValueError(_message(path, err)) from None
    return rgb.resize(size, Image.BICUBIC) if size is not None and rgb.size != tuple(size) else rgb


def _check_size(image, path) -> None:
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and image.width * image.height > limit:
        raise ValueError(f"image file {path}: its header says {image.width}x{image.height} pixels, over PIL's "
                         f"limit of {limit} (a decompression bomb, or the wrong file)")


def _message(path, err: BaseException) -> str:
    from PIL import Image

    if isinstance(err, FileNotFoundError):
        return f"image file {path} does not exist"
    if isinstance(err, Image.DecompressionBombError):
        return f"image file {path}: {err}"
    if isinstance(err, Image.UnidentifiedImageError):
        return f"image file {path} is not an image PIL can read"
    return f"image file {path} is truncated or corrupt ({type(err).__name__}: {err})"
