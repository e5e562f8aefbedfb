"""The one training loop, for every environment, on Accelerate: the stage order, and nothing else.

Each step is a short sequence of named stages, each timed as ``time/<stage>``, each in its own module
of ``unirl.trainer``:

    rollout -> score -> advantages -> old_logprobs (+ reference) -> update -> sync -> log
    (+ evaluate and checkpoint every N steps)

With ``rollout.max_staleness: k >= 1`` the rollout and score stages run ahead in a producer thread
(``unirl.trainer.async_rollout``): a step takes its batch, sampled with weights up to k steps old, and
publishes its weights for the batch k steps ahead instead of syncing the engine.

PPO with a critic (``algo.adv_estimator: gae``) and the KL in the reward run verl's order, where the
rewards on tokens read the old and reference log-probs and the advantages read the critic's values:

    rollout -> score -> old_logprobs (+ reference) -> values -> advantages (token rewards with the KL
    penalty, GAE) -> update_critic -> update (from step ``trainer.critic_warmup`` on) -> sync -> log

The algorithm lives in ``unirl/core`` (advantages, the registered policy losses, KL, aggregation); the
environment (``unirl/env.py``) supplies samples, rewards and the forward of stored actions
(``score_actions``). What flows between the stages is a ``Rollout`` (its typed fields: rewards,
advantages, old/reference log-probs ...). Shapes: N = B*G samples, T tokens or trained denoising steps.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

from unirl.core import ADVANTAGE_ESTIMATORS
from unirl.core.policy_losses import POLICY_LOSSES
from unirl.env import Environment, Rollout
from unirl.rewards.registry import RewardError
from unirl.config.schema import AlgoConfig, OptimConfig, TrainerConfig
from unirl.trainer import checkpoints, fsdp
from unirl.trainer import advantages as advantages_stage
from unirl.trainer.async_rollout import AsyncRollouts, build_async_rollouts
from unirl.trainer import logprobs as logprobs_stage
from unirl.trainer import update as update_stage
from unirl.trainer.update import loss_settings, run_policy_loss
from unirl.trainer import zero_advantage
from unirl.trainer import completions
from unirl.trainer.critic import Critic
from unirl.trainer.distributed import cpu_processes, gather_rows, sum_over_processes
from unirl.trainer.fsdp import prepare as fsdp_prepare, uses_fsdp2
from unirl.trainer.dynamic_sampling import FilteredBatch, SamplingStopped, sample_filtered
from unirl.trainer.kl_control import build_kl_controller
from unirl.trainer.nonfinite import NonFiniteWatch, skip_save_line
from unirl.trainer.micro_batches import num_mini_batches, plan_micro_batches, split_to_count
from unirl.trainer.optim import build_optimizer, build_scheduler
from unirl.trainer.perf import PerfMeter
from unirl.trainer.preemption import Preempted, StopSignals
from unirl.trainer.run_log import Progress, RunLog

__all__ = ["Preempted", "Trainer"]


class Trainer:
    def __init__(self, env: Environment, *, algo: AlgoConfig, optim: OptimConfig, trainer: TrainerConfig,
                 run_dir: str | Path, config_dict: dict[str, Any] | None = None, critic: Any = None,
                 policy_loss: str | None = None, distill: Any = None):
        """``policy_loss``: a registered policy loss (``unirl.core.policy_losses``) by name, instead of the
        configured one (``run_policy_loss``: ``algo.policy_loss``, else the environment's rollout mode's,
        else the ratio loss at ``algo.level``). ``distill``: the environment's ``distill`` block (text's
        ``DistillConfig``); with a teacher, on-policy distillation (``unirl.core.distill``)."""
        self.env, self.algo, self.optim_cfg, self.cfg = env, algo, optim, trainer
        self.critic_cfg = critic  # the environment's critic block (text: ``critic``), read when a critic is built
        self.critic: Critic | None = None  # built at setup when the advantage estimator reads values
        self.distill = distill if distill is not None and distill.teacher else None  # read by the two stages
        k = algo.kl_ctrl  # the coefficient of the KL in the reward, when it is there
        self.kl_ctrl = build_kl_controller(k.type, kl_coef=k.kl_coef, target_kl=k.target_kl,
                                           horizon=k.horizon) if algo.use_kl_in_reward else None
        if policy_loss is None and env is not None:
            policy_loss = run_policy_loss(env, algo)
        self.policy_loss = None if policy_loss is None else POLICY_LOSSES.get(policy_loss)
        self.loss_settings = loss_settings(env, algo)
        self.run_dir = Path(run_dir)
        self.config_dict = config_dict or {}
        self.step = 0
        self.optimizer_steps = 0  # across all training steps; drives Environment.after_optimizer_step
        self.prompt_batches = 0  # prompt batches drawn by dynamic sampling (without it, batch k is step k's)
        self.signals = StopSignals()  # SIGTERM/SIGINT: stop after the current step
        self.max_staleness = rollout_staleness(env)  # 0: the synchronous loop
        self.rollouts: AsyncRollouts | None = None  # the producer, with max_staleness >= 1
        self.bypass_mode = update_stage.resolve_bypass_mode(algo, env, self.max_staleness)  # the ratio's anchor
        self.nonfinite = NonFiniteWatch(trainer.max_nonfinite_steps)  # NaN losses or values: stop, keep the checkpoints
        self.samples_to_log: list[dict] = []  # a few samples of the last trained batch (unirl.trainer.completions)
        self.zero_adv = zero_advantage.ZeroAdvantageWatch()  # every advantage 0 for steps in a row: a warning line

    @classmethod
    def from_config(cls, env: Environment, cfg, **kwargs) -> "Trainer":
        """A trainer for ``env`` with a loaded run config's blocks (algo, optim, trainer, and the critic and
        distillation blocks where the environment's config has them), writing to ``cfg.output_dir``."""
        from unirl.config import config_to_dict

        return cls(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                   config_dict=config_to_dict(cfg), critic=getattr(cfg, "critic", None),
                   distill=getattr(cfg, "distill", None), **kwargs)

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
        if uses_fsdp2(cfg):  # the policy and the reference sharded before the optimizer sees their parameters
            fsdp.ensure_process_group(self.accelerator)
            fsdp.shard(self.env.model, self.accelerator, mixed_precision=cfg.mixed_precision, offload=cfg.fsdp.offload,
                       what="policy")
            for frozen in ("ref", "teacher"):  # the reference copy and distillation's teacher, no optimizer
                if getattr(self.env, frozen, None) is not None:
                    fsdp.shard(getattr(self.env, frozen), self.accelerator, mixed_precision=cfg.mixed_precision,
                               offload=cfg.fsdp.offload, what="reference" if frozen == "ref" else "teacher")
        model = self.env.model
        optimizer = build_optimizer(model, self.optim_cfg, what="environment's model")
        scheduler = build_scheduler(optimizer, self.optim_cfg,
                                    total_steps=cfg.total_steps * cfg.ppo_epochs * self.num_mini_batches())
        # The scheduler is not prepared: Accelerate's wrapper steps it once per process at every call
        # (it assumes a dataloader split over processes), so 2 processes would warm up twice as fast.
        model, self.optimizer = fsdp_prepare(self.accelerator, model, optimizer, cfg)
        self.scheduler = scheduler
        self.env.model = model
        checkpoints.check_supported(self.accelerator)
        self.critic = self._build_critic()  # prepared after the policy: its state follows the policy's in checkpoints
        for obj in self.env.checkpoint_objects():
            self.accelerator.register_for_checkpointing(obj)
        self.accelerator.register_for_checkpointing(scheduler)  # after the environment's: their files keep their numbers
        if self.critic is not None:
            self.accelerator.register_for_checkpointing(self.critic.scheduler)
        if self.max_staleness:  # last: the files of the objects before keep their numbers
            self.rollouts = build_async_rollouts(self, self.max_staleness)
            self.accelerator.register_for_checkpointing(self.rollouts)
        self.run_log = RunLog(self.accelerator, self.run_dir, cfg)
        if cfg.resume:  # before config.yaml is rewritten: a refused resume leaves the run's record as it was
            self._resume()
        self.run_log.start(self.config_dict)
        self.perf = PerfMeter.start(self.accelerator, self.env.model, self.run_dir, cfg.ppo_epochs)  # run_info.json
        self.env.sync_weights()
        if self.rollouts is not None:
            self.rollouts.start(self.step, self.env.policy_snapshot(), self.optimizer_steps)

    def _build_critic(self) -> Critic | None:
        """A critic when the advantage estimator reads values (``reads_values``: ``gae``), else None."""
        if not getattr(ADVANTAGE_ESTIMATORS.get(self.algo.adv_estimator), "reads_values", False):
            return None
        if self.critic_cfg is None:
            raise ValueError(f"algo.adv_estimator={self.algo.adv_estimator} trains a critic, and "
                             f"{type(self.env).__name__} has no critic config")
        return Critic(self.critic_cfg, env=self.env, accelerator=self.accelerator, micro_batches=self.micro_batches,
                      num_mini_batches=self.num_mini_batches(), ppo_epochs=self.cfg.ppo_epochs, seed=self.cfg.seed,
                      total_steps=self.cfg.total_steps, trainer_cfg=self.cfg)

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
                except SamplingStopped:  # a signal while DAPO drew batches: the step is given up, the state saved
                    raise self.signals.preempted(self.step, self.save_checkpoint(), self.run_dir) from None
                self.zero_adv.observe(metrics, self.step, self.accelerator.print)  # adds adv/zero_adv_steps
                history.append(metrics)
                self.run_log.log(metrics)
                completions.log_completions(self.run_log, self.samples_to_log, self.step)  # samples.jsonl, trackers
                progress.update(metrics)
                self.nonfinite.observe(metrics, self.step, self.run_dir)
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
            # Every process is done with collectives before any closes its engine: vLLM's shutdown destroys
            # the default process group (torchrun's, which it joined), so a process still evaluating would lose it.
            self.accelerator.wait_for_everyone()
        except ConnectionError as e:  # a rollout server gone (in a step, or its checkpoint's drain): where to resume
            raise type(e)(f"{e}; {checkpoints.last_checkpoint_hint(self.run_dir)}") from e
        finally:
            self.signals.restore()
            progress.close()
            self.run_log.finish()
            if self.rollouts is not None:
                self.rollouts.close(wait=sys.exc_info()[0] is None)  # before the engine it samples with
            self.env.close()
        return history

    def train_step(self) -> dict[str, float]:
        if self.rollouts is not None:
            return self.async_train_step()
        start = time.perf_counter()
        times: dict[str, float] = {}
        filtered = None
        with _timer(times, "rollout"):
            if self.algo.filter_groups.enabled:  # DAPO: generate and score until enough groups vary
                filtered = self.dynamic_sampling()
                rollout = filtered.rollout
            else:
                rollout = self.env.rollout(self.env.next_prompts(self.step), self.cfg.group_size)
        # The weights that sampled every sample of this step: those after the optimizer steps so far.
        rollout.policy_version = torch.full((len(rollout),), self.optimizer_steps, dtype=torch.long)  # [N]
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

    def async_train_step(self) -> dict[str, float]:
        """``train_step`` with the batch from the producer (sampled and scored ahead, with weights up to
        ``max_staleness`` steps old); the weights are published for the batches still to sample."""
        start = time.perf_counter()
        times: dict[str, float] = {}
        if self.rollouts.needs_weights(self.step):  # the weights after self.step steps, before they change
            with _timer(times, "publish"):
                self.rollouts.publish(self.step, self.env.policy_snapshot(), self.optimizer_steps)
        with _timer(times, "rollout"):
            produced, waited = self.rollouts.get(self.step)
        rollout, trained_from = produced.rollout, self.optimizer_steps  # staleness: against the weights this step starts from
        rollout, learn_metrics = self.learn(rollout, produced.rewards, times)
        self.step += 1
        metrics = {"step": self.step, **self._global_reward_metrics(produced.rewards, produced.reward_metrics, rollout),
                   **learn_metrics, **(produced.filter_metrics or {}),
                   **self.rollouts.step_metrics(produced, trained_from, waited)}
        metrics.update({f"time/{k}": v for k, v in times.items()})
        metrics["time/step"] = time.perf_counter() - start
        metrics.update(self.perf.step_metrics(rollout, metrics["time/step"]))
        return metrics

    def learn(self, rollout: Rollout, rewards: torch.Tensor, times: dict[str, float] | None = None
              ) -> tuple[Rollout, dict[str, float]]:
        """The stages after scoring: advantages, old/reference log-probs, the updates and the weight sync
        (and, for PPO, the critic's values and update; see the module docstring for the two orders).
        Returns the rollout that trained (``algo.drop_zero_adv`` may drop samples) and the figures."""
        times = {} if times is None else times
        metrics: dict[str, float] = {}
        if self.cfg.critic_warmup <= self.step + 1:  # vLLM asleep during the passes (rollout.sleep_level) until the sync
            self.env.release_rollout_memory()
        # The KL in the reward reads the old and reference log-probs: they come first (verl's order);
        # so does distillation's advantage, which reads the student's and the teacher's.
        logprobs_first = self.kl_ctrl is not None or self.distill is not None
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
        # verl's critic warm-up, as its code counts: step numbers start at 1 and the actor trains when
        # critic_warmup <= step, so N holds it back N-1 steps (``TrainerConfig.critic_warmup``).
        if self.cfg.critic_warmup <= self.step + 1:
            with _timer(times, "update"):
                metrics.update(self.update(rollout))
            if self.rollouts is None:  # asynchronous: the producer loads published weights between generations
                with _timer(times, "sync"):
                    self.env.sync_weights()
        self.samples_to_log = completions.records(rollout, self.cfg.log_completions)  # for the logging stage
        return rollout, metrics

    def dynamic_sampling(self, stop: bool = True) -> FilteredBatch:
        """Rollout and score for DAPO's dynamic sampling (``unirl.trainer.dynamic_sampling``): batches of
        prompts drawn in order (``prompt_batches`` counts them, checkpointed) until the step's groups are kept.
        ``stop=False`` (the asynchronous producer): a signal does not give the batch up; it is finished and saved."""

        def next_rows() -> list[dict]:
            self.prompt_batches += 1
            return self.env.next_prompts(self.prompt_batches - 1)

        return sample_filtered(self.env, self.accelerator, self.algo.filter_groups, prompts_per_step=self.cfg.prompts_per_step,
                               group_size=self.cfg.group_size, next_rows=next_rows,
                               stop=(lambda: self.signals.requested(self.accelerator)) if stop else None)

    # ================================================= the stages, each in its own module
    def advantages(self, rollout: Rollout, rewards: torch.Tensor) -> dict[str, float]:
        """``rollout.advantages`` (and rewards, returns) over the global batch (``unirl.trainer.advantages``)."""
        return advantages_stage.compute_advantages(self, rollout, rewards)

    def drop_zero_advantage(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """FlowGRPO's zero-advantage drop (``unirl.trainer.zero_advantage``)."""
        return zero_advantage.drop_zero_advantage(self, rollout)

    def old_and_reference(self, rollout: Rollout) -> dict[str, float]:
        """``rollout.old_logp``, ``old`` and ``ref`` (``unirl.trainer.logprobs``)."""
        return logprobs_stage.old_and_reference(self, rollout)

    def update(self, rollout: Rollout) -> dict[str, float]:
        """The policy's optimizer steps over ``rollout`` (``unirl.trainer.update``)."""
        return update_stage.update(self, rollout)

    def optimizer_step(self) -> float:
        """One optimizer step of the policy; returns the gradient norm (``unirl.trainer.update``)."""
        return update_stage.optimizer_step(self)

    # ============================================================== helpers the stages share
    def num_mini_batches(self) -> int:
        return num_mini_batches(self.cfg.prompts_per_step, self.cfg.group_size, self.cfg.mini_batch_size)

    def on_policy(self) -> bool:
        """Whether every forward of the update sees the weights that the old log-probs belong to: one
        mini-batch and one epoch, so the only optimizer step comes after all of them. (Not when the KL
        is in the reward or distilling: the rewards or advantages need the old log-probs before the update.)"""
        return (self.cfg.ppo_epochs == 1 and self.num_mini_batches() == 1 and self.kl_ctrl is None
                and self.distill is None)

    def micro_batches(self, batch: Rollout) -> list[torch.Tensor]:
        """The micro-batches of ``batch`` as index tensors (``plan_micro_batches``): ``micro_batch_size``
        samples each, or packed by ``trainer.micro_batch_tokens`` over ``env.sample_tokens`` and then
        padded only to their own longest (``env.trim_padding``). With several processes every one runs
        as many micro-batches as the busiest, as FSDP's collective forwards need."""
        budget = self.cfg.micro_batch_tokens
        lengths = None if budget is None else self.env.sample_tokens(batch)  # [n]
        chunks = plan_micro_batches(len(batch), micro_batch_size=self.cfg.micro_batch_size, lengths=lengths,
                                    token_budget=budget)
        if budget is not None and self.accelerator.num_processes > 1:
            count = torch.tensor([len(chunks)], device=self.accelerator.device)
            chunks = split_to_count(chunks, int(self.accelerator.reduce(count, reduction="max")))
        return [torch.tensor(c, dtype=torch.long) for c in chunks]

    def _evaluate_and_log(self) -> None:
        """``evaluate`` and its row in the logs; a failure says where the last checkpoint is."""
        try:
            if self.rollouts is None:
                self.run_log.log({"step": self.step, **self.evaluate()})
            else:  # the engine is shared with the producer: drained, then given the current weights
                with self.rollouts.exclusive_engine():
                    self.env.sync_weights()
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
        self.run_log.log_media(self.env.evaluation_media, self.step)
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
            scores = rollout.tensors.get("score/" + key.removeprefix("reward/"))  # the environment's extras
            if scores is not None:
                out[key] = gather_rows(self.accelerator, scores.float()).nanmean().item()
            else:
                out[key] = sum_over_processes(self.accelerator, value) / self.accelerator.num_processes
        return out

    # ========================================================= checkpoints
    def save_checkpoint(self) -> Path | None:
        """``checkpoints/step_N/``: the policy and ``trainer_state/`` (``unirl.trainer.checkpoints``); a
        non-finite state is not saved over the last good checkpoint (``unirl.trainer.nonfinite``)."""
        why = self.nonfinite.unsafe_to_save(self.accelerator._models)
        if why is not None:
            self.accelerator.print(skip_save_line(self.step, why, self.run_dir))
            return (checkpoints.checkpoint_dirs(self.run_dir) or [None])[-1]
        if self.rollouts is not None:  # the in-flight batches finished (saved with the state), prompt_batches settled
            self.rollouts.drain()
        state = {"step": self.step, "optimizer_steps": self.optimizer_steps, "prompt_batches": self.prompt_batches,
                 "zero_adv_steps": self.zero_adv.streak}  # the streak its warning counts goes on after a resume
        if self.kl_ctrl is not None:  # plain JSON in loop.json: the coefficient resumes exactly
            state["kl_ctrl"] = self.kl_ctrl.state_dict()
        return checkpoints.save_checkpoint(self.accelerator, self.env, self.run_dir, self.step, state,
                                           keep=self.cfg.keep_checkpoints, config=self.config_dict)

    def _resume(self) -> None:
        state = checkpoints.resume(self.accelerator, self.run_dir, self.config_dict)
        if state is not None:
            self.step, self.optimizer_steps = state["step"], state["optimizer_steps"]
            self.prompt_batches = state.get("prompt_batches", 0)
            self.zero_adv.streak = state.get("zero_adv_steps", 0)
            if self.kl_ctrl is not None and "kl_ctrl" in state:
                self.kl_ctrl.load_state_dict(state["kl_ctrl"])


# ================================================================ helpers
def rollout_staleness(env: Environment | None) -> int:
    """``rollout.max_staleness`` of the environment's config (text's), 0 where it has none (diffusion)."""
    return getattr(getattr(getattr(env, "cfg", None), "rollout", None), "max_staleness", 0)


@contextlib.contextmanager
def _timer(times: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start
