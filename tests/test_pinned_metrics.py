"""Every shipped tiny config's first steps give the figures pinned before the restructuring (issue 31):
``tests/pinned_metrics.py`` says how the fixture is written and why runs are forced onto the CPU."""

from __future__ import annotations

import json
import math

import pytest

from pinned_metrics import CONFIGS, FIXTURE, fingerprint, run_in_subprocess

PINNED = json.loads(FIXTURE.read_text())


def _same(a: float, b: float, exact: bool) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b if exact else a == pytest.approx(b, rel=1e-5, abs=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("env,name", CONFIGS, ids=[f"{e}-{n}" for e, n in CONFIGS])
def test_first_steps_match_the_pinned_figures(env, name):
    expected = PINNED["configs"][f"{env}/{name}"]
    exact = fingerprint() == PINNED["fingerprint"]  # bit for bit on the machine that wrote them
    got = run_in_subprocess(env, name)
    assert len(got) == len(expected) == PINNED["steps"]
    for step, (g, e) in enumerate(zip(got, expected), start=1):
        assert sorted(g) == sorted(e), f"{env}/{name} step {step}: other figures {sorted(set(g) ^ set(e))}"
        differing = {k: (g[k], e[k]) for k in e if not _same(g[k], e[k], exact)}
        assert not differing, f"{env}/{name} step {step} (got, pinned): {differing}"
