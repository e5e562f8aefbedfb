"""The text environment's held-out evaluation: greedy answers (multi-turn with tools where the run has
them), scored by the run's rewards, gathered over processes, the first 16 written beside the run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from unirl.text.multiturn import multi_turn_generate
from unirl.text.multiturn_rollout import turn_limits


@torch.no_grad()
def evaluate_held_out(env, step: int, run_dir: Path) -> dict[str, float]:
    """Greedy answers to the held-out prompts, scored by the config's rewards. With several
    processes each answers every world-th prompt and the scores are gathered; the main process
    writes the first 16 answers to ``eval_samples.jsonl`` (with a judge reward's answers under ``judge``)."""
    if not env.test_rows:
        return {}
    from accelerate.utils import gather_object

    r, acc = env.cfg.rollout, env.accelerator
    mine = list(range(acc.process_index, len(env.test_rows), acc.num_processes))
    rows = env.with_pictures([env.test_rows[i] for i in mine])  # a VLM's pictures decoded for this evaluation only
    texts = []
    if rows:
        prompt_ids = [env.encode_prompt(row, i) for i, row in zip(mine, rows)]
        if env.tools is not None:  # greedy multi-turn, the tools called as in training
            groups = multi_turn_generate(env.engine, env.tokenizer, *env.tools, prompt_ids, n=1, greedy=True,
                                         temperature=1.0, max_new_tokens=r.eval_max_new_tokens or r.max_new_tokens,
                                         **turn_limits(r))
            texts = [env.tokenizer.decode(g[0].ids, skip_special_tokens=True) for g in groups]
        else:
            gens = env.engine.generate(prompt_ids, n=1, greedy=True, temperature=1.0,
                                        max_new_tokens=r.eval_max_new_tokens or r.max_new_tokens)
            texts = [g[0].text for g in gens]
    comps, judged = {}, {}  # judged: a judge reward's answers, by reward
    if rows:
        columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"}
        comps = env.rewards.components(texts, prompts=[row["prompt"] for row in rows], columns=columns, texts=judged)
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
    env.evaluation_media = {"tables": {"eval/samples": (
        ["prompt", "response", names[0]], [[env.test_rows[i]["prompt"], text, s[names[0]]] for i, text, s, _ in results[:16]])}}
    out = {"eval/accuracy": (first >= 1.0).float().mean().item()}
    out.update({f"eval/reward/{k}": v.nanmean().item() for k, v in scores.items()})
    return out
