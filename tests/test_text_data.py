"""Prompt data for text runs: file formats, the GSM8K adapter, the per-step sampler."""

from __future__ import annotations

import json

import pytest

from conftest import shared_data
from unirl.rewards.gsm8k import gsm8k
from unirl.prompts import Prompts as PromptSampler
from unirl.text.data import GSM8K_INSTRUCTION, load_rows, to_prompt_rows


def test_gsm8k_adapter_on_the_real_split():
    path = shared_data("gsm8k", "test.jsonl")
    rows = to_prompt_rows(load_rows(str(path)), adapter="gsm8k", prompt_key="question", source=str(path))
    assert len(rows) == 1319
    first = json.loads(path.read_text().splitlines()[0])
    assert rows[0]["prompt"] == f"{first['question']} {GSM8K_INSTRUCTION}"
    assert GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    # The gold number from the "#### N" line, which the gsm8k reward then matches.
    assert rows[0]["answer"] == first["answer"].rsplit("#### ", 1)[1]
    assert gsm8k([f"so #### {r['answer']}" for r in rows[:50]], answer=[r["answer"] for r in rows[:50]]) == [1.0] * 50


def test_jsonl_json_and_parquet_give_the_same_rows(tmp_path):
    rows = [{"question": "1+1=?", "answer": "#### 2"}, {"question": "2+2=?", "answer": "#### 4"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.jsonl", "d.json", "d.parquet"):
        assert load_rows(str(tmp_path / name)) == rows, name


def test_bad_data_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_rows(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"row 1 has no 'question' column"):
        to_prompt_rows([{"question": "q", "answer": "#### 1"}, {"q": "x"}], adapter="plain", prompt_key="question",
                       source="d.jsonl")
    with pytest.raises(ValueError, match="no '#### N' line"):
        to_prompt_rows([{"question": "q", "answer": "42"}], adapter="gsm8k", prompt_key="question", source="d.jsonl")


def test_sampler_epochs_resume_and_process_slices():
    rows = [{"i": i} for i in range(10)]
    one = PromptSampler(rows, 4, seed=3)
    # Step k always gives the same rows (resume), and an epoch visits every row once.
    seen = [r["i"] for step in range(5) for r in one.next(step)]
    assert [r["i"] for r in PromptSampler(rows, 4, seed=3).next(2)] == seen[8:12]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    # Two processes with B=2 each split the single process's B=4 batches between them.
    ranks = [PromptSampler(rows, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for step in range(5):
        assert [r["i"] for s in ranks for r in s.next(step)] == seen[4 * step: 4 * step + 4]
    assert [r["i"] for r in PromptSampler(rows, 4, seed=3, shuffle=False).next(2)] == [8, 9, 0, 1]
