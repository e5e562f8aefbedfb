"""benchmarks/time_to_reward.py runs every method it lists (two steps each on tiny_colour): the
benchmark is not part of the suite's timing, but a method or an environment change must not break it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "time_to_reward.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("time_to_reward", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["time_to_reward"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_method_runs_and_is_counted(bench, tmp_path):
    assert set(bench.METHODS) == {"flowgrpo", "fast", "mixgrpo", "nft"}
    calls = {}
    for method in bench.METHODS:
        curve = bench.train_one("tiny_colour", method, seed=0, steps=2, eval_every=2, work=tmp_path)
        assert [point["step"] for point in curve] == [0, 2]
        assert set(curve[-1]["colours"]) == {"red", "blue"}
        calls[method] = curve[-1]["samples"]
    # tiny_colour: 4 prompts x 8, 8 steps. FlowGRPO runs every step for every sample; branching runs the
    # steps before the window once per prompt; NFT's 4-step ODE rollouts and its loss cost fewer still.
    assert calls["flowgrpo"] > calls["fast"] > 0 and calls["flowgrpo"] > calls["nft"] > 0
    assert calls["flowgrpo"] > calls["mixgrpo"] > 0
