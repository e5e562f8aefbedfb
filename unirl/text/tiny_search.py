"""The tiny search task: a code per name, found only in a small bundled corpus, and a tiny model
warm-started to write Search-R1's tags (``configs/text/tiny_search.yaml``).

The task: "Alice?" asks for Alice's two-digit code. The codes are random, so nothing in the question
gives them away; the corpus (``corpus.jsonl`` in the built model's directory, one passage
"Name\\nCODE" a name) does. A model that answers at once guesses (1 in 100); one that writes ``<search>Alice</search>``
is shown ``<information>Doc 1(Title: Alice) 37</information>`` and can copy the code.

The tiny model is ``unirl/text/tiny.py``'s architecture with ``<``, ``>``, ``(`` and ``)`` added to the
characters, and a short supervised warm start that teaches the tags: 1 in 4 examples search and then
copy the code from the observation (the observation itself is not trained on), 3 in 4 answer with a
random code. So the warm-started model searches about a quarter of the time, and GRPO raises the
reward only by making it search more: reward and ``rollout/tool_calls_mean`` rise together.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from unirl.cache import default_cache_dir
from unirl.text import tiny
from unirl.tools.formats import SearchR1Format
from unirl.tools.search import format_passages

#: What changes the built artefacts goes into the cache key.
TINY_SEARCH_SPEC = {**tiny.TINY_LM_SPEC, "version": 2, "extra_chars": "<>()", "warm_start_steps": 300,
                    "warm_start_lr": 2e-3, "search_share": 0.25}


def task_files(seed: int = 0) -> dict[str, list[dict]]:
    """The corpus (26 names, random two-digit codes) and train/test rows ``{"question", "answer"}``."""
    rng = random.Random(seed)
    names = [chr(ord("A") + i) + "".join(rng.choice("aeioulnrst") for _ in range(3)) for i in range(26)]
    codes = {n: f"{rng.randint(10, 99)}" for n in names}
    corpus = [{"id": str(i), "contents": f"{n}\n{codes[n]}"} for i, n in enumerate(names)]
    rows = [{"question": f"{n}?", "answer": codes[n]} for n in names]
    return {"corpus": corpus, "train": rows, "test": rows}


def build_tiny_search_lm(seed: int = 0) -> Path:
    """Build (or reuse) the tiny search model; return its directory."""
    spec = dict(TINY_SEARCH_SPEC, seed=seed)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    directory = default_cache_dir() / f"tiny-search-{digest}"
    marker = directory / "unirl_tiny.json"
    if marker.exists() and json.loads(marker.read_text()).get("digest") == digest:
        return directory
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tiny.build_tokenizer(extra=spec["extra_chars"])
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=spec["hidden_size"],
                         intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_hidden_layers"],
                         num_attention_heads=spec["num_attention_heads"], num_key_value_heads=spec["num_key_value_heads"],
                         max_position_embeddings=spec["max_position_embeddings"], tie_word_embeddings=True,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    files = task_files()
    _warm_start(model, tokenizer, files, spec, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    for name, rows in files.items():  # corpus.jsonl, train.jsonl, test.jsonl
        with open(directory / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    marker.write_text(json.dumps({"digest": digest, "spec": spec}, indent=1))
    return directory


def _example(tokenizer, row: dict, corpus: dict[str, dict], search: bool, rng: random.Random):
    """(ids, labels) of one warm-start example; the observation's labels are -100 (not trained)."""
    fmt = SearchR1Format()
    name = row["question"].rstrip("?")
    pieces = [(row["question"], False)]
    if search:
        pieces += [(f"<search>{name}</search>", True),
                   (fmt.observation([format_passages([corpus[name]])], False), False),
                   (f"<answer>{row['answer']}</answer>", True)]
    else:
        pieces += [(f"<answer>{rng.randint(10, 99)}</answer>", True)]
    ids, labels = [], []
    for text, trained in pieces:
        t = tokenizer(text).input_ids
        ids += t
        labels += t if trained else [-100] * len(t)
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


def _warm_start(model, tokenizer, files: dict, spec: dict, seed: int) -> None:
    rng = random.Random(seed + 3)
    corpus = {r["contents"].split("\n")[0]: r for r in files["corpus"]}
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["warm_start_lr"])
    model.train()
    for _ in range(spec["warm_start_steps"]):
        batch = [_example(tokenizer, rng.choice(files["train"]), corpus, rng.random() < spec["search_share"], rng)
                 for _ in range(32)]
        length = max(len(i) for i, _ in batch)
        ids = torch.full((len(batch), length), tokenizer.pad_token_id)
        labels = torch.full((len(batch), length), -100)
        attn = torch.zeros((len(batch), length), dtype=torch.long)
        for k, (i, lab) in enumerate(batch):
            ids[k, :len(i)], labels[k, :len(i)], attn[k, :len(i)] = torch.tensor(i), torch.tensor(lab), 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()

