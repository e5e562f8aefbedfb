"""The text environment's held-out evaluation, the one path both the run's own evaluation (``evaluate_held_out``,
every ``trainer.eval_every`` steps) and ``unirl eval`` (``unirl.evaluation.evaluate_text``) take: answers from
the environment's engine (``answer``: greedy or ``n`` sampled, multi-turn with the run's tools where it has
them, the turn limits of training) scored by the config's rewards (``score``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unirl.text.multiturn import multi_turn_generate
from unirl.text.multiturn_rollout import turn_limits


@dataclass
class Answer:
    """One answer to a held-out prompt: its text (with a tool-using policy or an environment's episode, the
    whole response, the observations in it, as the rewards see them in training), multi-turn its calls, and
    ``columns`` the rewards read beside the row's (an episode's ``episode_return`` and ``turns``)."""

    text: str
    tool_calls: int | None = None
    tool_errors: int | None = None
    columns: dict = field(default_factory=dict)


@torch.no_grad()
def answer(env, rows: list[dict], *, n: int = 1, greedy: bool = True, indices: list[int] | None = None
           ) -> list[list[Answer]]:
    """``n`` answers (one when ``greedy``) to each row from ``env.engine``, grouped by row: the episodes of the
    run's environment (``rollout.environment``), multi-turn with ``env.tools`` (the run's tools and turn
    limits), else one generation. Sampled answers use
    ``rollout.temperature/top_p/top_k``; ``rollout.eval_max_new_tokens`` (else ``max_new_tokens``) bounds
    each. ``indices``: the rows' places in the whole set, for error messages."""
    if not rows:
        return []
    r = env.cfg.rollout
    prompt_ids = [env.encode_prompt(row, i) for i, row in zip(indices or range(len(rows)), rows)]
    max_new_tokens = r.eval_max_new_tokens or r.max_new_tokens
    if getattr(env, "episodes", None) is not None:  # the run's environment's episodes (unirl/agents), as in training
        traces = env.episodes.play(env.engine, rows, n=n, greedy=greedy, max_new_tokens=max_new_tokens)
        return [[Answer(env.tokenizer.decode(t.ids, skip_special_tokens=True),
                        columns={"episode_return": t.episode_return, "turns": t.turns}) for t in group]
                for group in traces]
    sampling = dict(n=n, greedy=greedy, temperature=1.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_new_tokens=max_new_tokens)
    if env.tools is not None:  # a tool-using policy answers after its calls, as in training
        groups = multi_turn_generate(env.engine, env.tokenizer, *env.tools, prompt_ids, **sampling, **turn_limits(r))
        return [[Answer(env.tokenizer.decode(t.ids, skip_special_tokens=True), len(t.tool_calls), t.tool_errors)
                 for t in group] for group in groups]
    return [[Answer(g.text) for g in gens] for gens in env.engine.generate(prompt_ids, **sampling)]


def score(rewards, rows: list[dict], answers: list[list[Answer]]
          ) -> tuple[list[dict], list[str], dict[str, torch.Tensor], dict[str, list]]:
    """``(each answer's row, its text, each reward's scores [answers], a judge reward's answers)``, the answers
    flattened row by row, scored by ``rewards`` (a ``RewardSet``)."""
    flat_rows = [{**row, **a.columns} for row, per_row in zip(rows, answers) for a in per_row]
    texts = [a.text for per_row in answers for a in per_row]
    judged: dict[str, list] = {}
    if not texts:
        return flat_rows, texts, {}, judged
    columns = {k: [row.get(k) for row in flat_rows] for k in flat_rows[0] if k != "prompt"}
    comps = rewards.components(texts, prompts=[row["prompt"] for row in flat_rows], columns=columns, texts=judged)
    return flat_rows, texts, comps, judged


@torch.no_grad()
def evaluate_held_out(env, step: int, run_dir: Path) -> tuple[dict[str, float], dict]:
    """Greedy answers to the held-out prompts, scored by the config's rewards. With several
    processes each answers every world-th prompt and the scores are gathered; the main process
    writes the first 16 answers to ``eval_samples.jsonl`` (with a judge reward's answers under ``judge``).
    Returns the figures and what the trackers show (the first 16 answers as a table)."""
    if not env.test_rows:
        return {}, {}
    from accelerate.utils import gather_object

    acc = env.accelerator
    mine = list(range(acc.process_index, len(env.test_rows), acc.num_processes))
    rows = [env.test_rows[i] for i in mine]
    _, texts, comps, judged = score(env.rewards, rows, answer(env, rows, n=1, greedy=True, indices=mine))
    local = [(i, text, {k: float(v[j]) for k, v in comps.items()}, {k: v[j] for k, v in judged.items()})
             for j, (i, text) in enumerate(zip(mine, texts))]
    results = sorted(gather_object(local) if acc.num_processes > 1 else local)  # every prompt, in order
    names = list(env.rewards.names)
    scores = {k: torch.tensor([res[2][k] for res in results]) for k in names}
    # Accuracy: the share of answers that get the first reward's full score (1 for gsm8k).
    first = scores[names[0]]
    if acc.is_main_process:
        with open(run_dir / "eval_samples.jsonl", "a") as f:
            for i, text, s, judge in results[:16]:
                f.write(json.dumps({"step": step, "prompt": env.test_rows[i]["prompt"], "response": text,
                                    "score": s[names[0]], **({"judge": judge} if judge else {})}) + "\n")
    media = {"tables": {"eval/samples": (
        ["prompt", "response", names[0]], [[env.test_rows[i]["prompt"], text, s[names[0]]] for i, text, s, _ in results[:16]])}}
    out = {"eval/accuracy": (first >= 1.0).float().mean().item()}
    out.update({f"eval/reward/{k}": v.nanmean().item() for k, v in scores.items()})
    return out, media
