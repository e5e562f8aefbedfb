"""Toy pipelines, one per model family, built locally from a fixed seed for tests and demos.

``model.name_or_path: tiny`` (or ``tiny-colour``) builds the toy of ``model.family``: the module
``unirl/diffusion/tiny/<family>.py`` and its ``build_tiny_<family>(variant=...)``, found by that
name, so a family's toy is one file here and no list to extend. Toys depend on the family adapters
(the colour warm start encodes prompts through them); the adapters never import a toy.

* ``common.py``: the cache, the character-level tokenizers, the VAE decoder's fit, the variants;
* ``prompts.py``: the demo's "a <colour> <thing>" prompts;
* ``colour.py``: the ``tiny-colour`` variant's warm start of the text encoders;
* ``sd3.py``, ``flux.py``, ...: one family's toy spec and builder each.
"""

from __future__ import annotations

import importlib
from pathlib import Path

#: The toy variants every family's builder takes (``common.variant_spec``).
TOY_VARIANTS = ("tiny", "tiny-colour")


def build_toy(family: str, variant: str) -> Path:
    """Build (or reuse from the cache) the toy pipeline ``variant`` of ``family`` and return its directory."""
    if variant not in TOY_VARIANTS:
        raise ValueError(f"unknown toy model {variant!r}; expected one of {', '.join(TOY_VARIANTS)}")
    try:
        module = importlib.import_module(f"{__name__}.{family}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{family}":
            raise  # the toy exists but imports something missing: that error, not ours
        raise ValueError(f"model.family={family!r} has no toy pipeline (no unirl/diffusion/tiny/{family}.py); "
                         f"give model.name_or_path a checkpoint") from None
    return getattr(module, f"build_tiny_{family}")(variant=variant)
