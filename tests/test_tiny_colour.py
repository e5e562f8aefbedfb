"""The prompt-dependent tiny demo: the text encoders' colour warm start and the run it makes learnable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unirl
from unirl.rewards.image import colour_share
from unirl.diffusion.families import FAMILIES
from unirl.diffusion.tiny.sd3 import build_tiny_sd3


def test_warm_start_makes_the_conditioning_name_the_colour():
    from diffusers import StableDiffusion3Pipeline

    plain, colour = build_tiny_sd3(), build_tiny_sd3(variant="tiny-colour")
    # Only the text encoders changed: the transformer and the VAE are the toy's own.
    for part in ("transformer", "vae"):
        a = load_file(next((Path(plain) / part).glob("*.safetensors")))
        b = load_file(next((Path(colour) / part).glob("*.safetensors")))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    family = FAMILIES.get("sd3")()
    # Held-out prompts (colour/thing pairs the warm start never saw): same colour, different things.
    prompts = ["a red cat", "a red lamp", "a blue cat", "a blue lamp"]
    for path, meaningful in ((plain, False), (colour, True)):
        pipe = StableDiffusion3Pipeline.from_pretrained(path)
        with torch.no_grad():
            pooled = family.encode(pipe, prompts, max_sequence_length=16, device="cpu")["pooled"]  # [4, P]
        d = torch.cdist(pooled, pooled)
        same, other = (d[0, 1] + d[2, 3]) / 2, (d[0, 2] + d[1, 3]) / 2
        # After the warm start a thing changes the conditioning far less than a colour does.
        assert (same < 0.3 * other) == meaningful, (path, float(same), float(other))


def test_colour_share_scores_each_prompt_by_its_own_colour():
    from PIL import Image

    half = Image.new("RGB", (4, 4), (220, 30, 30))
    half.paste((30, 60, 220), (0, 0, 4, 2))  # top half blue, bottom half red
    assert colour_share([half] * 3, prompts=["a red cat", "a blue cat", "a green cat"]) == [0.5, 0.5, 0.0]


@pytest.mark.slow
def test_tiny_colour_run_learns(tmp_path):
    run = tmp_path / "run"
    unirl.train("diffusion", "tiny_colour", output_dir=run, progress=False)  # in this process: the CLI's own path (unirl.train), without a second Python and torch start-up
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 100 and sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.1, rewards
    evals = [r for r in rows if "eval/reward" in r]
    assert evals[-1]["eval/reward"] - evals[0]["eval/reward"] >= 0.1
