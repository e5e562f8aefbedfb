"""Bad input is found before training and named in one line: every data row (``file:line``), prompts
over ``data.max_prompt_length`` (or dropped with ``data.filter_overlong_prompts``), a malformed YAML
override, a reward file that does not parse."""

from __future__ import annotations

import json

import pytest

from unirl.rewards.loading import load_reward
from unirl.rewards.registry import RewardError
from unirl.cli import main


def _rows_file(tmp_path, late_line: str, n: int = 20):
    rows = [json.dumps({"prompt": f"what is {i}+1?", "answer": str(i + 1)}) for i in range(n)]
    rows[15] = late_line  # line 16: past what a peek at the first rows sees
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("late_line, expected", [
    ('{"question": "no prompt key"}', "row 15 has no 'prompt' column"),
    ("5", "row 15 must be a JSON object with a 'prompt' column, got 5"),
    ("null", "row 15 must be a JSON object with a 'prompt' column, got null"),
    ('{"prompt": null}', "row 15's 'prompt' must be a string, got null"),
])
def test_a_bad_late_row_is_named_file_line_by_the_dry_run(tmp_path, capsys, late_line, expected):
    path = _rows_file(tmp_path, late_line)
    code = main(["train", "text", "--config", "tiny", "--dry-run", "--output-dir", str(tmp_path / "run"),
                 f"data.train={path}", "data.test=null", "data.adapter=plain", "data.prompt_key=prompt"])
    out = capsys.readouterr().out
    assert code == 2
    (problem,) = [line for line in out.splitlines() if "PROBLEM" in line]
    assert f"{path}:16: {expected}" in problem


def test_an_overlong_prompt_is_named_before_training_or_dropped(tmp_path, tiny_lm_dir):
    from tests.conftest import text_env

    path = tmp_path / "rows.jsonl"
    long = "one two three " * 60
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["1+1=?", "2+2=?", long, "3+3=?"]) + "\n")
    data = [f"data.train={path}", "data.test=null", "data.adapter=plain", "data.prompt_key=prompt",
            "data.max_prompt_length=64"]
    with pytest.raises(ValueError, match=rf"data.train: 1 prompt\(s\) longer than data.max_prompt_length=64 tokens, "
                                         rf"first {path}:3 \(row 2, \d+ tokens\); raise data.max_prompt_length or set "
                                         rf"data.filter_overlong_prompts=true"):
        text_env(tmp_path, *data)
    env = text_env(tmp_path, *data, "data.filter_overlong_prompts=true")
    assert [row["prompt"] for row in env.train_rows] == ["1+1=?", "2+2=?", "3+3=?"]


def test_a_malformed_yaml_override_is_one_line(tmp_path, capsys):
    code = main(["train", "text", "--config", "tiny", "--dry-run", "--output-dir", str(tmp_path / "r"),
                 "trainer.total_steps=[1,"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("unirl: config error: override 'trainer.total_steps=[1,': the value is not valid YAML (")


def test_a_reward_file_with_a_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def r(samples, **kw):\n    return [1.0 for s in samples\n")
    with pytest.raises(RewardError, match=rf"reward '{path}:r': {path}:2: syntax error: '\[' was never closed"):
        load_reward(f"{path}:r")
