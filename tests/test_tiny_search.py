"""The tiny search task's pieces (unirl/text/tiny_search.py): generated rows and corpus, the search
tool over the generated corpus, and the warm-start examples' labels (the run itself:
tests/test_tiny_search_e2e.py)."""

from __future__ import annotations

import importlib.util

import pytest

from unirl.data.paths import generated_rows
from unirl.text import tiny, tiny_search


def test_rows_and_corpus_are_generated_from_the_seed():
    train, test = generated_rows("unirl://tiny_search/train"), generated_rows("unirl://tiny_search/test")
    corpus = generated_rows("unirl://tiny_search/corpus")
    assert (len(train), len(test), len(corpus)) == (32, 16, 48)
    names = lambda rows: {r["question"].split(".")[0] for r in rows}  # noqa: E731
    assert not names(train) & names(test)  # held-out names
    passages = {r["contents"].split("\n")[0]: r["contents"].split("\n")[1] for r in corpus}
    for row in train + test:
        name = row["question"].split(".")[0]
        assert row["question"] == f"{name}. What is its code?" and row["answer"] not in row["question"]
        assert passages[name] == f"code {row['answer']}" and row["answer"] in "23456789"
    assert generated_rows("unirl://tiny_search/train") == train
    assert generated_rows("unirl://tiny_search/train?seed=1") != train


def test_warm_start_example_trains_on_what_the_model_writes_only():
    tok = tiny.build_tokenizer(extra="<>()")
    ids, labels = tiny_search.example(tok, "Bako", "7", search=True, guess="3")
    text = tok.decode(ids)
    prompt, call = "Bako. What is its code?", "<search>Bako</search>"
    observation = "\n\n<information>Doc 1(Title: Bako) code 7</information>\n\n"
    assert text == prompt + call + observation + "<answer>7</answer><|endoftext|>"
    trained = [i for i, label in enumerate(labels) if label != -100]
    # by hand: the call, then the answer and EOS; never the prompt or the observation
    expected = list(range(len(prompt), len(prompt + call))) + list(range(len(prompt + call + observation), len(ids)))
    assert trained == expected and all(labels[i] == ids[i] for i in trained)
    ids, labels = tiny_search.example(tok, "Bako", "7", search=True, guess="3", choice_trained=False)
    assert labels[len(prompt) + 1] == -100 and tok.decode([ids[len(prompt) + 1]]) == "s"  # the choice, untrained
    ids, labels = tiny_search.example(tok, "Bako", "7", search=False, guess="3")
    assert tok.decode(ids) == prompt + "<answer>3</answer><|endoftext|>"


@pytest.mark.imports_numba
@pytest.mark.skipif(importlib.util.find_spec("bm25s") is None, reason="bm25s is not installed")
def test_search_over_the_generated_corpus_finds_each_name():
    from unirl.tools import ToolError
    from unirl.tools.search import Search, read_corpus

    search = Search("unirl://tiny_search/corpus", top_k=1)
    for row in generated_rows("unirl://tiny_search/train") + generated_rows("unirl://tiny_search/test"):
        name = row["question"].split(".")[0]
        assert search(name) == f"Doc 1(Title: {name}) code {row['answer']}\n"
    with pytest.raises(ToolError, match=r"unirl://arithmetic/test\?n=2 row 1: expected an object with a string 'contents'"):
        read_corpus("unirl://arithmetic/test?n=2")
