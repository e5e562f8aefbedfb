"""The model of the tiny game (``model.name_or_path: tiny_game``, ``configs/text/tiny_game.yaml``): the tiny
model's architecture and character tokenizer (``unirl/text/tiny.py``), warm-started to play the walk of
``unirl/agents/walk.py`` with a noisy policy, so that RL has something to sharpen within seconds.

A model from scratch never writes ``r`` or ``l`` followed by EOS, and GRPO cannot find a reward it never
samples. The warm start teaches the moves in two phases, on whole episodes written as the rollout writes
them (the observations are not trained on, as in RL):

1. the right move every time, until the model picks it with mean probability ``clean_until`` over every
   state of the game (it has learned to compare its cell with the goal);
2. the right move only ``noisy_right`` of the time (the wrong one otherwise), until its mean probability
   of the right move falls to ``noisy_until``: the comparison is kept, the policy is blurred.

The built model then reaches the goal about half the time when sampled (a goal four cells away needs
four right moves in four turns), and GRPO with the ``episode_return`` reward raises that towards 1 by
making the right move surer. Its greedy play is already good (the right move is the likelier one):
the game measures what RL does to a sampled policy, not a held-out skill.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from unirl.agents.tiny_game_task import pairs
from unirl.agents.walk import move, observation
from unirl.models.cache import cached_build, default_cache_dir, progress, spec_digest
from unirl.text import tiny

#: Everything that changes the built model goes into the cache key.
TINY_GAME_SPEC = {
    **tiny.TINY_LM_SPEC,
    "version": 1,
    "warm_start_lr": 1e-3,
    "episodes_per_step": 32,
    "max_turns": 4,
    "check_every": 10,
    "clean_until": 0.97,  # phase 1 stops when the right move's mean probability reaches this ...
    "clean_steps": 600,  # ... or after this many steps
    "noisy_right": 0.6,  # phase 2: the share of right moves in its episodes, at a lower rate
    "noisy_lr": 2e-4,  # (at 1e-3 one check later it had fallen from 0.98 to 0.51, past its mark)
    "noisy_until": 0.66,  # phase 2 stops when the right move's mean probability falls to this ...
    "noisy_steps": 400,  # ... or after this many steps
}


def build_tiny_game_lm(seed: int = 0) -> Path:
    """Build (or reuse) the warm-started tiny game model; return its directory."""
    spec = dict(TINY_GAME_SPEC, seed=seed)
    directory = default_cache_dir() / f"tiny-game-{spec_digest(spec)}"
    return cached_build(directory, spec, "unirl_tiny.json", lambda work: _build(work, spec, seed),
                        what="the tiny game model (a warm start of well under a minute on a CPU)")


def _build(directory: Path, spec: dict, seed: int) -> dict:
    tokenizer = tiny.build_tokenizer()
    model = tiny.new_model(tokenizer, spec, seed)
    figures = warm_start(model, tokenizer, spec, seed)
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return figures


def warm_start(model, tokenizer, spec: dict, seed: int) -> dict:
    """The two phases of the module doc; returns the steps each took and the final probability."""
    rng = random.Random(seed + 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["warm_start_lr"])
    figures = {}
    for phase, right, steps, every, done in (
            ("clean", 1.0, spec["clean_steps"], spec["check_every"], lambda p: p >= spec["clean_until"]),
            ("noisy", spec["noisy_right"], spec["noisy_steps"], 1, lambda p: p <= spec["noisy_until"])):
        if phase == "noisy":
            for group in optimizer.param_groups:
                group["lr"] = spec["noisy_lr"]
        model.train()
        for step in range(1, steps + 1):
            examples = [episode_example(tokenizer, *rng.choice(pairs()), right=right, rng=rng,
                                        max_turns=spec["max_turns"]) for _ in range(spec["episodes_per_step"])]
            tiny.supervised_step(model, optimizer, examples, tokenizer.pad_token_id)
            if step % every == 0:
                p = right_move_probability(model, tokenizer)
                progress(f"tiny game model warm start, {phase} phase: step {step}, right move {p:.0%}")
                if done(p):
                    break
        figures[f"{phase}_steps"], figures[f"{phase}_right_move"] = step, right_move_probability(model, tokenizer)
    model.eval()
    return figures


def episode_example(tokenizer, start: int, goal: int, *, right: float, rng: random.Random,
                    max_turns: int) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of one episode played with the right move ``right`` of the time, written as
    the rollout writes it: each move and its EOS trained, each observation after it not (-100)."""
    ids = tokenizer(observation(start, goal)).input_ids
    labels = [-100] * len(ids)
    cell = start
    for _ in range(max_turns):
        best = "r" if goal > cell else "l"
        action = best if rng.random() < right else ("l" if best == "r" else "r")
        turn = tokenizer(action, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        ids, labels = ids + turn, labels + turn
        cell = move(cell, action)
        if cell == goal:
            break
        seen = tokenizer(observation(cell, goal), add_special_tokens=False).input_ids
        ids, labels = ids + seen, labels + [-100] * len(seen)
    return ids, labels


@torch.no_grad()
def right_move_probability(model, tokenizer) -> float:
    """The mean probability of the right first move over every start/goal pair of the game."""
    was_training = model.training
    model.eval()
    prompts = [tokenizer(observation(s, g)).input_ids for s, g in pairs()]
    right = [tokenizer("r" if g > s else "l", add_special_tokens=False).input_ids[0] for s, g in pairs()]
    batch = torch.tensor(prompts)  # [60, L]: every observation of the game has the same length
    probs = model(input_ids=batch).logits[:, -1].softmax(-1)  # [60, V]
    model.train(was_training)
    return probs[torch.arange(len(right)), torch.tensor(right)].mean().item()
