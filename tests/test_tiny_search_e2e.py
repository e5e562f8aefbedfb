"""``configs/text/tiny_search.yaml`` end to end through the CLI: GRPO with the search tool and the
``em`` reward makes the tiny model search more, and the reward rises with it (the model learns to
search); `unirl eval` of the last checkpoint then scores it as the run's own evaluation did. Shortened
to 6 of the config's 10 steps (measured in docs/tools.md): ~15 s once the model is built. Its build
(the warm start, ~1 minute on 2 cores) happens once per test session (UNIRL_CACHE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_tiny_search_reward_and_tool_calls_rise(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny_search", "--output-dir",
                           str(run), "trainer.progress=false", "trainer.total_steps=6",
                           "trainer.eval_every=6", "trainer.save_every=6"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in logged if "reward/mean" in r]
    assert len(rows) == 6

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    first, last = rows[:1], rows[-2:]
    calls = (mean("rollout/tool_calls_mean", first), mean("rollout/tool_calls_mean", last))
    em = (mean("reward/em", first), mean("reward/em", last))
    assert calls[1] >= calls[0] + 0.4, f"tool calls per sample: step 1 {calls[0]:.2f}, last-2 {calls[1]:.2f}"
    assert em[1] >= em[0] + 0.3, f"reward/em: step 1 {em[0]:.2f}, last-2 {em[1]:.2f}"
    # The searches were shown observations (out of the loss, in the sequence); an unparsable call is
    # counted, not fatal (the warm-started model now and then leaves a <search> unclosed).
    assert all(r["rollout/observation_tokens_mean"] > 0 and "rollout/tool_errors" in r for r in rows)

    # `unirl eval` of the saved checkpoint answers as the run's own held-out evaluation does: greedy,
    # multi-turn, the search tool called (it used to answer in one turn, scoring a search call as the answer).
    evaluated = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "eval", "text", "--checkpoint",
                           str(run / "checkpoints" / "step_000006"), "--output-dir", str(evaluated)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((evaluated / "summary.json").read_text())
    in_run = next(r for r in logged if r.get("step") == 6 and "eval/accuracy" in r)
    assert summary["accuracy"] == pytest.approx(in_run["eval/accuracy"]) and summary["tool_calls_mean"] > 0.5, summary
    samples = [json.loads(line) for line in (evaluated / "samples.jsonl").read_text().splitlines()]
    assert any("<information>" in s["response"] and s["tool_calls"] == 1 for s in samples)
