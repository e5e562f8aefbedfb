"""The embedded tiny default for text runs: a Qwen2-style model, its tokenizer and a task, built here.

Nothing is downloaded. ``build_tiny_lm`` writes a real ``Qwen2ForCausalLM`` and a character-level
fast tokenizer (built with ``tokenizers``) into a cache directory, from a fixed seed, so that
transformers and vLLM both load it by path. Attention head_dim is 64 because vLLM's CPU attention
kernels reject smaller heads.

The task is small-number addition (operands 0..4) written in GSM8K's answer format (``#### N``), so
the demo runs the real ``gsm8k`` reward. A random-initialised model never emits that format, and
GRPO cannot find a reward it never samples, so the build includes a short supervised warm start:
40 steps of 32 examples on the task itself (``#### a+b`` then EOS). That teaches the format and a
little of the table: sampled accuracy starts near 0.1 and GRPO takes it to about 0.5 in the demo.
(A warm start on a random digit, independent of the question, taught the format but also taught
the model to ignore the question; GRPO then only learned the most frequent sum, 4, worth 0.2.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from unirl.models.cache import cached_build, default_cache_dir, spec_digest

# Characters the tokenizer knows. Enough for the addition task and simple English prompts.
_ALPHABET = list("0123456789+-*/=?#:.,$ \n") + list("abcdefghijklmnopqrstuvwxyz") + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SPECIAL = ["<|pad|>", "<|endoftext|>", "<|unk|>"]

#: Everything that changes the built artefacts goes into the cache key.
TINY_LM_SPEC = {
    "version": 4,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 64
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "warm_start_steps": 40,
    "warm_start_lr": 1e-3,
    "max_operand": 4,
}


def addition_question(a: int, b: int) -> str:
    return f"{a}+{b}=?"


def addition_rows(n: int, seed: int, max_operand: int = TINY_LM_SPEC["max_operand"]) -> list[dict]:
    """``n`` addition problems ``{"question", "answer"}`` with GSM8K-style answers (``#### N``)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"question": addition_question(a, b), "answer": f"{a}+{b}={a + b}\n#### {a + b}"})
    return rows


def character_tokenizer_core(special: list[str], extra: str = ""):
    """The ``tokenizers`` core of the toys' character-level tokenizers: ids ``special`` first, then the
    alphabet and ``extra``, no merges. Byte-level symbols (" " -> "Ġ", "\n" -> "Ċ") as in Qwen2's
    tokenizer, because transformers (and so vLLM) load these directories with the Qwen2 tokenizer
    class, which is byte-level."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel.alphabet()
    symbols = ["Ġ" if c == " " else "Ċ" if c == "\n" else c for c in _ALPHABET + list(extra)]
    assert all(s in byte_level for s in symbols)
    vocab = {tok: i for i, tok in enumerate(special + symbols)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(special)
    return core


def build_tokenizer(extra: str = ""):
    """Character-level ``PreTrainedTokenizerFast`` (no merges), eos = ``<|endoftext|>``; ``extra``:
    characters added after the alphabet (the tiny search model's ``<>()``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=character_tokenizer_core(_SPECIAL, extra),
        pad_token="<|pad|>",
        eos_token="<|endoftext|>",
        unk_token="<|unk|>",
        model_max_length=TINY_LM_SPEC["max_position_embeddings"],
    )


def build_tiny_lm(directory: str | Path | None = None, seed: int = 0) -> Path:
    """Build (or reuse) the tiny model + tokenizer + task data; return the model directory.

    The directory holds ``config.json``, ``model.safetensors``, the tokenizer files, and
    ``train.jsonl`` / ``test.jsonl`` of the addition task. A ``unirl_tiny.json`` marker with the
    spec hash makes later calls return at once.
    """
    spec = dict(TINY_LM_SPEC, seed=seed)
    directory = Path(directory) if directory else default_cache_dir() / f"tiny-qwen2-{spec_digest(spec)}"
    return cached_build(directory, spec, "unirl_tiny.json", lambda work: _build(work, spec, seed),
                        what="the tiny text model")


def new_model(tokenizer, spec: dict, seed: int):
    """A randomly initialised ``Qwen2ForCausalLM`` of ``spec``'s shape over ``tokenizer``'s vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def _build(directory: Path, spec: dict, seed: int) -> None:
    """The model, the task data and the warm start, written to ``directory`` (``cached_build`` adds
    the marker and renames it into place)."""
    # 1. Tokenizer and model from config, seeded.
    tokenizer = build_tokenizer()
    model = new_model(tokenizer, spec, seed)

    # 2. Task data (train and held-out test from different seeds).
    train, test = addition_rows(2000, seed=seed + 1), addition_rows(200, seed=seed + 2)

    # 3. Short supervised warm start on the task (format plus a little of the table), see above.
    _format_warm_start(model, tokenizer, train, spec, seed)

    # 4. Save.
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        with open(directory / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def _format_warm_start(model, tokenizer, rows: list[dict], spec: dict, seed: int) -> None:
    rng = random.Random(seed + 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["warm_start_lr"])
    model.train()
    for _ in range(spec["warm_start_steps"]):
        batch = rng.sample(rows, 32)
        examples = []
        for r in batch:
            prompt = tokenizer(r["question"]).input_ids
            answer = tokenizer(r["answer"].split("\n")[-1]).input_ids + [tokenizer.eos_token_id]
            examples.append((prompt + answer, [-100] * len(prompt) + answer))
        supervised_step(model, optimizer, examples, tokenizer.pad_token_id)
    model.eval()


def supervised_step(model, optimizer, examples: list[tuple[list[int], list[int]]], pad_id: int) -> float:
    """One next-token cross-entropy step on ``examples`` of ``(ids, labels)`` (labels -100: not
    trained), right-padded into one batch; returns the loss."""
    loss = model(**padded_batch(examples, pad_id)).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def padded_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` [n, L] of ``examples`` right-padded to the longest."""
    length = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), length), pad_id)  # [n, L]
    labels = torch.full((len(examples), length), -100)
    attn = torch.zeros((len(examples), length), dtype=torch.long)
    for i, (seq, lab) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq)] = torch.tensor(lab)
        attn[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}
