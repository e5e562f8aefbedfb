"""The tiny search task and its model (``configs/text/tiny_search.yaml``): a code per name, found only
by searching a small corpus, and the tiny model warm-started to write Search-R1's tags.

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
choice between the two is trained for a 10% prior (the built model's probability of searching
swings between ~1% and ~20% from one check to the next; with seed 0 it stops at 7%, and samples a
search 9% of the time on the training names). GRPO then raises the reward only by making it search more.

Reading the code from the observation is what the 2-layer character model learns last: trained on
whole trajectories only, its loss on the answer's digit stayed at ln 8 (a uniform guess) after 600
steps, so searching did not pay and GRPO had nothing to reinforce. The warm start therefore adds
reading drills (``reading_drill``); reading arrives at once after a plateau (held-out reading
accuracy ~10% for a few hundred steps, then ~100% within 25-50 steps). It stops once a search,
sampled at temperature 1, is written right to the end (query, answer tags, code, EOS) with mean
probability 0.85 on 64 held-out names (``search_probabilities``), checked every 25 steps: 425 steps
with seed 0, ~1 minute on 2 cores. Measured (2026-11-27, a script of these steps on 1 thread): the
old recipe (learning rate 2e-3, 16 trajectories and 32 drills a step, stopping at 90% teacher-forced
reading accuracy) read at step 875 with seed 0, and did not read within 1000 steps at 4e-3 (100
warm-up steps); the plateau is shorter at a lower rate and with more drills (7e-4 with 12 + 40: reading
by step 200-250 on seeds 0, 1 and 2; 1e-3 with 12 + 40, kept here: the whole search at 0.80 by step 375
and 0.85 by 425 with seed 0). A model stopped as soon as it read and copied the name (teacher-forced
argmax, 200 steps) sampled a whole search right 4% of the time: GRPO made it search more (0.04 ->
0.53 calls a sample by step 6), but its searches failed and the reward did not rise in 10 steps.
Hence the stop on the sampled search's probability (the old model's: 0.79).

Search-R1 needs no warm start: its 3B model follows the instruction in its prompt.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from unirl.models.cache import cached_build, default_cache_dir, progress, spec_digest
from unirl.text import tiny
from unirl.text.tiny_search_task import code, distinct_names, passage, question, task_codes

#: Everything that changes the built model goes into the cache key.
TINY_SEARCH_SPEC = {
    **tiny.TINY_LM_SPEC,
    "version": 2,
    "extra_chars": "<>()",
    "max_position_embeddings": 192,  # prompt + call + observation + answer is about 115 characters
    "warm_start_steps": 1500,  # at most: it stops once it writes a whole search right (exact_search)
    "exact_search": 0.85,
    "check_every": 25,  # steps between checks of it
    "warm_start_lr": 1e-3,
    "trajectories_per_step": 12,
    "drills_per_step": 40,
    "search_examples": 0.75,
    "search_prior": 0.1,  # trained for 0.1; the built model's share swings around it (module doc)
}


def build_tiny_search_lm(seed: int = 0) -> Path:
    """Build (or reuse) the warm-started tiny search model; return its directory (``model.name_or_path:
    tiny_search``)."""
    spec = dict(TINY_SEARCH_SPEC, seed=seed)
    directory = default_cache_dir() / f"tiny-search-{spec_digest(spec)}"
    return cached_build(directory, spec, "unirl_tiny.json", lambda work: _build(work, spec, seed),
                        what="the tiny search model (a warm start of about a minute on a CPU)")


def _build(directory: Path, spec: dict, seed: int) -> dict:
    """The warm-started model and its tokenizer, written to ``directory``; what the marker records."""
    tokenizer = tiny.build_tokenizer(extra=spec["extra_chars"])
    model = tiny.new_model(tokenizer, spec, seed)
    steps = warm_start(model, tokenizer, spec, seed)
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return {"warm_start_steps_taken": steps}


def warm_start(model, tokenizer, spec: dict, seed: int) -> int:
    """At most ``spec["warm_start_steps"]`` steps on names outside the task (see the module doc), each of
    ``trajectories_per_step`` whole trajectories and ``drills_per_step`` reading drills.

    Most trajectories search; the choice itself (the ``s`` of ``<search>`` or the ``a`` of
    ``<answer>``) is trained on every answer-at-once example and on a share ``r`` of the searching
    ones, so that the model searches ``search_prior`` of the time."""
    rng = random.Random(seed + 3)
    task_names = {n for part in task_codes().values() for n in part}
    pool = distinct_names(rng, 2000, exclude=task_names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["warm_start_lr"])
    model.train()
    # P(search) = s r / (s r + 1 - s) = prior, with s the share of searching trajectories and r the
    # share of them whose choice is trained.
    s, prior = spec["search_examples"], spec["search_prior"]
    r = prior * (1 - s) / ((1 - prior) * s)
    held_out = [(name, code(rng)) for name in distinct_names(rng, 64, exclude=task_names | set(pool))]
    for step in range(1, spec["warm_start_steps"] + 1):
        if step % spec["check_every"] == 0:
            searches_now, exact = search_probabilities(model, tokenizer, held_out)
            progress(f"tiny search model warm start: step {step}, searches {searches_now:.0%} of the time, writes "
                     f"{exact:.0%} of searches right to the end (done at {spec['exact_search']:.0%}, step "
                     f"{spec['warm_start_steps']} at most)")
            if exact >= spec["exact_search"]:
                break  # the step it happens varies with the data; the seed fixes it
        searches, guesses = [], []
        for _ in range(spec["trajectories_per_step"]):
            search = rng.random() < s
            (searches if search else guesses).append(example(
                tokenizer, rng.choice(pool), code(rng), search=search, guess=code(rng),
                choice_trained=not search or rng.random() < r))
        drills = [reading_drill(tokenizer, rng.choice(pool), code(rng)) for _ in range(spec["drills_per_step"])]
        _accumulated_step(model, optimizer, [searches, guesses, drills], tokenizer.pad_token_id)
    model.eval()
    return step


def _accumulated_step(model, optimizer, groups: list[list[tuple[list[int], list[int]]]], pad_id: int) -> None:
    """One step of mean token cross-entropy over every example of ``groups``, each group padded on its
    own (the lengths differ by kind: a third of the padded tokens of one batch)."""
    batches = [tiny.padded_batch(g, pad_id) for g in groups if g]
    trained = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)  # next-token targets
    for batch in batches:  # transformers' loss: sum over the batch's targets / num_items_in_batch
        model(**batch, num_items_in_batch=trained).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


@torch.no_grad()
def search_probabilities(model, tokenizer, pairs: list[tuple[str, str]]) -> tuple[float, float]:
    """Over ``(name, code)``: the mean probability that the model searches (``s`` after the question's
    ``<``), and the mean probability that, having chosen to search, it writes the rest of the searching
    trajectory exactly (``earch>NAME</search>``, then after the observation ``<answer>CODE</answer>`` and
    EOS): what a sample at temperature 1 gets right. Reading the code is what it learns last (module doc)."""
    model.eval()
    examples = [example(tokenizer, name, code, search=True, guess=code) for name, code in pairs]
    batch = tiny.padded_batch(examples, tokenizer.pad_token_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = logits.log_softmax(-1).double()  # a whole search's probability of an untrained model is ~1e-80
    searches = exact = 0.0
    for i, ((ids, labels), (name, _)) in enumerate(zip(examples, pairs)):
        choice = len(tokenizer(question(name) + "<").input_ids)  # the "s" of <search>
        searches += logp[i, choice - 1, ids[choice]].exp().item()
        rest = [t for t in range(choice + 1, len(ids)) if labels[t] != -100]  # the observation is not written
        exact += logp[i, [t - 1 for t in rest], [ids[t] for t in rest]].sum().exp().item()
    model.train()
    return searches / len(pairs), exact / len(pairs)


def reading_drill(tokenizer, name: str, code: str) -> tuple[list[int], list[int]]:
    """A searching trajectory from its observation on (``<information>...code 7</information>
    <answer>7</answer>``): the code sits as far before the answer as in the whole trajectory, among
    ~50 tokens instead of ~110. Without these the model learned the tags but not to read the code
    (its loss stayed at ln 8 after 600 steps); with them it reads it after a few hundred."""
    ids, labels = example(tokenizer, name, code, search=True, guess=code)
    start = len(tokenizer(question(name) + f"<search>{name}</search>").input_ids)
    return ids[start:], labels[start:]


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
