"""One update on a fixed global batch, run by 1 process or under ``accelerate launch`` by several.

Used by ``tests/test_distributed.py``; not a test module itself. The global batch (a text rollout of
the tiny LM, a diffusion rollout of the toy SD3, with fixed random rewards) is made once by
``--prepare`` in a single process and saved. Each process then takes its contiguous share of the rows
(text responses trimmed to the share's own longest one, so widths differ between processes), and
for every loss aggregation mode, with and without KL, a fresh Trainer runs the loop's advantage,
old/reference and update stages (DiffusionNFT: its own rollout, advantage and update stages, with and
without its KL). The main process writes the logged update figures and the updated
trainable weights, which must not depend on the number of processes. PPO (text: GAE with a critic
and the adaptive KL in the reward) runs the loop's ``learn`` stages, and adds the critic's weights.

    python tests/dist_equivalence.py --prepare --batch B.pt --work DIR [--out ONE.pt]   # ONE: 1 process's figures
    accelerate launch --cpu --num_processes 2 tests/dist_equivalence.py --batch B.pt --work DIR --out OUT.pt
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
PROMPTS, GROUP, MICRO = 4, 4, 4  # global batch: 4 prompts x 4 samples, micro-batches of 4
# PPO: a critic, GAE whitened over the global batch, the KL in the reward with a coefficient that adapts.
PPO = ["algo.adv_estimator=gae", "algo.use_kl_in_reward=true", "algo.kl_estimator=k1", "algo.kl_ctrl.type=adaptive",
       "algo.kl_ctrl.kl_coef=0.05", "algo.kl_ctrl.target_kl=0.001", "algo.kl_ctrl.horizon=20", "critic.optim.lr=1e-3"]


def make_trainer(env_name: str, world: int, agg: str, kl: float, run_dir: Path, overrides: list[str] = ()):
    from unirl.cli import load_run_config
    from unirl.config.environments import ENVIRONMENTS
    from unirl.config.environments import import_object as _import
    from unirl.config import config_to_dict
    from unirl.trainer.loop import Trainer

    common = [f"trainer.prompts_per_step={PROMPTS // world}", f"trainer.group_size={GROUP}",
              f"trainer.mini_batch_size={PROMPTS * GROUP // world}", f"trainer.micro_batch_size={MICRO}",
              "trainer.eval_every=0", "trainer.progress=false", "trainer.reward_workers=0",
              f"algo.loss_agg={agg}", f"algo.kl_coef={kl}", "optim.max_grad_norm=1.0", "algo.adv_scale=batch"]
    extra = {"text": ["rollout.engine=hf", "rollout.max_new_tokens=12", "optim.lr=3e-4"],
             "diffusion": ["optim.lr=1e-2", "ema.enabled=false"]}[env_name.removesuffix("-nft")]
    if env_name == "diffusion-nft":  # DiffusionNFT: its KL is its loss's kl_coef, in its own loss
        extra += ["algorithm=nft", f"algo.loss_args.kl_coef={kl}", "sampling.timestep_fraction=0.5"]
        common = [c for c in common if not c.startswith("algo.kl_coef=")]
        env_name = "diffusion"
    cfg = load_run_config(env_name, "tiny", common + extra + list(overrides), output_dir=str(run_dir))
    env = _import(ENVIRONMENTS[env_name][1])(cfg)
    trainer = Trainer(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                      config_dict=config_to_dict(cfg), critic=getattr(cfg, "critic", None))
    trainer.setup()
    return trainer


def prepare(batch_path: Path, work: Path) -> None:
    batches = {}
    for env_name in ("text", "diffusion", "diffusion-nft"):
        trainer = make_trainer(env_name, 1, "token-mean", 0.0, work / f"prepare-{env_name}")
        rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), GROUP)
        rewards = torch.rand(len(rollout), generator=torch.Generator().manual_seed(7))
        rewards[:GROUP] = 0.5  # one group with equal rewards (zero advantage)
        batches[env_name] = {"rollout": rollout, "rewards": rewards}
        trainer.env.close()
    torch.save(batches, batch_path)


def local_share(rollout, rewards, rank: int, world: int):
    n = len(rollout) // world
    local = rollout.select(list(range(rank * n, (rank + 1) * n)))
    if "response_mask" in local.tensors:  # text: trim to this share's longest response
        width = max(1, int(local.tensors["response_mask"].sum(-1).max()))
        for key in ("response_ids", "response_mask"):
            local.tensors[key] = local.tensors[key][:, :width]
        if local.engine_logp is not None:  # a typed field of the Rollout since the trainer package
            local.engine_logp = local.engine_logp[:, :width]
    return local, rewards[rank * n:(rank + 1) * n]


def run(batch_path: Path, work: Path, out_path: Path) -> None:
    from accelerate import PartialState

    from unirl.trainer.distributed import cpu_processes

    state = PartialState(cpu=cpu_processes())  # as the Trainer's Accelerator will
    batches = torch.load(batch_path, weights_only=False)
    results = {}
    for env_name, agg, kl in itertools.product(("text", "diffusion"), AGGS, (0.0, 0.05)):
        trainer = make_trainer(env_name, state.num_processes, agg, kl, work / f"{env_name}-{agg}-{kl}")
        rollout, rewards = local_share(batches[env_name]["rollout"], batches[env_name]["rewards"],
                                       state.process_index, state.num_processes)
        # Two updates on the batch: the second starts away from the reference (KL and its gradient
        # non-zero) and, for diffusion, from the sampling policy (ratios off 1, clipping active).
        for _ in range(2):
            adv = trainer.advantages(rollout, rewards)
            trainer.old_and_reference(rollout)
            metrics = trainer.update(rollout)
        model = trainer.accelerator.unwrap_model(trainer.env.model)
        weights = torch.cat([p.detach().flatten().float().cpu() for p in model.parameters() if p.requires_grad])
        results[(env_name, agg, kl)] = {**adv, **metrics, "weights": weights, "world": state.num_processes}
        trainer.env.close()
    for agg in ("token-mean", "seq-mean-token-mean"):
        trainer = make_trainer("text", state.num_processes, agg, 0.0, work / f"ppo-{agg}", PPO)
        rollout, rewards = local_share(batches["text"]["rollout"], batches["text"]["rewards"],
                                       state.process_index, state.num_processes)
        for _ in range(2):  # the second: a critic and a beta that moved, a policy away from the reference
            _, metrics = trainer.learn(rollout, rewards)
        results[("text-ppo", agg, 0.0)] = {
            **metrics, "world": state.num_processes, "kl_coef": trainer.kl_ctrl.value,
            **{name: torch.cat([p.detach().flatten().float().cpu() for p in trainer.accelerator.unwrap_model(m).parameters()
                                if p.requires_grad]) for name, m in (("weights", trainer.env.model),
                                                                     ("critic_weights", trainer.critic.model))}}
        trainer.env.close()
    for kl in (0.0, 0.05):  # DiffusionNFT: two updates on its own rollout (the second away from the old policy)
        trainer = make_trainer("diffusion-nft", state.num_processes, "token-mean", kl, work / f"nft-{kl}")
        rollout, rewards = local_share(batches["diffusion-nft"]["rollout"], batches["diffusion-nft"]["rewards"],
                                       state.process_index, state.num_processes)
        for _ in range(2):
            adv = trainer.advantages(rollout, rewards)
            metrics = trainer.update(rollout)
        model = trainer.accelerator.unwrap_model(trainer.env.model)
        weights = torch.cat([p.detach().flatten().float().cpu() for p in model.parameters() if p.requires_grad])
        results[("diffusion-nft", "token-mean", kl)] = {**adv, **metrics, "weights": weights, "world": state.num_processes}
        trainer.env.close()
    if state.is_main_process:
        torch.save(results, out_path)
    state.wait_for_everyone()
    state.destroy_process_group()  # after the barrier: both processes leave gloo together


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--prepare", action="store_true")
    parser.add_argument("--batch", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.prepare:
        prepare(args.batch, args.work)
    if args.out is not None:  # after --prepare too: the one-process side without a second start-up
        run(args.batch, args.work, args.out)
