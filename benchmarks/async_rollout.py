"""Synchronous steps beside asynchronous ones (``source.max_staleness=1``) and beside the rollout server,
side by side in one run: seconds a step and reward a step.

    python benchmarks/async_rollout.py                         # the tiny recipe (it learns), 40 steps each
    python benchmarks/async_rollout.py --model toy22m --steps 12   # the 22.6M-parameter Qwen2 shape (compare_trl.py's)
    python benchmarks/async_rollout.py --model smollm2 --steps 6   # SmolLM2-135M-Instruct, smollm2_math.yaml (~45 s a step)
    python benchmarks/async_rollout.py --modes sync,async --steps 20
    python benchmarks/async_rollout.py --modes sync,async,server,sync,async,server --steps 30   # twice, interleaved

Each mode is a ``unirl train text`` child process on the same two cores:

- ``sync``: colocated vLLM, generation then training, both on the two cores in turn (OMP_NUM_THREADS=2);
- ``async``: colocated vLLM, ``max_staleness=1``, the producer thread and the trainer at once in one process;
- ``server``: ``unirl serve-rollout`` pinned to core 0 (one thread), the trainer pinned to core 1 (one
  thread), ``max_staleness=1``: generation and training one core each;
- ``sync1``: ``sync`` pinned to core 0 with one thread: each stage's time on one core, so
  max(rollout, update) of this run is the best step any one-core-each overlap can reach.

The toy22m model is random (its reward stays near 0); the tiny recipe's model learns, so its reward
columns compare learning per step. Printed: the median s/step over the steps after the first two,
the throughput against ``sync``, and reward/mean over the first and last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def model_args(model: str, root: Path) -> list[str]:
    if model in ("tiny", "smollm2"):  # their own configs (smollm2_math: the named model, prepared in the cache)
        return []
    sys.path.insert(0, str(REPO / "benchmarks"))
    from compare_trl import SHAPES, build_toy_inputs

    model_dir, data = build_toy_inputs(root, SHAPES["toy"])
    return [f"model.name_or_path={model_dir}", f"data.train={data}", "data.test=null", "rollout.max_new_tokens=32"]


CONFIGS = {"tiny": "tiny", "toy22m": "tiny", "smollm2": "smollm2_math"}


def run_mode(mode: str, steps: int, extra: list[str], root: Path, model: str = "tiny") -> list[dict]:
    out = root / f"run-{mode}"
    root.mkdir(parents=True, exist_ok=True)
    args = [PY, "-m", "unirl.cli", "train", "text", "--config", CONFIGS[model], "--output-dir", str(out),
            f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
            "algo.tis_cap=2.0", "rollout.gpu_memory_utilization=0.1", *extra]  # a GPU's share; on a CPU the KV cache is sized to the run
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    server = None
    if mode == "sync":
        cmd, env["OMP_NUM_THREADS"] = args, "2"
    elif mode == "sync1":  # what each stage takes on one core: the bound on any one-core-each overlap
        cmd, env["OMP_NUM_THREADS"] = ["taskset", "-c", "0", *args], "1"
    elif mode == "async":
        cmd, env["OMP_NUM_THREADS"] = [*args, "source.max_staleness=1"], "2"
    else:
        served = next((a.split("=", 1)[1] for a in extra if a.startswith("model.name_or_path=")),
                      "smollm2-135m-instruct" if model == "smollm2" else "tiny")
        limit = ["--max-model-len", "256"] if model == "smollm2" else []  # smollm2_math's rollout.max_model_len
        server = subprocess.Popen(["taskset", "-c", "0", PY, "-m", "unirl.cli", "serve-rollout", served, "--dtype", "float32",
                                   "--port", "0", "--gpu-memory-utilization", "0.1", *limit], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  env={**env, "OMP_NUM_THREADS": "1"})
        line = server.stdout.readline()
        if not line.startswith("serving rollouts"):
            server.kill()
            raise SystemExit(f"serve-rollout did not start: {line!r}")
        url = line.split(" at ")[-1].strip()
        cmd = ["taskset", "-c", "1", *args, "rollout.engine=server", f"rollout.server_url={url}", "source.max_staleness=1"]
        env["OMP_NUM_THREADS"] = "1"
    try:
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(f"  {mode}: {len(rows)} steps, {wall:.0f} s wall (start-up included)", flush=True)
    return [r for r in rows if "reward/mean" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(CONFIGS), default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", default="sync,async,server")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="unirl-async-bench-"))
    extra = model_args(args.model, root)
    results = [(mode, run_mode(mode, args.steps, extra, root / str(i), args.model))
               for i, mode in enumerate(args.modes.split(","))]
    base = None
    print(f"\n{args.model}, {args.steps} steps | s/step (median, steps 3+) | throughput vs sync | wait for data s | "
          f"reward first 10 -> last 10 | rollout s, update s (median)")
    for mode, rows in results:
        step = statistics.median(r["time/step"] for r in rows[2:])
        base = step if mode == "sync" else base  # against the sync run just before (a mode may repeat)
        k = min(10, len(rows) // 2)
        first = sum(r["reward/mean"] for r in rows[:k]) / k
        last = sum(r["reward/mean"] for r in rows[-k:]) / k
        wait = statistics.median(r.get("perf/wait_for_data_s", float("nan")) for r in rows[2:])
        ratio = f"{base / step:.2f}x" if base else "-"
        stages = [statistics.median(r.get(f"time/{k}", float("nan")) for r in rows[2:]) for k in ("rollout", "update")]
        print(f"{mode:7s} | {step:.3f} | {ratio} | {wait:.3f} | {first:.3f} -> {last:.3f} | {stages[0]:.2f}, {stages[1]:.2f}")


if __name__ == "__main__":
    main()
