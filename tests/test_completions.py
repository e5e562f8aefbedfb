"""A few samples of each step while the run trains (``trainer.log_completions``, TRL's ``log_completions``):
``RUN/samples.jsonl``, the trackers' table, and the console every ``log_completions_every`` steps."""

from __future__ import annotations

import json
import re

import pytest

import unirl
from unirl.rewards.gsm8k import gsm8k

RUN = ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.total_steps=3", "trainer.prompts_per_step=4",
       "trainer.group_size=2", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "trainer.eval_every=0",
       "trainer.save_every=2", "trainer.log_completions=3", "trainer.log_completions_every=2"]


def test_each_step_writes_a_few_scored_samples_and_every_second_prints_them(tmp_path, tiny_lm_dir, capsys):
    out = tmp_path / "run"
    unirl.train("text", "tiny", RUN, output_dir=out, progress=False)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    prompts = {json.loads(line)["question"] for line in (tiny_lm_dir / "train.jsonl").read_text().splitlines()}
    for row in rows:
        assert row["prompt"] in prompts and isinstance(row["response"], str)
        # the reward is the response's, as the run's reward scores it (tiny.yaml: gsm8k, strict_normalized)
        gold = next(json.loads(line)["answer"] for line in (tiny_lm_dir / "train.jsonl").read_text().splitlines()
                    if json.loads(line)["question"] == row["prompt"])
        expected = gsm8k([row["response"]], answer=[gold], method="strict_normalized")[0]
        assert row["reward"] == row["gsm8k"] == pytest.approx(expected)
        assert "advantage" in row
    assert len({r["prompt"] for r in rows if r["step"] == 1}) == 3  # one sample each of three prompts
    said = capsys.readouterr().out
    printed = [line for line in said.splitlines() if line.startswith("unirl: step ")]
    assert len(printed) == 3 and all(line.startswith("unirl: step 2 sample: ") for line in printed), printed
    done = next(line for line in said.splitlines() if line.startswith("unirl: done, 3 steps in "))
    assert re.fullmatch(r"unirl: done, 3 steps in \d+ s, after a set-up of \d+ s", done), done  # the build apart
    # resumed after its step-2 checkpoint: the rows of step 3 are dropped first, so every step's appear once
    unirl.train("text", "tiny", [*RUN, "trainer.total_steps=4", "trainer.resume=true"], output_dir=out, progress=False)
    assert [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()] == [1] * 3 + [2] * 3 + \
        [3] * 3 + [4] * 3


def test_none_are_written_with_log_completions_0(tmp_path, tiny_lm_dir):
    out = tmp_path / "run"
    unirl.train("text", "tiny", [*RUN, "trainer.log_completions=0", "trainer.total_steps=1"], output_dir=out,
                progress=False)
    assert not (out / "samples.jsonl").exists()
