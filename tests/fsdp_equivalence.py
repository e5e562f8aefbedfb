"""DDP and FSDP2 on the same two processes: the same updates, figures and weights.

Used by ``tests/test_fsdp.py``; not a test module itself. On the global batch of the tiny LM and of
the toy SD3 with fixed random rewards that ``tests/dist_equivalence.py --prepare`` makes (the
session's ``equivalence_batch`` fixture), under ``torchrun --nproc_per_node 2``, each case runs
twice, ``trainer.strategy=ddp`` and ``trainer.strategy=fsdp2``, from the same initial weights on the same local rows: GRPO with the KL
to a frozen (sharded) reference, PPO with a (sharded) critic and the KL in the reward, and FlowGRPO on
the toy SD3 with LoRA. The main process writes the logged figures and every trained weight, gathered
whole from the shards.

    python tests/dist_equivalence.py --prepare --batch B.pt --work DIR
    torchrun --nproc_per_node 2 tests/fsdp_equivalence.py --batch B.pt --work DIR --out OUT.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dist_equivalence import PPO, local_share, make_trainer

CASES = {  # name: (environment, loss aggregation, KL coefficient, overrides)
    "grpo": ("text", "seq-mean-token-mean", 0.05, []),
    "ppo": ("text", "token-mean", 0.0, PPO),
    "flowgrpo-lora": ("diffusion", "token-mean", 0.05, []),
}
# Each case under DDP and FSDP2; GRPO also with FSDP2's host offload and with activation checkpointing.
RUNS = [(case, strategy) for case in CASES for strategy in ("ddp", "fsdp2")] + [("grpo", "fsdp2-offload"),
                                                                                  ("grpo", "fsdp2-checkpointing")]
VARIANTS = {"ddp": ["trainer.strategy=ddp"], "fsdp2": ["trainer.strategy=fsdp2"],
            "fsdp2-offload": ["trainer.strategy=fsdp2", "trainer.fsdp.offload=params"],
            "fsdp2-checkpointing": ["trainer.strategy=fsdp2", "model.gradient_checkpointing=true"]}


def trained_weights(model) -> torch.Tensor:
    from unirl.sharding import full

    return torch.cat([full(p.detach()).flatten().float().cpu() for p in model.parameters() if p.requires_grad])


def run(batch_path: Path, work: Path, out_path: Path) -> None:
    from accelerate import PartialState

    from unirl.trainer.distributed import cpu_processes
    from unirl.sharding import is_sharded

    state = PartialState(cpu=cpu_processes())
    batches = torch.load(batch_path, weights_only=False)
    results = {}
    for case, strategy in RUNS:
        env_name, agg, kl, overrides = CASES[case]
        trainer = make_trainer(env_name, state.num_processes, agg, kl, work / f"{case}-{strategy}",
                               [*overrides, *VARIANTS[strategy]])
        models = [trainer.env.model] + ([trainer.critic.model] if trainer.critic is not None else [])
        assert all(is_sharded(m) == (strategy != "ddp") for m in models), case
        rollout, rewards = local_share(batches[env_name]["rollout"], batches[env_name]["rewards"],
                                       state.process_index, state.num_processes)
        start = trained_weights(trainer.accelerator.unwrap_model(trainer.env.model))
        steps = []
        for _ in range(2):  # the second starts away from the reference and the sampling policy
            _, metrics = trainer.learn(rollout, rewards)
            steps.append(metrics)
        results[(case, strategy)] = {
            "steps": steps, "start": start, "weights": trained_weights(trainer.accelerator.unwrap_model(trainer.env.model)),
            "critic": trained_weights(trainer.critic.model) if trainer.critic is not None else None,
            "sharded_ref": getattr(trainer.env, "ref", None) is not None and is_sharded(trainer.env.ref)}
        trainer.env.close()
    if state.is_main_process:
        torch.save(results, out_path)
    state.wait_for_everyone()
    state.destroy_process_group()


def load(checkpoint: Path, strategy: str, work: Path, out_path: Path) -> None:
    """Load ``checkpoint``'s trainer state (written by any number of processes) into a fresh tiny-LM trainer
    under ``strategy``; the main process writes the weights and AdamW moments, gathered whole."""
    from accelerate import PartialState

    from unirl.trainer import checkpoints
    from unirl.trainer.distributed import cpu_processes
    from unirl.sharding import full

    state = PartialState(cpu=cpu_processes())
    trainer = make_trainer("text", 1, "token-mean", 0.0, work, ["rollout.engine=hf", "optim.lr=5e-4", f"trainer.strategy={strategy}"])
    checkpoints.load_trainer_state(trainer.backend, checkpoint / "trainer_state", trainer.state_objects,
                                   step=int(checkpoint.name[5:]))
    model = trainer.accelerator.unwrap_model(trainer.env.model)
    weights = {name: full(t.detach()).clone() for name, t in model.state_dict().items()}
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    moments = {i: {k: full(v).clone() for k, v in trainer.optimizer.state[p].items()} for i, p in enumerate(params)}
    if state.is_main_process:
        torch.save({"weights": weights, "moments": moments, "world": state.num_processes}, out_path)
    trainer.env.close()
    state.wait_for_everyone()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=Path)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--load", type=Path, help="a checkpoint (step_N) to load instead")
    parser.add_argument("--strategy", default="fsdp2")
    args = parser.parse_args()
    if args.load:
        load(args.load, args.strategy, args.work, args.out)
    else:
        run(args.batch, args.work, args.out)
