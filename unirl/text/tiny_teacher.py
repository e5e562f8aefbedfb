"""``tiny_teacher``: the distillation demo's teacher, the tiny model after the tiny demo's GRPO recipe, built here.

``configs/text/tiny_distill.yaml`` distils it into a fresh ``tiny`` (the very model GRPO starts from in
``configs/text/tiny.yaml``). The teacher is that demo's run itself: ``configs/text/tiny.yaml``'s 150
steps of GRPO, with the transformers engine instead of vLLM (vLLM's CPU sampling is not bit-reproducible
over 150 steps, the transformers engine under pinned threads is) and one torch thread, so the same spec
builds the same weights on any machine. It runs once, in a child process (a clean world of one, whatever
launched the caller), and its final checkpoint is cached beside the tiny model (``cached_build``); the
marker keeps its held-out accuracy. About 2-3 minutes on a CPU core.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from unirl.models.cache import cached_build, default_cache_dir, spec_digest
from unirl.text.tiny import TINY_LM_SPEC, build_tiny_lm

#: The tiny demo's recipe (configs/text/tiny.yaml, whose text is hashed into the spec) and what the build
#: changes in it: the sampler and the run's files.
OVERRIDES = ["rollout.engine=hf", "trainer.save_every=0", "trainer.progress=false"]
TINY_TEACHER_SPEC = {"version": 1, "recipe": "tiny", "overrides": OVERRIDES, "threads": 1}

# Launch variables of the caller's world: the build is a run of its own, one process.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU")


def build_tiny_teacher(seed: int = 0) -> Path:
    """Build (or reuse) the tiny teacher; returns its model directory (model, tokenizer, the task's files)."""
    from unirl.config import resolve_config_path

    recipe = Path(resolve_config_path("text", TINY_TEACHER_SPEC["recipe"]))
    spec = dict(TINY_TEACHER_SPEC, seed=seed, student=spec_digest(dict(TINY_LM_SPEC, seed=seed)),
                recipe_sha=hashlib.sha256(recipe.read_bytes()).hexdigest()[:12])
    directory = default_cache_dir() / f"tiny-teacher-{spec_digest(spec)}"
    return cached_build(directory, spec, "unirl_tiny_teacher.json", lambda work: _build(work, recipe, seed),
                        what="the tiny distillation teacher (the tiny demo's 150 GRPO steps, a few minutes)")


def _build(directory: Path, recipe: Path, seed: int) -> dict:
    """The recipe's run in a child process, its last checkpoint's model and tokenizer copied to ``directory``
    with the task's files; returns the held-out accuracies it logged (kept in the marker)."""
    base = build_tiny_lm(seed=seed)
    run = directory / "run"
    cmd = [sys.executable, "-m", "unirl.cli", "train", "text", "--config", str(recipe), *OVERRIDES,
           f"model.name_or_path={base}", f"data.train={base / 'train.jsonl'}", f"data.test={base / 'test.jsonl'}",
           f"trainer.seed={seed}", "--output-dir", str(run)]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS=str(TINY_TEACHER_SPEC["threads"]), MKL_NUM_THREADS=str(TINY_TEACHER_SPEC["threads"]))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny teacher failed (exit {done.returncode}): {' '.join(cmd)}\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    for item in last.iterdir():
        if item.is_file():
            shutil.copy2(item, directory / item.name)
    for name in ("train.jsonl", "test.jsonl"):
        shutil.copy2(base / name, directory / name)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accuracy = {str(r["step"]): r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    shutil.rmtree(run)
    return {"eval_accuracy": accuracy}
