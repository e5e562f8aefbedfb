"""The model-family seam: only the adapters name a family; the rest reads their capabilities.

No pipeline is loaded here: these tests register stand-in adapters and check what the config, the
data loader, the sampler and the toy lookup make of them, and read the sources for the import
direction (toys depend on the adapters, never the reverse) and for comparisons with a family name.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from unirl.config import ConfigError, load_config
from unirl.diffusion import families
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.prompts import load_prompt_rows
from unirl.diffusion.families import FAMILIES, ModelFamily
from unirl.diffusion.sampling import guided_velocity
from unirl.diffusion.tiny import build_toy

UNIRL = Path(__file__).resolve().parents[1] / "unirl"


class _Video(ModelFamily):
    """A stand-in adapter with every non-default capability; the methods are never called here."""

    name, title, pipeline_class_name = "video-x", "Video X", "VideoXPipeline"
    guidance_mode, conditioning_image, frames = "distilled", True, True

    latent_shape = schedule = encode = velocity = decode = None



@pytest.fixture
def video_family(monkeypatch):
    monkeypatch.setattr(FAMILIES, "_items", {**FAMILIES._items, _Video.name: _Video})
    return _Video


def test_the_config_accepts_a_registered_family_and_lists_them_on_a_typo(video_family):
    cfg = load_config(DiffusionConfig, None, ["model.family=video-x", "sampling.guidance_scale=1", "sampling.num_frames=9"])
    assert cfg.model.family == "video-x" and cfg.sampling.num_frames == 9
    available = ", ".join(sorted(FAMILIES))  # every registered family, the stand-in among them
    assert "video-x" in available
    with pytest.raises(ConfigError, match=rf"model: unknown model family 'vidieo-x'.*Available: {available}"):
        load_config(DiffusionConfig, None, ["model.family=vidieo-x"])


@pytest.mark.parametrize("overrides, match", [
    (["model.family=video-x"], r"sampling.guidance_scale=4.5: Video X is guidance-distilled"),
    (["sampling.num_frames=9"], r"sampling.num_frames=9: Stable Diffusion 3 makes images, not videos"),
    (["sampling.num_frames=0"], r"num_frames must be >= 1"),
])
def test_the_config_reads_the_capabilities(video_family, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DiffusionConfig, None, overrides)


def test_the_sampler_refuses_cfg_for_a_family_without_it(video_family):
    latents = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="guidance_scale=4.5: Video X takes no classifier-free guidance"):
        guided_velocity(_Video(), torch.nn.Identity(), latents, torch.ones(1), {}, 4.5)


def test_a_family_with_a_conditioning_image_needs_one_per_row(tmp_path):
    from PIL import Image

    Image.new("RGB", (2, 2), "red").save(tmp_path / "cat.png")  # a real image: the rows' images are decoded at load
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in [{"prompt": "make it red", "image": "cat.png"}]))
    rows = load_prompt_rows(str(good), "train", image=True)
    assert rows == [{"prompt": "make it red", "image": str(tmp_path / "cat.png")}]  # read beside the file
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in [{"prompt": "a", "image": "cat.png"}, {"prompt": "b", "image": "dog.png"}]))
    with pytest.raises(ValueError, match=r"bad.jsonl, row 2: .*'image' naming an existing file; got 'dog.png'"):
        load_prompt_rows(str(bad), "train", image=True)
    with pytest.raises(ValueError, match=r"row 1: .*got None"):
        load_prompt_rows("tiny", "test", image=True)
    assert load_prompt_rows(str(bad), "train") == [{"prompt": "a", "image": "cat.png"}, {"prompt": "b", "image": "dog.png"}]


def test_a_family_without_a_toy_is_named():
    with pytest.raises(ValueError, match=r"model.family='video-x' has no toy pipeline \(no unirl/diffusion/tiny/video-x.py\)"):
        build_toy("video-x", "tiny")
    with pytest.raises(ValueError, match="unknown toy model 'tiny-red'"):
        build_toy("sd3", "tiny-red")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_adapters_never_import_a_toy_or_the_loader():
    sources = sorted((UNIRL / "diffusion" / "families").glob("*.py"))
    assert len(sources) >= 4
    for path in sources:
        bad = {m for m in _imports(path) if m.startswith(("unirl.diffusion.tiny", "unirl.diffusion.pipeline",
                                                         "unirl.diffusion.env", "unirl.diffusion.config"))}
        assert not bad, (path.name, bad)


def test_no_code_outside_the_adapters_and_toys_compares_with_a_family_name():
    """``family == "flux"`` style checks are what the capabilities replace."""
    names = set(families.FAMILIES)
    found = []
    for path in UNIRL.rglob("*.py"):
        if {"families", "tiny"} & set(path.relative_to(UNIRL).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                found += [f"{path.name}:{node.lineno}" for c in constants if c.value in names]
    assert not found
