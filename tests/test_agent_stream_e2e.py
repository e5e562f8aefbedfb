"""Streamed episodes and an external agent end to end on the tiny game (the model's build, ~30 s, happens once:
UNIRL_CACHE): ``source.stream`` trains through the CLI with each token's version bounded, and
``examples/external_agent.py`` (an ``openai``-client agent against ``source.agent``'s endpoint) trains the
policy from its recorded sessions and prints ``reward A -> B`` last."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def test_streamed_episodes_train_with_per_token_versions(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny_game", "--output-dir",
                           str(run), "trainer.progress=false", "trainer.total_steps=4", "trainer.eval_every=0",
                           "trainer.save_every=0", "source.stream=true", "source.max_staleness=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(run)
    assert len(rows) == 4
    for r in rows:
        # No token older than the bound (k = 1: the weights of the step before) trains. Usually none comes; on a
        # loaded machine a slow group of batch b can be taken a step late, after finished groups of batch b + 1
        # (a step takes the oldest finished groups), and its tokens from two versions back leave the loss.
        if r["rollout/staleness_token_max"] > 1:
            assert 0 < r["rollout/stale_token_frac"] < 1, r
        else:
            assert r["rollout/stale_token_frac"] == 0.0, r
        assert r["env/errors"] == 0
    # turns went to the engine (a step between whose figures the engine made no call, its batch played ahead
    # of time, logs no turns_per_engine_call)
    assert all(r.get("stream/turns_per_engine_call", 1) >= 1 for r in rows)
    assert any("stream/turns_per_engine_call" in r for r in rows)
    # episodes of the next batch play while the trainer updates: later batches hold tokens of the older weights
    assert any(r["rollout/staleness_token_max"] == 1 for r in rows[1:]), rows


def test_external_agent_example_trains_from_its_sessions(tmp_path):
    proc = subprocess.run([sys.executable, "examples/external_agent.py", "--output-dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"reward (\d+\.\d\d) -> (\d+\.\d\d)", last)
    assert match, last
    rows = _rows(tmp_path / "run")
    assert [float(match[1]), float(match[2])] == [round(rows[0]["reward/mean"], 2), round(rows[-1]["reward/mean"], 2)]
    assert all(r["agent/calls_per_session"] > 1 and r["agent/unrecorded_calls"] == 0 for r in rows)
    # sessions of several calls became one trajectory each (the agent writes the end-of-turn token back); a cut
    # is rare (a move cut at max_tokens whose text re-tokenises otherwise beside the game's next line)
    breaks, sessions = (sum(r[k] for r in rows) for k in ("agent/prefix_breaks", "agent/sessions_ended"))
    assert breaks <= 0.05 * sessions, (breaks, sessions)
    first, last = rows[:3], rows[-3:]
    mean = lambda part: sum(r["reward/mean"] for r in part) / len(part)  # noqa: E731
    assert mean(last) > mean(first), [round(r["reward/mean"], 3) for r in rows]
