"""The one training loop, for every environment, on Accelerate.

Each step is a short sequence of named stages, each timed as ``time/<stage>``:

    rollout -> score -> advantages -> old_logprobs (+ reference) -> update -> sync -> log
    (+ evaluate and checkpoint every N steps)

PPO with a critic (``algo.adv_estimator: gae``) and the KL in the reward run verl's order, where the
rewards on tokens read the old and reference log-probs and the advantages read the critic's values:

    rollout -> score -> old_logprobs (+ reference) -> values -> advantages (token rewards with the KL
    penalty, GAE) -> update_critic -> update (after ``trainer.critic_warmup`` steps) -> sync -> log

The algorithm lives in ``unirl/core`` (advantages, clipped loss, KL, aggregation); the environment
(``unirl/env.py``) supplies samples, rewards and log-probs, or its own per-position loss
(``Environment.own_loss``: DiffusionNFT's, ``unirl/core/nft.py``) that the update aggregates instead of
the clipped ratio. Shapes: N = B*G samples, T tokens or
trained denoising steps.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch

from unirl.rewards.registry import RewardError
from unirl import checkpoints
from unirl.batching import num_mini_batches, plan_micro_batches, scatter_rows, split_to_count
from unirl.core import (ADVANTAGE_ESTIMATORS, aggregate, aggregate_denominator, clipped_policy_loss,
                        estimate_advantages, group_stats, kl_penalized_rewards, policy_loss_metrics, rollout_is_weights,
                        token_scores)
from unirl.critic import Critic
from unirl.distributed import cpu_processes, gather_rows, sum_over_processes
from unirl.dynamic_sampling import FilteredBatch, sample_filtered
from unirl.env import Environment, Rollout
from unirl.kl_control import build_kl_controller
from unirl.metrics import MetricLog, reduce_over_processes
from unirl.optim import build_optimizer, build_scheduler
from unirl.perf import PerfMeter
from unirl.preemption import Preempted, StopSignals
from unirl.run_log import Progress, RunLog
from unirl.schema import AlgoConfig, OptimConfig, TrainerConfig

__all__ = ["Preempted", "Trainer"]


class Trainer:
    def __init__(self, env: Environment, *, algo: AlgoConfig, optim: OptimConfig, trainer: TrainerConfig,
                 run_dir: str | Path, config_dict: dict[str, Any] | None = None, critic: Any = None):
        self.env, self.algo, self.optim_cfg, self.cfg = env, algo, optim, trainer
        self.critic_cfg = critic  # the environment's critic block (text: ``critic``), read when a critic is built
        self.critic: Critic | None = None  # built at setup when the advantage estimator reads values
        k = algo.kl_ctrl  # the coefficient of the KL in the reward, when it is there
        self.kl_ctrl = build_kl_controller(k.type, kl_coef=k.kl_coef, target_kl=k.target_kl,
                                           horizon=k.horizon) if algo.use_kl_in_reward else None
        self.run_dir = Path(run_dir)
        self.config_dict = config_dict or {}
        self.step = 0
        self.optimizer_steps = 0  # across all training steps; drives Environment.after_optimizer_step
        self.prompt_batches = 0  # prompt batches drawn by dynamic sampling (without it, batch k is step k's)
        self.signals = StopSignals()  # SIGTERM/SIGINT: stop after the current step

    # ================================================================ setup
    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        self.accelerator = Accelerator(mixed_precision=cfg.mixed_precision, log_with=cfg.log_with or None,
                                       project_dir=str(self.run_dir), cpu=cpu_processes())
        set_seed(cfg.seed)
        self._guard_run_dir()
        self.env.setup(self.accelerator)
        model = self.env.model
        optimizer = build_optimizer(model, self.optim_cfg, what="environment's model")
        scheduler = build_scheduler(optimizer, self.optim_cfg,
                                    total_steps=cfg.total_steps * cfg.ppo_epochs * self._num_mini_batches())
        # The scheduler is not prepared: Accelerate's wrapper steps it once per process at every call
        # (it assumes a dataloader split over processes), so 2 processes would warm up twice as fast.
        model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.scheduler = scheduler
        self.env.model = model
        checkpoints.check_supported(self.accelerator)
        self.critic = self._build_critic()  # prepared after the policy: its state follows the policy's in checkpoints
        for obj in self.env.checkpoint_objects():
            self.accelerator.register_for_checkpointing(obj)
        self.accelerator.register_for_checkpointing(scheduler)  # after the environment's: their files keep their numbers
        if self.critic is not None:
            self.accelerator.register_for_checkpointing(self.critic.scheduler)
        self.run_log = RunLog(self.accelerator, self.run_dir, cfg)
        if cfg.resume:  # before config.yaml is rewritten: a refused resume leaves the run's record as it was
            self._resume()
        self.run_log.start(self.config_dict)
        self.perf = PerfMeter.start(self.accelerator, self.env.model, self.run_dir, cfg.ppo_epochs)  # run_info.json
        self.env.sync_weights()

    def _build_critic(self) -> Critic | None:
        """A critic when the advantage estimator reads values (``reads_values``: ``gae``), else None."""
        if not getattr(ADVANTAGE_ESTIMATORS.get(self.algo.adv_estimator), "reads_values", False):
            return None
        if self.critic_cfg is None:
            raise ValueError(f"algo.adv_estimator={self.algo.adv_estimator} trains a critic, and "
                             f"{type(self.env).__name__} has no critic config")
        return Critic(self.critic_cfg, env=self.env, accelerator=self.accelerator, micro_batches=self._micro_batches,
                      num_mini_batches=self._num_mini_batches(), ppo_epochs=self.cfg.ppo_epochs, seed=self.cfg.seed,
                      total_steps=self.cfg.total_steps)

    def _guard_run_dir(self) -> None:
        if (self.run_dir / "metrics.jsonl").exists() and not self.cfg.resume:
            raise FileExistsError(
                f"run directory {str(self.run_dir)!r} already holds a run (metrics.jsonl); pass trainer.resume=true "
                f"to continue it or choose another --output-dir"
            )

    # ================================================================ train
    def train(self) -> list[dict[str, float]]:
        """Run ``trainer.total_steps`` steps; returns the per-step metrics.

        SIGTERM (what SLURM and spot instances send) or SIGINT lets the current step finish, saves a
        checkpoint, closes the engines and raises ``Preempted`` (exit status 143 / 130 from the CLI).
        A second signal interrupts at once."""
        self.signals.install(starting=True)  # a signal during start-up (a slow vLLM start) stops it with one line
        try:
            self.setup()
        except BaseException:
            self.signals.restore()
            self.env.close()  # what started (an engine, reward threads) is released on the way out
            raise
        self.signals.starting = False
        history = []
        progress = Progress(self.cfg, self.step, self.accelerator.is_main_process)
        try:
            if self.cfg.eval_every and self.step == 0:
                self._evaluate_and_log()
            while self.step < self.cfg.total_steps:
                try:
                    metrics = self.train_step()
                except RewardError as e:  # say what a crash leaves behind, with the reward's message
                    raise RewardError(f"{e}; {checkpoints.last_checkpoint_hint(self.run_dir)}") from e
                history.append(metrics)
                self.run_log.log(metrics)
                progress.update(metrics)
                last = self.step == self.cfg.total_steps
                # The finished run is saved before its last evaluation, so a failing evaluation loses no
                # step; a periodic checkpoint comes after its evaluation (the state a resumed run goes on from).
                saved = self.save_checkpoint() if last else None
                if self.cfg.eval_every and (self.step % self.cfg.eval_every == 0 or last):
                    self._evaluate_and_log()
                if self.cfg.save_every and self.step % self.cfg.save_every == 0 and not last:
                    saved = self.save_checkpoint()
                if not last and self.signals.requested(self.accelerator):
                    raise self.signals.preempted(self.step, saved or self.save_checkpoint(), self.run_dir)
        finally:
            self.signals.restore()
            progress.close()
            self.run_log.finish()
            self.env.close()
        return history

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        times: dict[str, float] = {}
        filtered = None
        with _timer(times, "rollout"):
            if self.algo.filter_groups.enabled:  # DAPO: generate and score until enough groups vary
                filtered = self.dynamic_sampling()
                rollout = filtered.rollout
            else:
                rollout = self.env.rollout(self.env.next_prompts(self.step), self.cfg.group_size)
        with _timer(times, "score"):
            rewards, reward_metrics = (filtered.rewards, filtered.reward_metrics) if filtered else self.env.score(rollout)
        rollout, learn_metrics = self.learn(rollout, rewards, times)
        self.step += 1
        metrics = {"step": self.step, **self._global_reward_metrics(rewards, reward_metrics, rollout), **learn_metrics,
                   **(filtered.metrics if filtered else {})}
        metrics.update({f"time/{k}": v for k, v in times.items()})
        metrics["time/step"] = time.perf_counter() - start  # the stages and the gathering of figures between them
        metrics.update(self.perf.step_metrics(rollout, metrics["time/step"]))  # perf/*: memory, throughput, MFU
        return metrics

    def learn(self, rollout: Rollout, rewards: torch.Tensor, times: dict[str, float] | None = None
              ) -> tuple[Rollout, dict[str, float]]:
        """The stages after scoring: advantages, old/reference log-probs, the updates and the weight sync
        (and, for PPO, the critic's values and update; see the module docstring for the two orders).
        Returns the rollout that trained (``algo.drop_zero_adv`` may drop samples) and the figures."""
        times = {} if times is None else times
        metrics: dict[str, float] = {}
        # The KL in the reward reads the old and reference log-probs: they come first (verl's order).
        logprobs_first = self.kl_ctrl is not None
        if logprobs_first:
            with _timer(times, "old_logprobs"):
                metrics.update(self.old_and_reference(rollout))
        if self.critic is not None:
            with _timer(times, "values"):
                self.critic.compute_values(rollout)
        with _timer(times, "advantages"):
            metrics.update(self.advantages(rollout, rewards))
            if self.algo.drop_zero_adv:
                rollout, drop_metrics = self.drop_zero_advantage(rollout)
                metrics.update(drop_metrics)
        if not logprobs_first:
            with _timer(times, "old_logprobs"):
                metrics.update(self.old_and_reference(rollout))
        if self.critic is not None:
            with _timer(times, "update_critic"):
                metrics.update(self.critic.update(rollout, self.step))
        if self.step >= self.cfg.critic_warmup:  # verl's critic warm-up: the actor waits for a trained critic
            with _timer(times, "update"):
                metrics.update(self.update(rollout))
            with _timer(times, "sync"):
                self.env.sync_weights()
        return rollout, metrics

    # ============================================================== stages
    def dynamic_sampling(self) -> FilteredBatch:
        """Rollout and score for DAPO's dynamic sampling (``unirl.dynamic_sampling``): batches of prompts
        drawn in order (``prompt_batches`` counts them, checkpointed) until the step's groups are kept."""

        def next_rows() -> list[dict]:
            self.prompt_batches += 1
            return self.env.next_prompts(self.prompt_batches - 1)

        return sample_filtered(self.env, self.accelerator, self.algo.filter_groups, prompts_per_step=self.cfg.prompts_per_step,
                               group_size=self.cfg.group_size, next_rows=next_rows)

    def advantages(self, rollout: Rollout, rewards: torch.Tensor) -> dict[str, float]:
        """Advantages from unirl.rewards [N]: [N] (the same for every token / step of a sample) or [N, T]
        for estimators that work per token (``reinforce++-baseline`` whitens over tokens).

        With several processes the rewards, group ids and masks of all of them are gathered and the
        advantages (and their statistics: FlowGRPO's batch std, REINFORCE++'s whitening) computed over
        the global batch; each process keeps its own rows.

        The estimators see the rewards on tokens (``token_rewards``: each score on its sample's last
        trained token, minus the KL penalty when it is in the reward) and, as ``rewards``, their row
        sums (the scores themselves without the KL penalty); ``gae`` also the critic's values, and its
        returns (the critic's target) are stored as ``rollout.tensors["returns"]``."""
        algo = self.algo
        mask = self.env.loss_mask(rollout).bool()  # [N, T]
        # Group ids made unique across processes: local ids renumbered 0..k-1, then offset by rank (one
        # process: its ids as they are, the estimators take any integers).
        rank, n = self.accelerator.process_index, len(rollout)
        token_rewards, kl_metrics = self.token_rewards(rollout, rewards, mask)  # [N, T]
        all_token_rewards = gather_rows(self.accelerator, token_rewards)  # [N_all, T_max]
        all_rewards = all_token_rewards.sum(-1)  # [N_all]: the scores exactly, without a KL penalty
        values = rollout.tensors.get("values")  # [N, T]: the critic's, for estimators that read them
        all_values = None if values is None else gather_rows(self.accelerator, values)
        if self.accelerator.num_processes > 1:
            local_ids = torch.unique(rollout.group_ids, return_inverse=True)[1]  # [N]
            all_ids = gather_rows(self.accelerator, local_ids + rank * n)  # [N_all]
        else:
            all_ids = rollout.group_ids  # [N]
        all_mask = gather_rows(self.accelerator, mask)  # [N_all, T_max]
        adv, returns = estimate_advantages(algo.adv_estimator, all_rewards, all_ids, mask=all_mask, scale=algo.adv_scale,
                                           eps=algo.adv_eps, unbiased=algo.adv_std == "unbiased",
                                           token_rewards=all_token_rewards, values=all_values, gamma=algo.gamma,
                                           lam=algo.lam)
        if algo.adv_clip is not None:
            adv = adv.clamp(-algo.adv_clip, algo.adv_clip)
        stats = group_stats(all_rewards, all_ids)
        per_token = adv if adv.ndim == 2 else adv.unsqueeze(-1).expand(all_mask.shape)  # [N_all, T_max]
        local = adv[rank * n:(rank + 1) * n]  # every process has N samples here (before any drop)
        rollout.tensors["advantages"] = local[:, : mask.shape[1]] if local.ndim == 2 else local
        rollout.tensors["rewards"] = rewards
        if returns is not None:
            rollout.tensors["returns"] = returns[rank * n:(rank + 1) * n, : mask.shape[1]]
        # Every figure in one host transfer: the masked means as sums over the mask, no boolean indexing.
        masked = torch.where(all_mask, per_token, 0.0)  # [N_all, T_max]
        count = all_mask.sum().clamp_min(1)
        names = ["adv/mean", "adv/abs_mean", *(f"adv/{k}" for k in stats)]
        figures = torch.stack([masked.sum() / count, masked.abs().sum() / count, *(v.float() for v in stats.values())])
        return {**dict(zip(names, figures.tolist())), **kl_metrics}

    def token_rewards(self, rollout: Rollout, rewards: torch.Tensor, mask: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[str, float]]:
        """Rewards on tokens [N, T]: each score on its sample's last trained token (verl's
        ``token_level_scores``), and with ``algo.use_kl_in_reward`` minus ``beta * KL`` on every trained
        token (verl's ``apply_kl_penalty``: KL between the old policy and the reference, by
        ``env.kl``). Beta comes from the controller, which then updates on the global batch's mean
        per-sequence KL; logged ``actor/reward_kl_penalty`` (that KL) and
        ``actor/reward_kl_penalty_coeff`` (the beta used)."""
        scores = token_scores(rewards.float(), mask)  # [N, T]
        if self.kl_ctrl is None:
            return scores, {}
        old, ref = ({k[len(p):]: v for k, v in rollout.tensors.items() if k.startswith(p)} for p in ("old/", "ref/"))
        kl = self.env.kl(old, ref).float()  # [N, T]
        beta = self.kl_ctrl.value
        penalised, sequence_kl = kl_penalized_rewards(scores, kl[:, : mask.shape[1]], mask, beta)  # [N, T], [N]
        everyone = gather_rows(self.accelerator, sequence_kl)  # [N_all]
        current_kl = everyone.mean().item()
        self.kl_ctrl.update(current_kl, n=len(everyone))
        return penalised, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}

    def drop_zero_advantage(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """FlowGRPO's filter: keep the samples with a non-zero advantage at some token/step, topped up
        with dropped ones (at random) until the kept count divides into the step's micro-batches per
        process (FlowGRPO: its per-process sampling batches), so the number of optimizer steps does
        not change and every micro-batch is equally full."""
        adv = rollout.tensors["advantages"]
        nonzero = adv.ne(0) if adv.ndim == 1 else adv.ne(0).any(dim=-1)  # [N]
        multiple = self._zero_adv_multiple()
        count = int(nonzero.sum())
        target = count + (-count % multiple)
        if target == 0 and sum_over_processes(self.accelerator, count) > 0:
            target = multiple  # other processes train: this one must take part in every optimizer step
        if target > count:
            dropped = (~nonzero).nonzero().squeeze(-1)
            generator = torch.Generator().manual_seed(self.cfg.seed * 6_151 + self.step)
            nonzero[dropped[torch.randperm(len(dropped), generator=generator)[: target - count]]] = True
        kept = nonzero.nonzero().squeeze(-1)
        total, kept_total = sum_over_processes(self.accelerator, len(rollout)), sum_over_processes(self.accelerator, len(kept))
        metrics = {"adv/dropped_frac": 1.0 - kept_total / total, "adv/kept": float(kept_total)}
        return rollout.select(kept), metrics

    def _zero_adv_multiple(self) -> int:
        """What the zero-advantage filter's kept count is a multiple of: the micro-batches of a step
        (B*G / micro_batch_size), or the mini-batches when micro-batches are packed by tokens."""
        if self.cfg.micro_batch_tokens is not None:
            return self._num_mini_batches()
        return self.cfg.prompts_per_step * self.cfg.group_size // self.cfg.micro_batch_size

    def _num_mini_batches(self) -> int:
        return num_mini_batches(self.cfg.prompts_per_step, self.cfg.group_size, self.cfg.mini_batch_size)

    def _on_policy(self) -> bool:
        """Whether every forward of the update sees the weights that the old log-probs belong to: one
        mini-batch and one epoch, so the only optimizer step comes after all of them. (Not when the KL
        is in the reward: the rewards need the old log-probs before the update.)"""
        return self.cfg.ppo_epochs == 1 and self._num_mini_batches() == 1 and self.kl_ctrl is None

    @torch.no_grad()
    def old_and_reference(self, rollout: Rollout) -> dict[str, float]:
        """PPO's old log-probs (recomputed by the trainer unless the sampler's are the policy's) and the
        reference outputs for the KL, stored in ``rollout.tensors`` as ``old_logp`` and ``ref/<key>``.

        On-policy (one mini-batch, one epoch) the trainer does not recompute them here: the update's
        own forward runs on the same weights, so its detached log-probs are the old ones (TRL skips
        this pass the same way); ``update`` then stores them and logs ``rollout/*`` from them."""
        model = self.env.model
        metrics = {}
        if len(rollout) == 0:  # every sample dropped (algo.drop_zero_adv)
            return metrics
        old = None
        if self.env.recompute_old_logprobs:
            if self._on_policy():
                rollout.tensors.pop("old_logp", None)  # a stale copy would be used instead of the first forward's
            else:
                old = self._evaluate_all(model, rollout)
                rollout.tensors["old_logp"] = old["logp"]
                metrics.update(self._rollout_metrics(rollout))
        if self.kl_ctrl is not None:
            # The KL in the reward compares the old policy's outputs with the reference's (diffusion: the
            # means of its steps, which the sampler did not keep, so the policy evaluates them here).
            old = self._evaluate_all(model, rollout) if old is None else old
            rollout.tensors.update({f"old/{k}": v for k, v in old.items()})
        if self.algo.kl_coef > 0 or self.kl_ctrl is not None:
            with self.env.reference_model() as ref:
                ref_out = self._evaluate_all(ref, rollout)
            for k, v in ref_out.items():
                if k != "mask":
                    rollout.tensors[f"ref/{k}"] = v
        return metrics

    def _rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        """The environment's rollout figures (engine-vs-trainer log-prob gap ...) from ``old_logp``,
        over the global batch."""
        if self.accelerator.num_processes > 1:
            rollout = Rollout(tensors={k: gather_rows(self.accelerator, v) for k, v in rollout.tensors.items()},
                              group_ids=gather_rows(self.accelerator, rollout.group_ids), prompts=[], samples=[])
        return self.env.rollout_metrics(rollout, {"logp": rollout.tensors["old_logp"]})

    def _evaluate_all(self, model, rollout: Rollout) -> dict[str, torch.Tensor]:
        """``env.evaluate`` over the whole rollout, micro-batch by micro-batch (each trimmed to its own
        longest sample), returned in rollout order on CPU, right-padded with zeros to the full width."""
        parts = []
        for idx in self._micro_batches(rollout):
            out = self.env.evaluate(model, self.env.trim_padding(rollout.select(idx)))
            parts.append((idx, {k: v.detach().cpu() for k, v in out.items() if v is not None}))  # no mask: all trained
        width = self.env.loss_mask(rollout).shape[1]  # [N, T]: the rollout's T, whatever the parts' widths
        return {k: scatter_rows([(idx, out[k]) for idx, out in parts], len(rollout), width) for k in parts[0][1]}

    def _micro_batches(self, batch: Rollout) -> list[torch.Tensor]:
        """The micro-batches of ``batch`` as index tensors (``unirl.batching.plan_micro_batches``):
        ``micro_batch_size`` samples each, or packed by ``trainer.micro_batch_tokens`` over
        ``env.sample_tokens`` and then padded only to their own longest (``env.trim_padding``). With
        several processes every one runs as many micro-batches as the busiest, as FSDP's collective
        forwards need."""
        budget = self.cfg.micro_batch_tokens
        lengths = None if budget is None else self.env.sample_tokens(batch)  # [n]
        chunks = plan_micro_batches(len(batch), micro_batch_size=self.cfg.micro_batch_size, lengths=lengths,
                                    token_budget=budget)
        if budget is not None and self.accelerator.num_processes > 1:
            count = torch.tensor([len(chunks)], device=self.accelerator.device)
            chunks = split_to_count(chunks, int(self.accelerator.reduce(count, reduction="max")))
        return [torch.tensor(c, dtype=torch.long) for c in chunks]

    def update(self, rollout: Rollout) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch AdamW steps, micro-batches accumulating gradients.

        Each micro-batch's loss is its share of the *global* mini-batch loss (the normaliser is summed
        over processes), so micro-batch and process shares add up to the loss of the whole global
        mini-batch; DDP averages gradients over processes, so the backward pass scales by their
        number. Logged ``loss/*`` (and ``actor/entropy``) are global mini-batch values (mean over
        mini-batches), other ``actor/*`` means over micro-batches and processes (``*_max`` /
        ``*_min``: the extremes).

        Without ``old_logp`` in the rollout (on-policy, see ``old_and_reference``) each micro-batch's
        first forward gives its old log-probs (detached: ratio 1, the gradient of the ratio is that
        of the log-prob); they are stored in ``rollout.tensors["old_logp"]`` afterwards and the
        ``rollout/*`` figures (and TIS weights) come from them."""
        model = self.env.model
        log = MetricLog()
        if len(rollout) == 0:  # every sample dropped (algo.drop_zero_adv): nothing to learn from
            return {}
        # The first forward's log-probs are the old ones on-policy (an environment with its own loss has none).
        first_forward = not self.env.own_loss and "old_logp" not in rollout.tensors
        if first_forward and not self._on_policy():
            raise RuntimeError("update: the rollout has no old_logp; call old_and_reference first (the update's first "
                               "forward gives them only on-policy: one mini-batch, trainer.ppo_epochs=1)")
        recorded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rollout rows, their first-forward log-probs)
        # As many mini-batches as B*G / mini_batch_size (fewer samples when zero advantages were dropped).
        num_mini = self._num_mini_batches()
        mini_size = -(-len(rollout) // num_mini)
        # The shuffle's generator, seeded by the step (only several mini-batches are shuffled).
        generator = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.step) if num_mini > 1 else None
        # train() walks every submodule (0.5 ms a step for the tiny SD3 with LoRA), so it runs only when the model
        # is not in training mode: an environment that samples in eval mode switches back (the HF engine does).
        if not model.training:
            model.train()
        for _ in range(self.cfg.ppo_epochs):
            # A single mini-batch is the whole rollout in any order (its loss is a sum over samples):
            # it is taken as it is, without a shuffled copy of every stored tensor.
            order = torch.randperm(len(rollout), generator=generator) if num_mini > 1 else torch.arange(len(rollout))
            for mini_idx in order.split(mini_size):
                mini_batch = rollout.select(mini_idx)
                # The global mini-batch's normaliser, so micro and process shares add up to its loss.
                denominator = self._mini_denominator(mini_batch)
                micro_chunks = self._micro_batches(mini_batch)
                mini = MetricLog()
                for k, micro_idx in enumerate(micro_chunks):
                    micro = self.env.trim_padding(mini_batch.select(micro_idx))
                    first_logp = [] if first_forward else None
                    mini.add(self._micro_backward(model, micro, denominator, sync=k == len(micro_chunks) - 1,
                                                  first_logp=first_logp))
                    if first_forward:
                        recorded.append((mini_idx[micro_idx], first_logp[0]))
                log.add(mini.result(sum_shares=True))
                log.add({"actor/grad_norm": self._optimizer_step()})
        out = reduce_over_processes(self.accelerator, log.result(sum_shares=False))
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        if first_forward:
            rollout.tensors["old_logp"] = scatter_rows(recorded, len(rollout), self.env.loss_mask(rollout).shape[1])
            out.update(self._rollout_metrics(rollout))
        return out

    def _micro_backward(self, model, micro: Rollout, denominator: torch.Tensor, sync: bool,
                        first_logp: list | None = None) -> dict[str, float]:
        """Forward and backward of one micro-batch, piece by piece over the environment's column
        slices (diffusion: one trained step at a time, as FlowGRPO runs backward per step), so only
        one piece's graph is alive at a time; the pieces' losses add up to the micro-batch's. DDP
        synchronises gradients in the last backward of the mini-batch (``sync``).

        The ratio figures (``actor/clip_frac`` ...) are computed once over the whole micro-batch from
        the pieces' detached log-probs, and every figure reaches the host in one transfer at the end
        (not one per figure and piece: each is a device sync on an accelerator).

        ``first_logp``: when the micro-batch has no ``old_logp``, the detached log-probs [n, T] of
        this forward (used as the old ones) are appended to it."""
        acc, algo = self.accelerator, self.algo
        pieces = [slice(None)] if algo.level == "sequence" else self.env.column_slices(micro)
        seq_lengths = None
        if len(pieces) > 1 and algo.loss_agg == "seq-mean-token-mean":  # it divides by each whole sequence's length
            seq_lengths = self.env.loss_mask(micro).to(acc.device).sum(dim=-1)
        hold_back = acc.num_processes > 1 or acc.is_fsdp2  # gradient sync deferred to the last piece
        shares: dict[str, list[torch.Tensor]] = {}  # loss/* and actor/entropy of each piece (they add up)
        parts: dict[str, list[torch.Tensor]] = {}  # logp, old_logp, advantages, mask of each piece, [n, T']
        for k, columns in enumerate(pieces):
            last = sync and k == len(pieces) - 1
            # One process (without FSDP2's sharded gradients) holds nothing back, and accelerate's
            # no_sync costs ~0.1 ms a piece.
            with acc.no_sync(model) if not last and hold_back else contextlib.nullcontext():
                loss, piece_shares, piece_parts = self._micro_loss(model, micro, denominator, columns, seq_lengths)
                # DDP's gradient average divides by the number of processes again.
                acc.backward(loss * acc.num_processes if acc.num_processes > 1 else loss)
                # The piece's autograd graph goes now, while backward has just walked it (its nodes are
                # in cache), not when the next piece's loss replaces it after a whole forward: 1 ms a
                # tiny SD3 step, measured paired (benchmarks/diffusion_step_split.py --against).
                del loss
            for name, value in piece_shares.items():
                shares.setdefault(name, []).append(value)
            for name, value in piece_parts.items():
                parts.setdefault(name, []).append(value)
        # [n, T] each; the mask None (every position trained) when the pieces have none.
        whole = {name: values[0] if len(values) == 1 or values[0] is None else torch.cat(values, dim=1)
                 for name, values in parts.items()}
        if first_logp is not None:
            first_logp.append(whole["old_logp"].cpu())
        if self.env.own_loss:  # no log-probs: no ratio figures
            return _on_host(shares)
        ratio = policy_loss_metrics(whole["logp"], whole["old_logp"], whole["advantages"], whole["mask"],
                                    clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                                    level=algo.level)
        return _on_host({**shares, **{f"actor/{name}": [value] for name, value in ratio.items()}})

    def _mini_denominator(self, mini: Rollout) -> torch.Tensor:
        local = aggregate_denominator(self.env.loss_mask(mini).to(self.accelerator.device), self.algo.loss_agg,
                                      norm_length=self.env.loss_norm_length)
        if self.accelerator.num_processes == 1:
            return local
        return self.accelerator.reduce(local.reshape(1), reduction="sum").reshape(()).clamp_min(1)

    def _micro_loss(self, model, micro: Rollout, denominator: torch.Tensor, columns: slice = slice(None),
                    seq_lengths: torch.Tensor | None = None):
        """The loss share of one micro-batch (or of the columns ``columns`` of it), its shares of the
        logged losses (detached), and the detached inputs of its ratio figures, each [n, T']: ``logp``,
        ``old_logp``, ``advantages`` and ``mask``.

        Without ``old_logp`` in ``micro`` (on-policy) this forward's detached log-probs are the old ones.
        An environment with its own loss (``env.own_loss``, DiffusionNFT) gives ``loss`` and its ``figures``
        per position instead of log-probs; they are aggregated the same way, and there is no ratio."""
        algo, device = self.algo, self.accelerator.device
        cur = self.env.evaluate(model, micro, columns)
        mask = cur["mask"]  # [n, T'], or None: every position trained
        agg = dict(denominator=denominator, seq_lengths=seq_lengths)
        if self.env.own_loss:  # the environment's loss per position (DiffusionNFT), aggregated as the clipped one
            loss = aggregate(cur["loss"], mask, algo.loss_agg, **agg)
            shares = {name: aggregate(v, mask, algo.loss_agg, **agg) for name, v in cur["figures"].items()}
            return loss, {**shares, "loss/total": loss.detach()}, {}
        logp = cur["logp"].detach()  # [n, T']
        old_logp = micro.tensors["old_logp"][:, columns].to(device) if "old_logp" in micro.tensors else logp
        advantages = micro.tensors["advantages"]  # [n] or [n, T]
        if advantages.ndim == 2:
            advantages = advantages[:, columns].to(device)  # [n, T']
        else:  # one per sample: the [n, 1] column made once per micro-batch, not once a piece
            column = micro.cache.get("advantages_column")
            if column is None:
                column = micro.cache["advantages_column"] = advantages.to(device).unsqueeze(-1)  # [n, 1]
            advantages = column if column.shape == logp.shape else column.expand_as(logp)  # [n, T']
        weights = None
        if algo.tis_cap is not None and "engine_logp" in micro.tensors:
            engine_logp = micro.tensors["engine_logp"][:, columns].to(device)
            weights = rollout_is_weights(old_logp, engine_logp, mask, mode=algo.rollout_is, high=algo.tis_cap,
                                         low=algo.rollout_is_min)
        policy_loss, _ = clipped_policy_loss(
            cur["logp"], old_logp, advantages, mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
            dual_clip=algo.dual_clip, level=algo.level, agg=algo.loss_agg, weights=weights, with_metrics=False, **agg,
        )
        loss = policy_loss
        shares = {"loss/policy": policy_loss.detach()}
        if algo.kl_coef > 0:
            ref = {k[len("ref/"):]: v[:, columns].to(device) for k, v in micro.tensors.items() if k.startswith("ref/")}
            kl = aggregate(self.env.kl(cur, ref), mask, algo.loss_agg, **agg)
            loss = loss + algo.kl_coef * kl
            shares["loss/kl"] = kl.detach()
        if "entropy" in cur:  # logged whatever entropy_coef (text: from the chunked head, no gradient unless trained)
            entropy = aggregate(cur["entropy"], mask, algo.loss_agg, **agg)
            if algo.entropy_coef > 0:
                loss = loss - algo.entropy_coef * entropy
            shares["actor/entropy"] = entropy.detach()
        shares["loss/total"] = shares["loss/policy"] if loss is policy_loss else loss.detach()
        inputs = {"logp": logp, "old_logp": old_logp, "advantages": advantages, "mask": mask}
        return loss, shares, inputs

    def _optimizer_step(self) -> float:
        acc = self.accelerator
        grad_norm = float("nan")
        if self.optim_cfg.max_grad_norm is not None:
            grad_norm = float(acc.clip_grad_norm_(self.env.model.parameters(), self.optim_cfg.max_grad_norm))
        if math.isfinite(grad_norm) or self.optim_cfg.max_grad_norm is None:
            self.optimizer.step()
        else:
            acc.print(f"step {self.step}: non-finite grad norm {grad_norm}; optimizer step skipped")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.env.after_optimizer_step(self.optimizer_steps)
        return grad_norm

    def _evaluate_and_log(self) -> None:
        """``evaluate`` and its row in the logs; a failure says where the last checkpoint is."""
        try:
            self.run_log.log({"step": self.step, **self.evaluate()})
        except RewardError as e:
            raise RewardError(f"evaluation at step {self.step}: {e}; {checkpoints.last_checkpoint_hint(self.run_dir)}") from e
        except Exception as e:
            e.add_note(f"unirl: evaluation at step {self.step} failed; {checkpoints.last_checkpoint_hint(self.run_dir)}")
            raise

    def evaluate(self) -> dict[str, float]:
        start = time.perf_counter()
        out = self.env.evaluation(self.step, self.run_dir)
        if out:
            out["time/eval"] = time.perf_counter() - start
        self.run_log.log_media(self.env.evaluation_media(), self.step)
        return out

    # ======================================================= several processes
    def _global_reward_metrics(self, rewards: torch.Tensor, env_metrics: dict[str, float], rollout: Rollout) -> dict:
        """``reward/mean``, ``reward/std`` and the per-reward ``reward/<name>`` over the global batch.

        One process: the environment's figures. Several: the rewards are gathered, and each reward's
        per-sample scores when the environment left them in ``rollout.tensors["score/<name>"]`` (NaN
        where it does not apply); a figure it did not leave is averaged over processes."""
        everyone = gather_rows(self.accelerator, rewards.float())
        out = {"reward/mean": everyone.mean().item(), "reward/std": everyone.std().item()}
        if self.accelerator.num_processes == 1:
            return {**out, **env_metrics}
        for key, value in env_metrics.items():
            scores = rollout.tensors.get("score/" + key.removeprefix("reward/"))
            if scores is not None:
                out[key] = gather_rows(self.accelerator, scores.float()).nanmean().item()
            else:
                out[key] = sum_over_processes(self.accelerator, value) / self.accelerator.num_processes
        return out

    # ========================================================= checkpoints
    def save_checkpoint(self) -> Path:
        """``checkpoints/step_N/``: the policy and ``trainer_state/`` (``unirl.checkpoints``)."""
        state = {"step": self.step, "optimizer_steps": self.optimizer_steps, "prompt_batches": self.prompt_batches}
        if self.kl_ctrl is not None:  # plain JSON in loop.json: the coefficient resumes exactly
            state["kl_ctrl"] = self.kl_ctrl.state_dict()
        return checkpoints.save_checkpoint(self.accelerator, self.env, self.run_dir, self.step, state,
                                           keep=self.cfg.keep_checkpoints, config=self.config_dict)

    def _resume(self) -> None:
        state = checkpoints.resume(self.accelerator, self.run_dir, self.config_dict)
        if state is not None:
            self.step, self.optimizer_steps = state["step"], state["optimizer_steps"]
            self.prompt_batches = state.get("prompt_batches", 0)
            if self.kl_ctrl is not None and "kl_ctrl" in state:
                self.kl_ctrl.load_state_dict(state["kl_ctrl"])


# ================================================================ helpers
def _on_host(figures: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Each figure's 0-dim values summed (the pieces' shares of a loss add up), read in one transfer
    (one device sync) and summed in float64 on the host."""
    names = [name for name, values in figures.items() for _ in values]
    host = torch.stack([v if v.ndim == 0 and v.dtype == torch.float32 else v.float().reshape(())
                        for values in figures.values() for v in values]).tolist()
    out: dict[str, float] = {}
    for name, value in zip(names, host):
        out[name] = out.get(name, 0.0) + value
    return out


@contextlib.contextmanager
def _timer(times: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start
