"""Off-target figures (``unirl/diffusion/offtarget.py``): the image statistics and the diversity against
values computed by hand on small images, and a tiny run that logs every ``offtarget/*`` key, with
``unirl plot`` drawing them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from unirl.diffusion.offtarget import diversity, image_statistics, pil_to_tensor, pooled


def test_image_statistics_by_hand():
    black = torch.zeros(3, 2, 2)
    # white, black / pure red, mid grey: lumas 1, 0, 0.299, 0.5 (Rec. 601: 0.299 R + 0.587 G + 0.114 B).
    mixed = torch.tensor([[[1.0, 0.0], [1.0, 0.5]], [[1.0, 0.0], [0.0, 0.5]], [[1.0, 0.0], [0.0, 0.5]]])
    stats = image_statistics(torch.stack([black, mixed]))
    torch.testing.assert_close(stats["brightness"], torch.tensor([0.0, (1 + 0 + 0.299 + 0.5) / 4]))
    torch.testing.assert_close(stats["dark_frac"], torch.tensor([1.0, 0.25]))  # luma < 0.05
    torch.testing.assert_close(stats["blown_frac"], torch.tensor([0.0, 0.25]))  # luma > 0.95
    # A video [N, F, 3, H, W]: its frames' pixels together (one black frame, one white: half dark, half blown).
    video = torch.stack([torch.zeros(3, 2, 2), torch.ones(3, 2, 2)]).unsqueeze(0)
    stats = image_statistics(video)
    assert stats["brightness"].item() == pytest.approx(0.5)
    assert stats["dark_frac"].item() == stats["blown_frac"].item() == 0.5
    with pytest.raises(ValueError, match=r"\[N, \.\.\., 3, H, W\]"):
        image_statistics(torch.zeros(2, 4, 2, 2))


def test_diversity_by_hand():
    d = 12
    zeros, ones, half = torch.zeros(d), torch.ones(d), torch.full((d,), 0.5)
    features = torch.stack([zeros, ones, zeros, zeros, half, ones])
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    # Group 0: one pair at RMS distance 1. Group 1: pairs (0, 0) -> 0 and twice (0, 0.5) -> 0.5: mean 1/3.
    # Group 2 has one image: left out. Mean over groups: (1 + 1/3) / 2.
    assert diversity(features, groups).item() == pytest.approx(2 / 3)
    assert diversity(torch.stack([ones, ones, ones])).item() == 0.0  # a collapsed group
    assert math.isnan(diversity(ones[None]).item())


def test_pooled_is_the_area_average():
    image = torch.arange(16.0).view(1, 1, 4, 4).expand(1, 3, 4, 4)  # the same 4 x 4 ramp in R, G, B
    got = pooled(image / 15, 2)  # [1, 3 * 2 * 2]
    by_hand = torch.tensor([[0 + 1 + 4 + 5, 2 + 3 + 6 + 7], [8 + 9 + 12 + 13, 10 + 11 + 14 + 15]]) / 4 / 15
    torch.testing.assert_close(got, by_hand.flatten().repeat(3)[None])
    assert pooled(image, 8).shape == (1, 48)  # smaller than the size: kept as it is


def test_pil_images_become_the_decoders_tensors():
    from PIL import Image

    images = [Image.new("RGB", (3, 2), (255, 0, 0)), Image.new("RGB", (3, 2), (0, 0, 255))]
    tensor = pil_to_tensor(images)
    assert tensor.shape == (2, 3, 2, 3)
    assert tensor[0, 0].eq(1).all() and tensor[0, 1:].eq(0).all() and tensor[1, 2].eq(1).all()
    assert pil_to_tensor([images, images]).shape == (2, 2, 3, 2, 3)  # videos: lists of frames


TINY = ["model.name_or_path=tiny", "sampling.resolution=32", "sampling.max_sequence_length=16",
        "sampling.guidance_scale=1.0", "sampling.train_cfg=false", "trainer.prompts_per_step=2",
        "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "sampling.chunk_size=4",
        "sampling.num_steps=4", "sampling.eval_num_steps=4", "ema.enabled=false", "data.eval_size=4",
        "trainer.total_steps=2", "trainer.eval_every=2", "trainer.save_every=0", "trainer.progress=false",
        "trainer.reward_workers=0"]


def test_a_tiny_run_logs_the_offtarget_figures_and_plot_draws_them(tmp_path):
    from unirl.api import train
    from unirl.plot import default_panels, plot_runs, read_rows

    run = tmp_path / "run"
    train("diffusion", overrides=[*TINY, f"output_dir={run}", "offtarget.rewards=[jpeg_compressibility]"])
    rows = read_rows(run)
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for row in steps:  # every training rollout: chunks of 4, groups of 4, so each group spans one chunk
        assert 0 <= row["offtarget/dark_frac"] <= 1 and 0 <= row["offtarget/blown_frac"] <= 1
        assert 0 < row["offtarget/brightness"] < 1 and row["offtarget/diversity"] > 0
    evals = [r for r in rows if "eval/reward" in r]
    assert evals, rows
    for row in evals:
        assert row["offtarget/eval/reward"] == row["eval/reward"]
        assert row["offtarget/eval/reward/jpeg_compressibility"] < 0  # minus the JPEG's kilobytes: scored
        assert {"offtarget/eval/brightness", "offtarget/eval/diversity"} <= set(row)
    logged = {k for r in rows for k in r}
    panels = default_panels({"run": rows}, logged)
    assert {"offtarget/brightness", "offtarget/diversity", "offtarget/eval/reward/jpeg_compressibility"} <= set(panels)
    assert plot_runs([run]).is_file()


def test_offtarget_off_logs_none(tmp_path):
    from unirl.api import train
    from unirl.plot import read_rows

    run = tmp_path / "run"
    train("diffusion", overrides=[*TINY, f"output_dir={run}", "offtarget.enabled=false", "trainer.total_steps=1",
                                  "trainer.eval_every=1"])
    assert not any(k.startswith("offtarget/") for r in read_rows(run) for k in r)
