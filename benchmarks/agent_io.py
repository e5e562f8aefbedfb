"""Episodes that wait on I/O: the lock-step rollout against streamed episodes (``source.stream``), side by
side in one run, on the tiny game (``configs/text/tiny_game.yaml``) whose environment answers each move
after ``--latency`` seconds (an HTTP call, a sandbox; 0.2 s by default) over its 4 turns.

    python benchmarks/agent_io.py                                 # sync, stream; 20 steps each
    python benchmarks/agent_io.py --modes sync,stream,sync,stream --steps 20   # twice, interleaved

Each mode is a ``unirl train text`` child process on the same cores (``OMP_NUM_THREADS=2``):

- ``sync``: the lock-step rollout (``source.max_staleness=0``): a step plays its batch's episodes, every
  turn waiting for the slowest episode's environment, then trains; reproducible;
- ``stream``: ``source.stream=true`` with ``source.max_staleness=K`` (``--staleness``, 2): episodes of the
  next K prompt batches play while the trainer updates, turns go to the engine as they become ready, and
  each token keeps the weight version that sampled it (bypass mode: the ratio against each token's own).

Printed: per mode, episodes per second over the steps after the first (trained episodes / the steps'
seconds), the median seconds a step, reward/mean over the first and last 5 steps, and the last line
``... ratio X``: stream's episodes per second over sync's (the mean over the runs of each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from unirl.agents.protocol import Step  # noqa: E402
from unirl.agents.walk import Walk  # noqa: E402


class SlowWalk(Walk):
    """The tiny game, each move answered after ``latency_s`` seconds of waiting (I/O, not CPU)."""

    def __init__(self, row: dict, *, latency_s: float = 0.2, **kwargs):
        super().__init__(row, **kwargs)
        self.latency_s = latency_s

    async def step(self, action: str) -> Step:
        await asyncio.sleep(self.latency_s)
        return super().step(action)


def run_mode(mode: str, args, root: Path, index: int) -> list[dict]:
    out = root / f"run-{index}-{mode}"
    cmd = [sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny_game", "--output-dir", str(out),
           f"trainer.total_steps={args.steps}", "trainer.eval_every=0", "trainer.save_every=0",
           "trainer.progress=false", f"trainer.prompts_per_step={args.prompts}", f"trainer.group_size={args.group}",
           f"trainer.mini_batch_size={args.prompts * args.group}", f"trainer.micro_batch_size={args.prompts * args.group}",
           f"rollout.environment.name={Path(__file__).resolve()}:SlowWalk",
           f"rollout.environment.kwargs={{latency_s: {args.latency}}}", f"trainer.seed={args.seed}"]
    if mode == "stream":
        cmd += ["source.stream=true", f"source.max_staleness={args.staleness}"]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def summary(rows: list[dict], episodes_per_step: int) -> dict:
    later = rows[1:]
    seconds = sum(r["time/step"] for r in later)
    mean = lambda part: sum(r["reward/mean"] for r in part) / len(part)  # noqa: E731
    return {"episodes_per_s": episodes_per_step * len(later) / seconds,
            "s_per_step": statistics.median(r["time/step"] for r in later),
            "reward_first": mean(rows[:5]), "reward_last": mean(rows[-5:]),
            "rewards": [round(r["reward/mean"], 3) for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description="lock-step vs streamed episodes with slow environments")
    parser.add_argument("--modes", default="sync,stream")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="agent-io-"))
    results: dict[str, list[dict]] = {}
    for i, mode in enumerate(args.modes.split(",")):
        figures = summary(run_mode(mode, args, root, i), args.prompts * args.group)
        results.setdefault(mode, []).append(figures)
        print(f"{mode:6s} {figures['episodes_per_s']:6.1f} episodes/s  {figures['s_per_step']:.2f} s/step  "
              f"reward/mean first 5 {figures['reward_first']:.3f} -> last 5 {figures['reward_last']:.3f}  "
              f"per step {figures['rewards']}", flush=True)
    rate = {m: statistics.mean(f["episodes_per_s"] for f in rs) for m, rs in results.items()}
    if "sync" in rate and "stream" in rate:
        print(f"agent_io: {args.latency:g} s per environment step, {args.prompts}x{args.group} episodes a step; "
              f"stream/sync episodes per second ratio {rate['stream'] / rate['sync']:.2f}")


if __name__ == "__main__":
    main()
