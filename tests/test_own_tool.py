"""A user's own tool trains on the CPU (docs/tools.md, ``docs/examples/my_tools.py``): ``tiny_search`` with its
search tool replaced by the user's ``search`` function, which the warm-started model calls through Search-R1's
tags, and the docs' Hermes example run for real, not only as a dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import unirl
from unirl.cli import main

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "docs" / "examples" / "my_tools.py"
SHORT = ["trainer.progress=false", "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_completions=128"]


def _train(tmp_path: Path, *overrides: str):
    """``unirl train text --config tiny_search`` with ``overrides``, in this process (no second start-up)."""
    return unirl.train("text", "tiny_search", [*SHORT, *overrides], output_dir=tmp_path / "run", progress=False)


@pytest.fixture
def corpus(tmp_path: Path, capsys) -> Path:
    """The task's corpus as a JSONL file, as docs/tools.md writes it: ``unirl data cat unirl://tiny_search/corpus``."""
    assert main(["data", "cat", "unirl://tiny_search/corpus"]) in (0, None)
    path = tmp_path / "corpus.jsonl"
    path.write_text(capsys.readouterr().out)
    return path


def test_the_users_own_search_tool_is_called_and_trained_with(tmp_path, corpus):
    _train(tmp_path, f"rollout.tools=[{{name: {TOOLS}:search, kwargs: {{corpus: {corpus}}}}}]", "trainer.total_steps=3")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and sum(r["rollout/tool_calls_mean"] for r in rows) > 0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    answered = [s for s in samples if "mytools found" in s["response"]]  # the user's tool wrote the observation
    assert answered, [s["response"] for s in samples[:5]]
    # a search of the prompt's name found its passage: the corpus row, read by the user's function
    found = [s for s in answered if f"mytools found {s['prompt'].split('.')[0]}: code " in s["response"]]
    assert found, [s["response"] for s in answered[:5]]


def test_the_docs_hermes_example_runs_for_real(tmp_path):
    """The tiny model's tokenizer has no chat template: Hermes' results are its ``<tool_response>`` blocks."""
    result = _train(tmp_path, f"rollout.tools=[{{name: {TOOLS}:define, kwargs: {{default: no entry}}}}]",
                    "rollout.call_format=hermes", "trainer.total_steps=1")
    assert len(result.metrics) == 1 and (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()
