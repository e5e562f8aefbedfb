"""Loading a model family's diffusers pipeline: the checkpoint it names, checked, with its frozen parts on the device.

``model.name_or_path`` is a toy name (``tiny``, ``tiny-colour``: the family's toy, built locally,
``unirl.diffusion.tiny``), a local pipeline directory or a hub name. The family's adapter says
which diffusers class loads it; a local directory saved by another family's pipeline fails here with
both names instead of deep inside diffusers. Every component but the transformer (text encoders,
VAE) is frozen and moved to the device; the environment decides how the transformer trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from unirl.diffusion.families import ModelFamily
from unirl.diffusion.tiny import TOY_VARIANTS, build_toy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name_or_path: str, family: ModelFamily) -> str:
    """A toy name -> the family's locally built toy pipeline (cached); anything else is passed through."""
    if name_or_path in TOY_VARIANTS:
        return str(build_toy(family.name, name_or_path))
    return name_or_path


def check_pipeline_class(path: str, family: ModelFamily) -> None:
    """A local pipeline directory of another family fails here with both names, not deep inside diffusers."""
    index = Path(path) / "model_index.json"
    if not index.exists():
        return  # a hub name: from_pretrained resolves it
    found = json.loads(index.read_text()).get("_class_name")
    if found and found != family.pipeline_class_name:
        raise ValueError(f"model.family={family.name!r} expects a {family.pipeline_class_name}, but {path} holds a "
                         f"{found}; set model.family to the checkpoint's family")


def load_pipeline(name_or_path: str, family: ModelFamily, dtype: str, device) -> tuple[object, str]:
    """``(pipeline, its path)``: the family's pipeline class loaded from ``name_or_path`` in ``dtype``
    (a ``model.dtype`` name), every component but the transformer frozen in eval mode on ``device``."""
    # Building a toy pipeline seeds torch's global generator; without the fork a run that builds it
    # (an empty cache) would initialise its LoRA differently from one that finds it built.
    with torch.random.fork_rng(devices=[]):
        path = resolve_model_path(name_or_path, family)
    check_pipeline_class(path, family)
    pipe = family.pipeline_class().from_pretrained(path, dtype=DTYPES[dtype])
    for name, module in pipe.components.items():
        if name != "transformer" and isinstance(module, torch.nn.Module):
            module.requires_grad_(False).eval().to(device)
    return pipe, path
