"""Packed (``model.share_prompt=true``) against unpacked rows for the tiny VLM, paired in one process.

    python benchmarks/vlm_packing.py                      # tiny_vlm's batch: 16 prompts x 8 samples
    python benchmarks/vlm_packing.py --repeats 5 trainer.prompts_per_step=8

One environment (``configs/text/tiny_vlm.yaml`` plus the overrides) samples one batch; then the same
batch is scored packed and unpacked, alternately (ABAB, so that load on shared cores falls on both), as
the trainer's stages do it: the old-policy recompute (no grad) and the update's forward + backward over
``trainer.micro_batch_size`` samples at a time. Prints each side's median and the ratio, the largest
log-prob difference between the two (float rounding only), and the rollout's time for scale (the same
with either setting: generation never packs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _env(overrides: list[str]):
    from accelerate import Accelerator

    from unirl.cli import load_run_config
    from unirl.text.env import TextEnvironment

    cfg = load_run_config("text", "tiny_vlm", ["model.share_prompt=true", *overrides],
                          output_dir=tempfile.mkdtemp(prefix="unirl-bench-"))
    env = TextEnvironment(cfg)
    env.setup(Accelerator(cpu=not torch.cuda.is_available()))
    return env


def _score(env, batch, share: bool, micro: int) -> tuple[float, float, torch.Tensor]:
    """(no-grad recompute seconds, forward + backward seconds, log-probs) of ``batch`` with ``share``."""
    env.cfg.model.share_prompt = share
    n = batch.tensors["prompt_ids"].shape[0]
    pieces = [env.actions.trim_padding(batch.select(torch.arange(i, min(i + micro, n)))) for i in range(0, n, micro)]  # as the loop
    start = time.perf_counter()
    with torch.no_grad():
        logp = torch.cat([env.actions.score_actions(env.model, piece)["logp"] for piece in pieces])
    recompute = time.perf_counter() - start
    start = time.perf_counter()
    for piece in pieces:
        scored = env.actions.score_actions(env.model, piece)
        (scored["logp"] * scored["mask"]).sum().backward()
    env.model.zero_grad(set_to_none=True)
    return recompute, time.perf_counter() - start, logp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    env = _env(args.overrides)
    cfg = env.cfg.trainer
    rows = env.train_rows[:cfg.prompts_per_step]
    start = time.perf_counter()
    batch = env.sampler.rollout(rows, group_size=cfg.group_size)
    rollout = time.perf_counter() - start
    mask = batch.tensors["response_mask"].bool()
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    logps = {}
    for _ in range(args.repeats):
        for share in (True, False):
            recompute, update, logps[share] = _score(env, batch, share, cfg.micro_batch_size)
            times[share].append((recompute, update))
    print(f"tiny_vlm {' '.join(args.overrides)}: {len(rows)} prompts x {cfg.group_size}, micro-batch "
          f"{cfg.micro_batch_size}, {args.repeats} paired repeats; rollout {rollout:.2f} s (either setting)")
    print(f"{'':<22}{'packed s':>10}{'unpacked s':>12}{'ratio':>8}   (median; min)")
    for k, name in enumerate(("recompute (no grad)", "forward + backward")):
        for how, f in (("median", statistics.median), ("min", min)):
            packed, unpacked = f(t[k] for t in times[True]), f(t[k] for t in times[False])
            print(f"{name + ' ' + how:<22}{packed:>10.3f}{unpacked:>12.3f}{packed / unpacked:>8.2f}")
    diff = (logps[True] - logps[False])[mask].abs().max()
    print(f"largest |log-prob difference| packed vs unpacked over {int(mask.sum())} response tokens: {diff:.2e}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
