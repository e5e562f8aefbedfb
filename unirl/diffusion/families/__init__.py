"""Per-family adapters (``ModelFamily``): what differs between SD3, FLUX.1, ... behind one interface.

``model.family`` in a diffusion config names one of ``FAMILIES``; ``family_for(cfg)`` builds it. To add
a family, write ``families/<name>.py`` with a ``ModelFamily`` subclass and register it here.
"""

from __future__ import annotations

from unirl.diffusion.families.base import ModelFamily
from unirl.diffusion.families.flux import FluxFamily
from unirl.diffusion.families.flux_kontext import FluxKontextFamily
from unirl.diffusion.families.qwenimage import QwenImageFamily
from unirl.diffusion.families.sd3 import SD3Family
from unirl.diffusion.families.wan import WanFamily
from unirl.registry import Registry

FAMILIES: Registry[type[ModelFamily]] = Registry("model family")
FAMILIES.add(SD3Family.name, SD3Family)
FAMILIES.add(FluxFamily.name, FluxFamily)
FAMILIES.add(WanFamily.name, WanFamily)
FAMILIES.add(QwenImageFamily.name, QwenImageFamily)
FAMILIES.add(FluxKontextFamily.name, FluxKontextFamily)


def family_for(cfg) -> ModelFamily:
    """The adapter of ``cfg.model.family`` (a ``DiffusionConfig``), with its family-specific settings."""
    return FAMILIES.get(cfg.model.family).from_config(cfg)


__all__ = ["FAMILIES", "FluxFamily", "ModelFamily", "SD3Family", "WanFamily", "family_for"]
