"""Two distillation updates on a fixed global batch, run by 1 process or by 2 under ``torchrun``.

Used by ``tests/test_distill.py``; not a test module itself. ``--prepare`` samples one text rollout of
the tiny model (4 prompts x 4 answers) with fixed random rewards, in a single process; each process then
takes its contiguous share (``dist_equivalence.local_share``: responses trimmed to the share's own
longest, so widths differ between processes) and a fresh Trainer with the teacher runs the loop's
``learn`` stages twice (old and teacher log-probs, the advantages, the update), ``distill.mode`` alone
and added. The main process writes the logged figures and the updated weights as JSON.

    python tests/dist_distill.py --prepare --teacher DIR --batch B.pt --work DIR
    torchrun --nproc_per_node 2 tests/dist_distill.py --teacher DIR --batch B.pt --work DIR --out OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dist_equivalence import local_share

PROMPTS, GROUP, MICRO = 4, 4, 4


def make_trainer(teacher: str, world: int, mode: str, run_dir: Path):
    from unirl.api import load_config
    from unirl.config.environments import ENVIRONMENTS, import_object
    from unirl.trainer.loop import Trainer

    cfg = load_config("text", "tiny", [
        f"distill.teacher={teacher}", f"distill.mode={mode}", "distill.coef=0.5", "rollout.engine=hf",
        "rollout.max_new_tokens=8", f"trainer.prompts_per_step={PROMPTS // world}", f"trainer.group_size={GROUP}",
        f"trainer.mini_batch_size={PROMPTS * GROUP // world}", f"trainer.micro_batch_size={MICRO}",
        "trainer.eval_every=0", "trainer.progress=false", "trainer.reward_workers=0", "optim.lr=3e-4",
        f"output_dir={run_dir}"])
    env = import_object(ENVIRONMENTS["text"][1])(cfg)
    trainer = Trainer(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                      distill=cfg.distill)
    trainer.setup()
    return trainer


def prepare(teacher: str, batch_path: Path, work: Path) -> None:
    trainer = make_trainer(teacher, 1, "alone", work)
    rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), GROUP)
    rewards = torch.rand(len(rollout), generator=torch.Generator().manual_seed(7))
    trainer.env.close()
    torch.save({"rollout": rollout, "rewards": rewards}, batch_path)


def run(teacher: str, batch_path: Path, work: Path, out_path: Path) -> None:
    from accelerate import PartialState

    from unirl.trainer.distributed import cpu_processes

    state = PartialState(cpu=cpu_processes())  # as the Trainer's Accelerator will
    batch = torch.load(batch_path, weights_only=False)
    results = {}
    for mode in ("alone", "added"):
        trainer = make_trainer(teacher, state.num_processes, mode, work / mode)
        rollout, rewards = local_share(batch["rollout"], batch["rewards"], state.process_index, state.num_processes)
        for _ in range(2):  # the second from updated weights: another student log-prob, another reverse KL
            _, metrics = trainer.learn(rollout, rewards)
        model = trainer.accelerator.unwrap_model(trainer.env.model)
        weights = torch.cat([p.detach().flatten().float().cpu() for p in model.parameters() if p.requires_grad])
        results[mode] = {**{k: float(v) for k, v in metrics.items()}, "weights": weights.tolist(),
                         "world": state.num_processes}
        trainer.env.close()
    if state.is_main_process:
        out_path.write_text(json.dumps(results))
    state.wait_for_everyone()
    state.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--prepare", action="store_true")
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--batch", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.prepare:
        prepare(args.teacher, args.batch, args.work)
    else:
        run(args.teacher, args.batch, args.work, args.out)
