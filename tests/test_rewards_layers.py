"""The rewards package imports one way: registry <- remote_client <- loading, scoring <- models <- remote
(with batching, which imports nothing of the package, under remote).
Each module, imported fresh (without the package's ``__init__``, which imports them all), pulls in
only the modules below it; and the names that left registry.py are still importable from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: module -> the rewards modules it may import (directly or through them).
BELOW = {
    "registry": set(),
    "remote_client": {"registry"},
    "loading": {"registry", "remote_client"},
    "scoring": {"registry"},
    "models": {"registry"},
    "batching": set(),
    "remote": {"registry", "remote_client", "loading", "scoring", "models", "batching"},
}

_PROBE = """
import importlib, json, sys, types
import unirl
out = {}
for name in sys.argv[1:]:
    for key in [k for k in sys.modules if k == "unirl.rewards" or k.startswith("unirl.rewards.")]:
        del sys.modules[key]
    package = types.ModuleType("unirl.rewards")  # the package without its __init__
    package.__path__ = ["unirl/rewards"]
    sys.modules["unirl.rewards"] = package
    importlib.import_module("unirl.rewards." + name)
    out[name] = sorted(k.split(".", 2)[2] for k in sys.modules
                       if k.startswith("unirl.rewards.") and k != "unirl.rewards." + name)
print(json.dumps(out))
"""


def test_each_module_imports_only_the_ones_below_it():
    done = subprocess.run([sys.executable, "-c", _PROBE, *BELOW], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout)
    for name, allowed in BELOW.items():
        assert set(imported[name]) <= allowed, f"unirl.rewards.{name} imports {sorted(set(imported[name]) - allowed)}, not below it"
    assert imported["registry"] == []


def test_names_that_moved_are_still_importable_from_the_registry():
    from unirl.rewards import loading, registry, scoring

    assert registry.load_reward is loading.load_reward
    assert registry._resolve is registry.resolve_reward is loading.resolve_reward
    assert registry.score_batch is scoring.score_batch
    from unirl.rewards.registry import list_rewards, reward_info, unavailable_builtins  # noqa: F401  (the old import lines)

    try:
        registry.no_such_name
    except AttributeError as err:
        assert "has no attribute 'no_such_name'" in str(err)
    else:
        raise AssertionError("an unknown attribute of rewards.registry must raise AttributeError")
