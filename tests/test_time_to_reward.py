"""benchmarks/time_to_reward.py runs every method it lists (two steps each on tiny_colour): the
benchmark is not part of the suite's timing, but a method or an environment change must not break it. Each
method is its shipped tiny config (the benchmark runs what the configs ship), a guard is the method with its
policy loss swapped, and only the pairs the registry accepts run; the second prompt-dependent task
(``tiny_palette``) holds out what it says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from unirl.config import config_to_dict, load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.rewards.image import named_colour

REPO = Path(__file__).resolve().parents[1]
PATH = REPO / "benchmarks" / "time_to_reward.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("time_to_reward", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["time_to_reward"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_method_runs_and_is_counted(bench, tmp_path):
    """The four rollout paths run through the benchmark (the SDE, its branching and windowed forms, the forward
    process); awm, dgpo and tempflow are their shipped configs on two of those paths, whose learning runs are
    tests/test_flow_methods.py's, and the next test checks the benchmark runs exactly those configs."""
    assert set(bench.METHODS) == {"flowgrpo", "fast", "mixgrpo", "nft", "awm", "dgpo", "tempflow"}
    calls = {}
    for method in ("flowgrpo", "fast", "mixgrpo", "nft"):
        curve = bench.train_one("tiny_colour", method, seed=0, steps=2, eval_every=2, work=tmp_path)
        assert [point["step"] for point in curve] == [0, 2]
        assert set(curve[-1]["colours"]) == {"red", "blue"}
        assert "reward/jpeg_compressibility" in curve[-1]["offtarget"]  # tiny_colour's off-target reward
        calls[method] = curve[-1]["samples"]
    # tiny_colour: 4 prompts x 8, 8 steps. FlowGRPO runs every step for every sample; branching runs the
    # steps before the window once per prompt; NFT's 4-step ODE rollouts and its loss cost fewer still.
    assert calls["flowgrpo"] > calls["fast"] > 0 and calls["flowgrpo"] > calls["nft"] > 0
    assert calls["flowgrpo"] > calls["mixgrpo"] > 0


@pytest.mark.parametrize("method", ["nft", "awm", "dgpo", "tempflow"])
def test_each_shipped_method_config_is_the_benchmarks_overrides_of_tiny_colour(bench, method):
    config, overrides = bench.METHODS[method]
    mine = config_to_dict(load_config(DiffusionConfig, REPO / f"configs/diffusion/tiny_colour_{method}.yaml"))
    theirs = config_to_dict(load_config(DiffusionConfig, REPO / "configs/diffusion" / config.format(task="tiny_colour"),
                                        overrides))
    mine.pop("output_dir"), theirs.pop("output_dir")
    assert mine == theirs


def test_a_guard_replaces_the_methods_loss_and_only_the_pairs_the_registry_accepts_run(bench):
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
