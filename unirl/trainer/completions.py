"""A few of each step's samples, written while the run trains (TRL's ``log_completions``): what the policy
writes is otherwise seen only at the end (or at a held-out evaluation).

``trainer.log_completions`` samples a step, one from each of the first groups (different prompts), go to
``RUN/samples.jsonl`` (step, prompt, response, reward, each reward's score, advantage) and to the
trackers as a table (``samples/completions``); every ``trainer.log_completions_every`` steps they are
also printed above the progress bar. The main process writes its own samples (no gathering: a look at
the policy's writing, not a statistic). A diffusion run's samples are pictures: its rows hold the prompt
and the scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unirl.env import Rollout

#: Characters of a prompt or response kept on the console (the file keeps them whole).
CONSOLE_CHARS = 200


def pick(rollout: Rollout, n: int) -> list[int]:
    """Up to ``n`` sample indices, the first sample of each of the first groups (in sample order)."""
    seen, picked = set(), []
    for i, group in enumerate(rollout.group_ids.tolist()):
        if len(picked) >= n:
            break
        if group not in seen:
            seen.add(group)
            picked.append(i)
    return picked


def records(rollout: Rollout, n: int) -> list[dict[str, Any]]:
    """The rows ``samples.jsonl`` gets for a trained ``rollout`` (after scoring and advantages), but their
    step: plain values, so the loop keeps them and not the batch's tensors until the logging stage."""
    out = []
    for i in pick(rollout, n):
        row: dict[str, Any] = {"prompt": rollout.prompts[i]}
        if isinstance(rollout.samples[i], str):
            row["response"] = rollout.samples[i]
        if rollout.rewards is not None:
            row["reward"] = float(rollout.rewards[i])
        row.update({key.removeprefix("score/"): float(value[i]) for key, value in rollout.tensors.items()
                    if key.startswith("score/") and value.ndim == 1 and not key.endswith("/parse_failed")})
        adv = rollout.advantages
        if adv is not None and (adv.ndim == 1 or bool((adv[i] == adv[i, 0]).all())):  # one per sample (GRPO's)
            row["advantage"] = float(adv[i] if adv.ndim == 1 else adv[i, 0])
        out.append(row)
    return out


def log_completions(run_log, rows: list[dict[str, Any]], step: int) -> None:
    """A step's ``records`` to ``samples.jsonl``, the trackers and, every ``trainer.log_completions_every``
    steps, the console (main process)."""
    cfg = run_log.cfg
    if not rows or not run_log.accelerator.is_main_process:
        return
    rows = [{"step": step, **row} for row in rows]
    with open(Path(run_log.run_dir) / "samples.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    columns = sorted({k for row in rows for k in row}, key=lambda k: (k not in ("step", "prompt", "response"), k))
    run_log.log_media({"tables": {"samples/completions": (columns, [[row.get(k) for k in columns] for row in rows])}},
                      step)
    if cfg.log_completions_every and step % cfg.log_completions_every == 0:
        _print(rows)


def _print(rows: list[dict[str, Any]]) -> None:
    from tqdm.auto import tqdm

    for row in rows:
        scores = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k not in ("step", "prompt", "response"))
        text = f"unirl: step {row['step']} sample: {_short(row['prompt'])!r}"
        if "response" in row:
            text += f" -> {_short(row['response'])!r}"
        tqdm.write(f"{text} ({scores})")  # above the progress bar, which stays whole


def _short(text: str) -> str:
    return text if len(text) <= CONSOLE_CHARS else text[: CONSOLE_CHARS - 3] + "..."
