"""A user's own tool trains on the CPU (docs/tools.md, ``docs/examples/my_tools.py``): ``tiny_search`` with its
search tool replaced by the user's ``search`` function, which the warm-started model calls through Search-R1's
tags, and the docs' Hermes example run for real, not only as a dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHORT = ["trainer.progress=false", "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_completions=128"]


def _run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny_search", "--output-dir",
                           str(tmp_path / "run"), *SHORT, *overrides], cwd=tmp_path, capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """The task's corpus as a JSONL file, as docs/tools.md writes it: ``unirl data cat unirl://tiny_search/corpus``."""
    out = subprocess.run([sys.executable, "-m", "unirl.cli", "data", "cat", "unirl://tiny_search/corpus"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    path = tmp_path / "corpus.jsonl"
    path.write_text(out)
    return path


def test_the_users_own_search_tool_is_called_and_trained_with(tmp_path, corpus):
    tool = REPO / "docs" / "examples" / "my_tools.py"
    proc = _run(tmp_path, f"rollout.tools=[{{name: {tool}:search, kwargs: {{corpus: {corpus}}}}}]",
                "trainer.total_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["rollout/tool_calls_mean"] for r in rows) > 0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    answered = [s for s in samples if "mytools found" in s["response"]]  # the user's tool wrote the observation
    assert answered, [s["response"] for s in samples[:5]]
    # a search of the prompt's name found its passage: the corpus row, read by the user's function
    found = [s for s in answered if f"mytools found {s['prompt'].split('.')[0]}: code " in s["response"]]
    assert found, [s["response"] for s in answered[:5]]


def test_the_docs_hermes_example_runs_for_real(tmp_path):
    """The tiny model's tokenizer has no chat template: Hermes' results are its ``<tool_response>`` blocks."""
    tool = REPO / "docs" / "examples" / "my_tools.py"
    proc = _run(tmp_path, f"rollout.tools=[{{name: {tool}:define, kwargs: {{default: no entry}}}}]",
                "rollout.call_format=hermes", "trainer.total_steps=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unirl: done, 1 steps in " in proc.stdout
