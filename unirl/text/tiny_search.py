"""The tiny search task and its model: a code per name, found only by searching a small corpus, and
the tiny model warm-started to write Search-R1's tags. NOT YET A WORKING DEMO: no config uses it (see
"Status" below).

The task. "Bako. What is its code?" asks for a made-up name's random one-digit code (2..9; the
observation's ``Doc 1`` already shows a 1). Nothing in the question gives the code away; the corpus
(one passage a name: title ``Bako``, text ``code 7``) does. A model that answers at once guesses (1 in
8); one that writes ``<search>Bako</search>`` is shown ``<information>Doc 1(Title: Bako) code
7</information>`` and can copy the code into ``<answer>7</answer>``. The rows and the corpus are
generated here from a seed (``unirl://tiny_search/train``, ``/test``, ``/corpus``); the test names are
not training names. The name comes first in the question: the character model learns to copy it
into the query within 150 warm-start steps that way (it had not in 400 with the name mid-question).

The model. ``unirl/text/tiny.py``'s architecture and character tokenizer with ``<``, ``>``, ``(`` and
``)`` added, and a supervised warm start on *other* names (none of the task's), so it knows no task
code. Three quarters of its examples search and then copy the code from the observation (the
observation itself is not trained on, as in RL), the rest answer at once with a random code; the
choice between the two is trained so that the model searches a quarter of the time. GRPO could then
raise the reward only by making it search more.

Status (measured on the shared 2-core machine): after 300 warm-start steps the model writes the tags
and copies the name into the query (per-token loss 0.007), but it does not read the code from the
observation: the loss of the answer's digit stays at ln 8 (a uniform guess), so searching does not
pay and GRPO has nothing to reinforce. Search-R1 needs no warm start (its 3B model follows the
instruction in its prompt); a 2-layer character model has to learn retrieval over ~100 tokens first.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from unirl.cache import default_cache_dir
from unirl.text import tiny

#: Everything that changes the built model goes into the cache key.
TINY_SEARCH_SPEC = {
    **tiny.TINY_LM_SPEC,
    "version": 1,
    "extra_chars": "<>()",
    "max_position_embeddings": 192,  # prompt + call + observation + answer is about 115 characters
    "warm_start_steps": 300,
    "warm_start_lr": 2e-3,
    "search_examples": 0.75,
    "search_prior": 0.25,
}
#: Names in the task: training questions, held-out questions (the corpus holds both).
TASK_SIZES = {"train": 32, "test": 16}

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
#: Longest warm-start example that answers at once (a search example is longer).
_SHORT = 48


def _name(rng: random.Random) -> str:
    """A made-up four-letter name, consonant-vowel-consonant-vowel (``Bako``): 4,900 of them."""
    return "".join(rng.choice(s) for s in (_CONSONANTS, _VOWELS, _CONSONANTS, _VOWELS)).capitalize()


def _names(rng: random.Random, n: int, exclude: set[str] = frozenset()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = _name(rng)
        if name not in out and name not in exclude:
            out.append(name)
    return out


def code(rng: random.Random) -> str:
    """A code: one digit, 2..9 (``Doc 1`` already shows a 1), so a guess is right 1 time in 8."""
    return str(rng.randint(2, 9))


def question(name: str) -> str:
    return f"{name}. What is its code?"


def passage(name: str, code: str) -> str:
    """A corpus row's ``contents``: title line, then text (Search-R1's corpus layout)."""
    return f"{name}\ncode {code}"


def task_codes(seed: int = 0) -> dict[str, dict[str, str]]:
    """``{"train": {name: code}, "test": {name: code}}``: distinct names, codes 10..99, from ``seed``."""
    rng = random.Random(seed)
    names = _names(rng, sum(TASK_SIZES.values()))
    codes = {n: code(rng) for n in names}
    split = TASK_SIZES["train"]
    return {"train": {n: codes[n] for n in names[:split]}, "test": {n: codes[n] for n in names[split:]}}


def task_rows(part: str, seed: int = 0) -> list[dict]:
    """``unirl://tiny_search/{train,test}``: ``{"question", "answer"}`` rows; ``corpus``: ``{"id", "contents"}``
    rows of every task name (train and test)."""
    codes = task_codes(seed)
    if part == "corpus":
        every = {**codes["train"], **codes["test"]}
        return [{"id": str(i), "contents": passage(n, c)} for i, (n, c) in enumerate(every.items())]
    return [{"question": question(n), "answer": c} for n, c in codes[part].items()]


def build_tiny_search_lm(seed: int = 0) -> Path:
    """Build (or reuse) the warm-started tiny search model; return its directory (``model.name_or_path:
    tiny_search``)."""
    spec = dict(TINY_SEARCH_SPEC, seed=seed)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    directory = default_cache_dir() / f"tiny-search-{digest}"
    marker = directory / "unirl_tiny.json"
    if marker.exists() and json.loads(marker.read_text()).get("digest") == digest:
        return directory
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is the same, cache cold or warm
        tokenizer = tiny.build_tokenizer(extra=spec["extra_chars"])
        model = tiny.new_model(tokenizer, spec, seed)
        warm_start(model, tokenizer, spec, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    marker.write_text(json.dumps({"digest": digest, "spec": spec}, indent=1))
    return directory


def warm_start(model, tokenizer, spec: dict, seed: int) -> None:
    """``spec["warm_start_steps"]`` steps of 32 examples on names outside the task (see the module doc).

    Copying is what takes the model longest to learn, so most examples search. The choice itself (the
    ``s`` of ``<search>`` or the ``a`` of ``<answer>``) is trained on every answer-at-once example and
    on a share ``r`` of the searching ones, so that the model searches ``search_prior`` of the time."""
    rng = random.Random(seed + 3)
    task_names = {n for part in task_codes().values() for n in part}
    pool = _names(rng, 2000, exclude=task_names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["warm_start_lr"])
    model.train()
    # P(search) = s r / (s r + 1 - s) = prior, with s the share of searching examples and r the share
    # of them whose choice is trained.
    s, prior = spec["search_examples"], spec["search_prior"]
    r = prior * (1 - s) / ((1 - prior) * s)
    for _ in range(spec["warm_start_steps"]):
        examples = []
        for _ in range(32):
            search = rng.random() < s
            examples.append(example(tokenizer, rng.choice(pool), code(rng), search=search, guess=code(rng),
                                    choice_trained=not search or rng.random() < r))
        _accumulated_step(model, optimizer, examples, tokenizer.pad_token_id)
    model.eval()


def _accumulated_step(model, optimizer, examples: list[tuple[list[int], list[int]]], pad_id: int) -> None:
    """One step of mean token cross-entropy over ``examples``, the short ones (answers) padded apart
    from the long ones (search, observation, answer): half the padded tokens of one batch."""
    short = [e for e in examples if len(e[0]) <= _SHORT]
    groups = [g for g in (short, [e for e in examples if len(e[0]) > _SHORT]) if g]
    batches = [tiny.padded_batch(g, pad_id) for g in groups]
    trained = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)  # next-token targets
    for batch in batches:  # transformers' loss: sum over the batch's targets / num_items_in_batch
        model(**batch, num_items_in_batch=trained).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def example(tokenizer, name: str, code: str, *, search: bool, guess: str,
            choice_trained: bool = True) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of one warm-start trajectory, written as the rollout writes it (the observation
    is the search tool's output in the ``search_r1`` format); labels are -100 on the prompt, the
    observation, and the choice between searching and answering unless ``choice_trained``."""
    from unirl.tools.formats import SearchR1Format
    from unirl.tools.search import format_passages

    if search:
        observation = SearchR1Format().observation([format_passages([{"contents": passage(name, code)}])], False)
        pieces = [(f"<search>{name}</search>", True), (observation, False), (f"<answer>{code}</answer>", True)]
    else:
        pieces = [(f"<answer>{guess}</answer>", True)]
    ids = tokenizer(question(name)).input_ids
    labels = [-100] * len(ids)
    for text, trained in pieces:
        piece = tokenizer(text, add_special_tokens=False).input_ids
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    if not choice_trained:
        labels[len(tokenizer(question(name) + "<").input_ids)] = -100  # the "s" of <search>
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
