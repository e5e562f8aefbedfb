"""Where a training step's time goes: run a config for a few steps and summarise ``time/*``.

    python benchmarks/stage_times.py text tiny trainer.total_steps=30
    python benchmarks/stage_times.py text tiny rollout.engine=hf trainer.total_steps=30
    python benchmarks/stage_times.py diffusion tiny trainer.total_steps=10

Prints the median and mean of each stage over the steps after the first (which pays for warm-up),
the framework overhead (step - rollout - update: everything but generating and the update's
forward/backward), and the run's peak resident memory. The run directory is a temporary one unless ``--keep DIR``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("env", choices=["text", "diffusion"])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--keep", default=None, help="run directory to keep (default: a temporary one)")
    args = parser.parse_args()

    run = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="unirl-bench-")) / "run"
    cmd = [sys.executable, "-m", "unirl.cli", "train", args.env, "--config", args.config, "--output-dir", str(run),
           "trainer.progress=false", "trainer.eval_every=0", *args.overrides]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r][1:]
    if not rows:
        sys.exit("need at least 2 training steps")
    print(f"\n{args.env}/{args.config} {' '.join(args.overrides)}: {len(rows) + 1} steps, wall {wall:.1f} s "
          f"(incl. start-up and checkpoints), peak RSS {peak_mib:.0f} MiB")
    print(f"{'stage':<20}{'median s':>10}{'mean s':>10}{'share':>8}")
    total = statistics.mean(r["time/step"] for r in rows)
    for key in [k for k in rows[0] if k.startswith("time/")]:
        values = [r[key] for r in rows]
        print(f"{key:<20}{statistics.median(values):>10.4f}{statistics.mean(values):>10.4f}"
              f"{statistics.mean(values) / total:>8.1%}")
    # The limit of a step is generate + one forward/backward over the batch; the rest is the framework's.
    overhead = [r["time/step"] - r["time/rollout"] - r["time/update"] for r in rows]
    print(f"{'overhead':<20}{statistics.median(overhead):>10.4f}{statistics.mean(overhead):>10.4f}"
          f"{statistics.mean(overhead) / total:>8.1%}   (step - rollout - update)")


if __name__ == "__main__":
    main()
