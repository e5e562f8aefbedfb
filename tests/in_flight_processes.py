"""Each process's in-flight batches through a checkpoint, run by 2 processes under ``torchrun`` (gloo, CPU).

Used by ``tests/test_in_flight_batches.py``; not a test module itself. Each process runs its own threaded
source (k=2) over its own share of the prompts, as a training run does (docs/async.md): here a produce
function whose batches differ by process. It trains 3 steps, checkpoints after steps 2 and 3, resumes into a
fresh source and writes ``OUT.rank<r>.json``: the samples of the batches it held at step 3 and of the
batches the resume gave it back. ``--other RUN`` then resumes RUN (a checkpoint written by another number of
processes) and records the error resume stops with.

    torchrun --standalone --nproc_per_node 2 tests/in_flight_processes.py --work DIR --out OUT [--other RUN]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_in_flight_batches import K, TOTAL, VOCAB, _Env, produce  # noqa: E402 (the one-process test's batches)


def own_source(rank: int):
    """A threaded source whose batch b is the one-process test's batch b + 100 * rank: this process's share."""
    from unirl.rollout.sources import ThreadedSource

    return ThreadedSource(K, TOTAL, lambda batch, *a, **kw: produce(batch + 100 * rank, *a, **kw),
                          lambda snapshot: None, vocab_size=VOCAB)


def samples(source) -> dict[str, list[str]]:
    return {str(b): p.rollout.samples for b, p in sorted(source._ready.items())}


def main() -> None:
    from accelerate import Accelerator

    from unirl.config.schema import TrainerConfig
    from unirl.trainer import checkpoints
    from unirl.trainer.backends import build_backend

    args = argparse.ArgumentParser()
    args.add_argument("--work", type=Path, required=True)
    args.add_argument("--out", type=Path, required=True)
    args.add_argument("--other", type=Path)
    args = args.parse_args()
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    backend, policy = build_backend(accelerator, TrainerConfig()), torch.nn.Linear(2, 2)
    env = _Env(policy) if accelerator.is_main_process else type("_Quiet", (), {"save_pretrained": lambda s, d: None})()
    rollouts = own_source(rank)
    rollouts.start(0, 0, snapshot=0)
    for step in range(3):
        if rollouts.needs_weights(step):
            rollouts.publish(step, step, step)
        rollouts.get(step, step)
        if step + 1 >= 2:
            checkpoints.save_checkpoint(backend, env, args.work, step + 1, {"policy": ("model", policy),
                                        "source": ("state", rollouts)}, {"step": step + 1, "optimizer_steps": step + 1},
                                        keep=None)
    held = samples(rollouts)
    rollouts.close()
    fresh = own_source(rank)
    state = checkpoints.resume(backend, args.work, {"policy": ("model", policy), "source": ("state", fresh)})
    out = {"rank": rank, "step": state["step"], "held": held, "resumed": samples(fresh)}
    if args.other is not None:
        try:
            checkpoints.resume(backend, args.other, {"policy": ("model", policy), "source": ("state", own_source(rank))})
            out["other"] = "resumed"
        except checkpoints.CheckpointError as e:
            out["other"] = str(e)
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(out))
    accelerator.wait_for_everyone()
    accelerator.state.destroy_process_group()  # after the barrier: both processes leave gloo together


if __name__ == "__main__":
    main()
