"""``benchmarks/time_to_reward.py``'s method table: each method is its shipped tiny config (the benchmark runs
what the configs ship), a guard is the method with its policy loss swapped, and only the pairs the registry
accepts run; the second prompt-dependent task (``tiny_palette``) holds out what it says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from unirl.config import config_to_dict, load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.rewards.image import named_colour

REPO = Path(__file__).resolve().parents[1]


def _benchmark():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import time_to_reward
    finally:
        sys.path.pop(0)
    return time_to_reward


@pytest.mark.parametrize("method", ["nft", "awm", "dgpo", "tempflow"])
def test_each_shipped_method_config_is_the_benchmarks_overrides_of_tiny_colour(method):
    config, overrides = _benchmark().METHODS[method]
    mine = config_to_dict(load_config(DiffusionConfig, REPO / f"configs/diffusion/tiny_colour_{method}.yaml"))
    theirs = config_to_dict(load_config(DiffusionConfig, REPO / "configs/diffusion" / config.format(task="tiny_colour"),
                                        overrides))
    mine.pop("output_dir"), theirs.pop("output_dir")
    assert mine == theirs


def test_a_guard_replaces_the_methods_loss_and_only_the_pairs_the_registry_accepts_run():
    bench = _benchmark()
    _, overrides = bench.method_config("tempflow+grpo_guard")
    assert "algo.policy_loss=grpo_guard" in overrides and not any(o.startswith("algo.loss_args.") for o in overrides)
    kept, refused = bench.valid_methods("tiny_colour", ["flowgrpo+flow_dppo", "tempflow+grpo_guard", "nft+grpo_guard",
                                                        "awm+flow_dppo", "dgpo+grpo_guard"])
    assert kept == ["flowgrpo+flow_dppo", "tempflow+grpo_guard"]
    assert set(refused) == {"nft+grpo_guard", "awm+flow_dppo", "dgpo+grpo_guard"}
    assert all("do not give" in why for why in refused.values())  # the mode's forward lacks what the guard reads
    with pytest.raises(ValueError, match="unknown method"):
        bench.method_config("flowgrpo+kl")


def test_tiny_palette_holds_out_unseen_pairs_of_its_four_colours():
    cfg = load_config(DiffusionConfig, REPO / "configs/diffusion/tiny_palette.yaml")
    train = (REPO / "configs/diffusion/tiny_palette_train.txt").read_text().split("\n")[:-1]
    test = (REPO / "configs/diffusion/tiny_palette_test.txt").read_text().split("\n")[:-1]
    assert not set(train) & set(test) and cfg.data.eval_size == len(test) == 8
    colours = {"green", "yellow", "orange", "purple"}
    assert {named_colour(p) for p in train} == {named_colour(p) for p in test} == colours
    tiny_colour = config_to_dict(load_config(DiffusionConfig, REPO / "configs/diffusion/tiny_colour.yaml"))
    palette = config_to_dict(cfg)
    for d in (tiny_colour, palette):  # the same run but for its prompts
        d.pop("output_dir"), d.pop("data")
    assert palette == tiny_colour
