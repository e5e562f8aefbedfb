"""Checkpoints of a run: ``<run>/checkpoints/step_N/`` and resuming from the latest.

A checkpoint holds the policy as its library saves it (``env.save_pretrained``: HF
``save_pretrained``, a LoRA adapter, a diffusers transformer) and ``trainer_state/``: what
Accelerate saves of the prepared models, optimizers and schedulers, the RNG states, the objects
registered with it (an EMA), and ``loop.json`` with the loop's own counters. Each is written under a
temporary name and renamed, so a crash never leaves a half checkpoint that resume would pick.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's finished checkpoints, oldest first."""
    return sorted((Path(run_dir) / "checkpoints").glob("step_*"))


def last_checkpoint_hint(run_dir: Path) -> str:
    """What a crash leaves behind, for error messages."""
    steps = checkpoint_dirs(run_dir)
    if not steps:
        return "no checkpoint was written yet"
    return f"the last checkpoint is {steps[-1]} (resume with trainer.resume=true)"


def save_checkpoint(accelerator, env, run_dir: Path, step: int, loop_state: dict[str, Any],
                    keep: int | None) -> Path:
    """Write ``checkpoints/step_<step>/`` (the policy and ``trainer_state/``) on every process (FSDP
    gathers the full weights collectively; the main process writes), then keep the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()  # the directory exists before any process writes into it
    env.save_pretrained(tmp)
    accelerator.save_state(str(tmp / "trainer_state"))
    if accelerator.is_main_process:
        (tmp / "trainer_state" / "loop.json").write_text(json.dumps(loop_state))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _prune(root, keep)
    accelerator.wait_for_everyone()
    return final


def _prune(root: Path, keep: int | None) -> None:
    if keep is None:
        return
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resume(accelerator, run_dir: Path) -> dict[str, Any] | None:
    """Load the latest checkpoint's ``trainer_state`` into the prepared objects and return its
    ``loop.json`` (None when there is no checkpoint yet). The logs' rows of steps after it are
    dropped, so every step appears once."""
    steps = checkpoint_dirs(run_dir)
    if not steps:
        accelerator.print(f"resume: no checkpoint in {Path(run_dir) / 'checkpoints'}; starting at step 0")
        return None
    latest = steps[-1]
    accelerator.load_state(str(latest / "trainer_state"))
    state = json.loads((latest / "trainer_state" / "loop.json").read_text())
    if accelerator.is_main_process:
        for name in ("metrics.jsonl", "eval_samples.jsonl"):
            drop_rows_after(Path(run_dir) / name, state["step"])
    accelerator.wait_for_everyone()
    accelerator.print(f"resumed from {latest} (step {state['step']})")
    return state


def drop_rows_after(path: Path, step: int) -> None:
    """Rewrite a JSONL log without the rows of steps after ``step`` (logged after the checkpoint a
    run resumes from), so that every step appears once. Written to a temporary file and renamed."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
