"""The tiny search task's pieces (unirl/text/tiny_search.py): generated rows and corpus, and the
warm-start examples' labels (the search tool over the generated corpus: tests/test_search_tool.py, which
imports numba; the run itself: tests/test_tiny_search_e2e.py)."""

from __future__ import annotations

import math

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


def test_the_warm_start_stops_on_the_probability_of_sampling_a_whole_search_right():
    """``search_probabilities`` (one padded batch) against each example scored alone, by hand: P(the "s" of
    ``<search>`` after the question's "<") and P(every written character after it | searching), the
    observation conditioned on and not counted."""
    import torch

    tok = tiny.build_tokenizer(extra="<>()")
    model = tiny.new_model(tok, tiny_search.TINY_SEARCH_SPEC, seed=1).eval()  # random weights: far from 0 or 1
    pairs = [("Bako", "7"), ("Tidesa", "3"), ("Nu", "9")]  # names of different lengths: padding matters
    searches, exact = tiny_search.search_probabilities(model, tok, pairs)
    by_hand = []
    for name, c in pairs:
        prompt, call = f"{name}. What is its code?", f"<search>{name}</search>"
        observation = f"\n\n<information>Doc 1(Title: {name}) code {c}</information>\n\n"
        ids = tok(prompt + call + observation + f"<answer>{c}</answer>").input_ids + [tok.eos_token_id]
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)  # [L, V]
        written = list(range(len(prompt) + 2, len(prompt + call))) + list(range(len(prompt + call + observation), len(ids)))
        by_hand.append((logp[len(prompt), ids[len(prompt) + 1]].exp().item(),
                        sum(logp[t - 1, ids[t]].item() for t in written)))
    assert searches == pytest.approx(sum(s for s, _ in by_hand) / 3, rel=1e-5, abs=0)
    assert exact == pytest.approx(sum(math.exp(e) for _, e in by_hand) / 3, rel=1e-4, abs=0)  # ~1e-80: no abs slack
    assert 0 < exact < searches < 1


# ------------------------------------------------------------------ building once (issue 37 item 16)
_BUILDER = '''
import os, sys, time
from pathlib import Path
from unirl.models.cache import cached_build

def build(work):
    with open(sys.argv[2], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(1.5)  # long enough that the three processes overlap
    (work / "weights.txt").write_text("w")
    return {"steps": 7}

cached_build(Path(sys.argv[1]), {"size": 3}, "marker.json", build, what="the test toy")
print((Path(sys.argv[1]) / "weights.txt").read_text())
'''


def test_three_processes_asking_at_once_build_the_cache_once_under_a_lock(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script, log, target = tmp_path / "builder.py", tmp_path / "builds.log", tmp_path / "cache" / "toy"
    script.write_text(_BUILDER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, str(script), str(target), str(log)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert len(log.read_text().split()) == 1  # one build
    assert all(out.strip() == "w" for out, _ in outs)  # each process found the whole build
    assert json.loads((target / "marker.json").read_text())["steps"] == 7
    assert sorted(p.name for p in target.parent.iterdir()) == [".toy.lock", "toy"]  # no half-built directory left
    errs = "".join(err for _, err in outs)
    assert errs.count("unirl: building the test toy once") == 1 and errs.count("unirl: built the test toy in") == 1
    assert errs.count("unirl: waiting for another process building the test toy") == 2


def test_a_failed_build_leaves_nothing_and_the_toys_share_the_helper(tmp_path):
    from unirl.models.cache import cached_build
    from unirl.diffusion.tiny import common

    def broken(work):
        (work / "half.bin").write_text("x")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="killed mid-build"):
        cached_build(tmp_path / "toy", {"a": 1}, "marker.json", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".toy.lock"]
    assert common.cached_build is cached_build and tiny.cached_build is cached_build
    assert tiny_search.cached_build is cached_build


def test_a_build_runs_on_the_same_threads_whoever_asks(tmp_path):
    """A toy's warm start or decoder fit ends in other last bits on another thread count, so a build runs on
    ``BUILD_THREADS`` whatever its caller's (a gloo rank's one, a CLI run's all), and the caller gets its
    own back: the test session's toys are then the ones tests/pinned_metrics.py was pinned with."""
    import torch

    from unirl.models.cache import BUILD_THREADS, cached_build

    before, seen = torch.get_num_threads(), []
    try:
        for caller in (1, BUILD_THREADS + 1):
            torch._C.set_num_threads(caller)
            cached_build(tmp_path / f"toy{caller}", {"caller": caller}, "marker.json",
                         lambda work: seen.append(torch.get_num_threads()))
            assert torch.get_num_threads() == caller
    finally:
        torch._C.set_num_threads(before)
    assert seen == [BUILD_THREADS, BUILD_THREADS]
