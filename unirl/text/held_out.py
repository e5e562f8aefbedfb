"""The text environment's held-out evaluation, the one path both the run's own evaluation (``evaluate_held_out``,
every ``trainer.eval_every`` steps) and ``unirl eval`` (``unirl.evaluation.evaluate_text``) take, for each
evaluation protocol (``unirl/text/protocols.py``: the default set ``data.test`` and ``eval.protocols``):
answers from the environment's engine (``answer``: the protocol's n, temperature and seed; multi-turn with the
run's tools where it has them, the turn limits of training) scored by the config's rewards (``score``) and
summed up by ``figures`` (accuracy, the rewards, avg@k and pass@k, per group).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unirl.core.eval_metrics import avg_at_k, mean_pass_at_k
from unirl.text.multiturn import multi_turn_generate
from unirl.text.multiturn_rollout import turn_limits
from unirl.text.protocols import METRIC, EvalProtocol

#: Answers of each set written to ``eval_samples.jsonl`` and shown to the trackers per evaluation.
SHOWN = 16


@dataclass
class Answer:
    """One answer to a held-out prompt: its text (with a tool-using policy or an environment's episode, the
    whole response, the observations in it, as the rewards see them in training), multi-turn its calls, and
    ``columns`` the rewards read beside the row's (an episode's ``episode_return`` and ``turns``)."""

    text: str
    tool_calls: int | None = None
    tool_errors: int | None = None
    columns: dict = field(default_factory=dict)


@dataclass
class EvalSet:
    """A resolved protocol and its rows (``TextEnvironment.eval_sets``)."""

    protocol: EvalProtocol
    rows: list[dict]


def sampling(protocol: EvalProtocol) -> dict:
    """The engine's sampling settings under ``protocol``: greedy answers need no seed (none is passed, so an
    engine's greedy call is the call it was before protocols), sampled ones sample from the protocol's."""
    p = protocol
    return dict(n=p.n, greedy=p.greedy, temperature=1.0 if p.greedy else p.temperature, top_p=p.top_p, top_k=p.top_k,
                **({} if p.greedy else {"seed": p.seed}))


@torch.no_grad()
def answer(env, rows: list[dict], protocol: EvalProtocol, *, indices: list[int] | None = None) -> list[list[Answer]]:
    """``protocol.n`` answers (one when greedy) to each row from ``env.engine``, grouped by row: the episodes of
    the run's environment (``rollout.environment``), multi-turn with ``env.tools`` (the run's tools and turn
    limits), else one generation; at most ``protocol.max_new_tokens`` each (each turn). ``indices``: the
    rows' places in the whole set, for error messages."""
    if not rows:
        return []
    prompt_ids = [env.encode_prompt(row, i) for i, row in zip(indices or range(len(rows)), rows)]
    settings = sampling(protocol)
    if getattr(env, "episodes", None) is not None:  # the run's environment's episodes (unirl/agents), as in training
        n, greedy = settings.pop("n"), settings.pop("greedy")
        traces = env.episodes.play(env.engine, rows, n=n, greedy=greedy, max_new_tokens=protocol.max_new_tokens,
                                   sampling=settings)
        return [[Answer(env.tokenizer.decode(t.ids, skip_special_tokens=True),
                        columns={"episode_return": t.episode_return, "turns": t.turns}) for t in group]
                for group in traces]
    if env.tools is not None:  # a tool-using policy answers after its calls, as in training
        groups = multi_turn_generate(env.engine, env.tokenizer, *env.tools, prompt_ids, **settings,
                                     max_new_tokens=protocol.max_new_tokens, **turn_limits(env.cfg.rollout))
        return [[Answer(env.tokenizer.decode(t.ids, skip_special_tokens=True), len(t.tool_calls), t.tool_errors)
                 for t in group] for group in groups]
    gens = env.engine.generate(prompt_ids, **settings, max_new_tokens=protocol.max_new_tokens)
    return [[Answer(g.text) for g in group] for group in gens]


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


def weighted_total(rewards, comps: dict[str, torch.Tensor]) -> torch.Tensor:
    """[answers] the weighted sum of the raw rewards (a reward that does not apply adds nothing), whatever the
    run's aggregation: ``normalize_then_sum``'s group normalisation is for advantages."""
    total = torch.zeros_like(comps[rewards.names[0]], dtype=torch.float64)
    for cfg, name in zip(rewards.configs, rewards.names):
        total += cfg.weight * torch.nan_to_num(comps[name].double(), nan=0.0)
    return total


def figures(protocol: EvalProtocol, rewards, rows: list[dict], comps: dict[str, torch.Tensor],
            tool_calls: list[int] | None = None) -> dict[str, float]:
    """The protocol's figures over ``rows`` with ``protocol.n`` answers each (``comps``: each reward's scores
    [rows * n], row by row), unprefixed: ``reward`` (the weighted total's mean), ``reward/<name>``,
    ``accuracy`` (the share of answers that get the ``correct`` reward's full score, 1 for gsm8k: avg@n),
    the protocol's ``avg@k``/``pass@k``, ``tool_calls_mean``; with ``group_by`` the same per value of the
    column under ``<column>=<value>/``."""
    out = _figures(protocol, rewards, comps, torch.arange(len(rows)), tool_calls)
    if protocol.group_by is not None:
        column = protocol.group_by
        missing = next((i for i, row in enumerate(rows) if column not in row), None)
        if missing is not None:
            raise ValueError(f"eval protocol {protocol.name}: group_by={column!r}, but row {missing} has no such "
                             f"column (columns: {sorted(rows[missing])})")
        values = [str(row[column]) for row in rows]
        for value in sorted(set(values)):
            chosen = torch.tensor([i for i, v in enumerate(values) if v == value])
            out.update({f"{column}={value}/{k}": v
                        for k, v in _figures(protocol, rewards, comps, chosen, tool_calls).items()})
    return out


def _figures(protocol: EvalProtocol, rewards, comps: dict[str, torch.Tensor], chosen: torch.Tensor,
             tool_calls: list[int] | None) -> dict[str, float]:
    """``figures`` of the rows ``chosen`` [P'] (their n answers each)."""
    n = protocol.n
    answers = (chosen.unsqueeze(-1) * n + torch.arange(n)).reshape(-1)  # [P' * n]
    mine = {k: v[answers] for k, v in comps.items()}
    out = {"reward": weighted_total(rewards, mine).mean().item(),
           **{f"reward/{k}": v.double().nanmean().item() for k, v in mine.items()}}
    correct = mine[protocol.correct or rewards.names[0]].view(-1, n) >= 1.0  # [P', n]
    out["accuracy"] = avg_at_k(correct).item()
    for metric in protocol.metrics:
        kind, k = METRIC.match(metric).groups()
        out[metric] = (avg_at_k(correct) if kind == "avg" else mean_pass_at_k(correct, int(k))).item()
    if tool_calls is not None:
        out["tool_calls_mean"] = sum(tool_calls[i] for i in answers.tolist()) / max(1, len(answers))
    return out


@torch.no_grad()
def evaluate_held_out(env, step: int, run_dir: Path) -> tuple[dict[str, float], dict]:
    """Each of ``env.eval_sets`` (the default set's figures under ``eval/``, a protocol's under
    ``eval/<name>/``): answered, scored and summed up (``figures``). With several processes each answers every
    world-th prompt and the scores are gathered; the main process writes the first 16 answers of each set to
    ``eval_samples.jsonl`` (a protocol's with its name; a judge reward's answers under ``judge``).
    Returns the figures and what the trackers show (the first 16 answers of each set as a table)."""
    out, tables = {}, {}
    for eval_set in env.eval_sets:
        figs, table = _evaluate_set(env, eval_set, step, run_dir)
        out.update(figs)
        if table is not None:
            tables[f"{eval_set.protocol.prefix('eval/')}samples"] = table
    return out, ({"tables": tables} if tables else {})


def _evaluate_set(env, eval_set: EvalSet, step: int, run_dir: Path) -> tuple[dict[str, float], tuple | None]:
    from accelerate.utils import gather_object

    protocol, all_rows = eval_set.protocol, eval_set.rows
    if not all_rows:
        return {}, None
    acc = env.accelerator
    mine = list(range(acc.process_index, len(all_rows), acc.num_processes))
    rows = [all_rows[i] for i in mine]
    answers = answer(env, rows, protocol, indices=mine)
    _, texts, comps, judged = score(env.rewards, rows, answers)
    flat = [a for per_row in answers for a in per_row]
    n = protocol.n
    local = [(mine[j // n], j % n, text, {k: float(v[j]) for k, v in comps.items()},
              {k: v[j] for k, v in judged.items()}, flat[j].tool_calls) for j, text in enumerate(texts)]
    results = sorted(gather_object(local) if acc.num_processes > 1 else local)  # every answer, in order
    scores = {k: torch.tensor([res[3][k] for res in results], dtype=torch.float64) for k in results[0][3]}
    calls = [res[5] for res in results] if results[0][5] is not None else None
    prefix = protocol.prefix("eval/")
    out = {prefix + k: v for k, v in figures(protocol, env.rewards, all_rows, scores, calls).items()}
    first = protocol.correct or env.rewards.names[0]
    shown = results[:SHOWN]
    if acc.is_main_process:
        named = {} if protocol.name is None else {"protocol": protocol.name}
        with open(run_dir / "eval_samples.jsonl", "a") as f:
            for i, _, text, s, judge, _ in shown:
                f.write(json.dumps({"step": step, **named, "prompt": all_rows[i]["prompt"], "response": text,
                                    "score": s[first], **({"judge": judge} if judge else {})}) + "\n")
    return out, (["prompt", "response", first], [[all_rows[i]["prompt"], text, s[first]] for i, _, text, s, _, _ in shown])
