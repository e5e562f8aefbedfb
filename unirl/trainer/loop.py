"""The one training loop, for every environment, on Accelerate: set up the parts, then run the steps.

Each step takes a scored batch from the run's batch source and runs the step plan on it
(``unirl.trainer.plan``: named stages, each timed as ``time/<stage>``, each in its own module of
``unirl.trainer``, each given the batch, the run state and the step context, never the trainer):

    rollout -> score -> advantages -> old_logprobs (+ reference) -> update -> sync -> log
    (+ evaluate and checkpoint every N steps)

The rollout and score stages are the run's batch source (``unirl.rollout.sources``): inline (sampled when the
step asks, the weights synced into the engine after the update), threaded (``source.max_staleness: k >= 1``:
a producer thread samples ahead with weights up to k steps old; the step publishes its weights for the
batch k steps ahead instead of syncing) or remote (``source.urls``: rollout servers). One step for all.

The plan's order follows what the stages read: PPO with a critic (``algo.adv_estimator: gae``) and the KL in
the reward run verl's order, where the rewards on tokens read the old and reference log-probs and the
advantages read the critic's values:

    rollout -> score -> old_logprobs (+ reference) -> values -> advantages (token rewards with the KL
    penalty, GAE) -> update_critic -> update (from step ``trainer.critic_warmup`` on) -> sync -> log

The algorithm lives in ``unirl/core`` (advantages, the registered policy losses, KL, aggregation); the
environment (``unirl/env.py``) supplies samples, rewards and the forward of stored actions
(``score_actions``). What flows between the stages is a ``Rollout`` (its typed fields: rewards,
advantages, old/reference log-probs ...). Shapes: N = B*G samples, T tokens or trained denoising steps.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from unirl.core import ADVANTAGE_ESTIMATORS
from unirl.core.policy_losses import POLICY_LOSSES
from unirl.env import Environment, Rollout
from unirl.rewards.registry import RewardError
from unirl.config.schema import AlgoConfig, OptimConfig, SourceConfig, TrainerConfig
from unirl.rollout.sources import build_source, resolve_bypass_mode
from unirl.trainer import checkpoints, zero_advantage
from unirl.trainer.backends import build_backend
from unirl.trainer.context import RunState, StepContext
from unirl.trainer.critic import Critic
from unirl.trainer.distributed import cpu_processes
from unirl.trainer.dynamic_sampling import SamplingStopped
from unirl.trainer.kl_control import build_kl_controller
from unirl.trainer.metrics import global_reward_metrics
from unirl.trainer.nonfinite import NonFiniteWatch, skip_save_line
from unirl.trainer.optim import build_optimizer, build_scheduler
from unirl.trainer.perf import PerfMeter
from unirl.trainer.plan import StepPlan, build_plan
from unirl.trainer.preemption import Preempted, StopSignals
from unirl.trainer.produce import Producer
from unirl.trainer.run_log import Progress, RunLog
from unirl.trainer.update import loss_settings, run_policy_loss

__all__ = ["Preempted", "Trainer"]


class Trainer:
    def __init__(self, env: Environment, *, algo: AlgoConfig, optim: OptimConfig, trainer: TrainerConfig,
                 run_dir: str | Path, config_dict: dict[str, Any] | None = None, critic: Any = None,
                 policy_loss: str | None = None, distill: Any = None, source: SourceConfig | None = None,
                 stages: list | None = None):
        """``policy_loss``: a registered policy loss (``unirl.core.policy_losses``) by name, instead of the
        configured one (``run_policy_loss``: ``algo.policy_loss``, else the environment's rollout mode's,
        else the ratio loss at ``algo.level``). ``distill``: the environment's ``distill`` block (text's
        ``DistillConfig``); with a teacher, on-policy distillation (``unirl.core.distill``). ``source``: the
        run's ``source`` block (``SourceConfig``: where batches come from; None: sampled when the step asks).
        ``stages``: your own ``unirl.trainer.plan.Stage``s, placed in the step plan by what they read."""
        self.env, self.algo, self.optim_cfg, self.cfg = env, algo, optim, trainer
        self.critic_cfg = critic  # the environment's critic block (text: ``critic``), read when a critic is built
        self.distill = distill if distill is not None and distill.teacher else None
        k = algo.kl_ctrl  # the coefficient of the KL in the reward, when it is there
        self.state = RunState(kl_ctrl=build_kl_controller(k.type, kl_coef=k.kl_coef, target_kl=k.target_kl,
                                                          horizon=k.horizon) if algo.use_kl_in_reward else None)
        if policy_loss is None and env is not None:
            policy_loss = run_policy_loss(env, algo)
        self.policy_loss = None if policy_loss is None else POLICY_LOSSES.get(policy_loss)
        self.loss_settings = loss_settings(policy_loss, algo)
        self.run_dir = Path(run_dir)
        self.config_dict = config_dict or {}
        self.signals = StopSignals()  # SIGTERM/SIGINT: stop after the current step
        self.source_cfg = source if source is not None else SourceConfig()
        self.bypass_mode = resolve_bypass_mode(self.source_cfg, env)  # the ratio's anchor
        self.plan: StepPlan = build_plan(
            algo, trainer, critic=bool(getattr(ADVANTAGE_ESTIMATORS.get(algo.adv_estimator), "reads_values", False)),
            distill=self.distill is not None, reads_logprobs=self.policy_loss is None or self.policy_loss.reads_logprobs,
            extra=list(stages or []))
        self.source = self.producer = self.ctx = self.critic = None  # built at setup
        self.nonfinite = NonFiniteWatch(trainer.max_nonfinite_steps)  # NaN losses or values: stop, keep the checkpoints
        self.zero_adv = zero_advantage.ZeroAdvantageWatch()  # every advantage 0 for steps in a row: a warning line

    @classmethod
    def from_config(cls, env: Environment, cfg, **kwargs) -> "Trainer":
        """A trainer for ``env`` with a loaded run config's blocks (algo, optim, trainer, source, and the critic
        and distillation blocks where the environment's config has them), writing to ``cfg.output_dir``."""
        from unirl.config import config_to_dict

        return cls(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                   config_dict=config_to_dict(cfg), source=cfg.source, **{**cfg.trainer_blocks(), **kwargs})

    # the run's counters (``RunState``), read by tests and tools
    step = property(lambda self: self.state.step, lambda self, v: setattr(self.state, "step", v))
    optimizer_steps = property(lambda self: self.state.optimizer_steps,
                               lambda self, v: setattr(self.state, "optimizer_steps", v))
    kl_ctrl = property(lambda self: self.state.kl_ctrl)

    # ================================================================ setup
    def setup(self) -> None:
        """1. the accelerator and the environment; 2. the batch source; 3. the backend lays the models out and
        prepares them with their optimizers; 4. the step context and the named state objects; 5. resume."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        self.accelerator = Accelerator(mixed_precision=cfg.mixed_precision, log_with=cfg.log_with or None,
                                       project_dir=str(self.run_dir), cpu=cpu_processes())
        set_seed(cfg.seed)
        self._guard_run_dir()
        self.env.setup(self.accelerator)
        # 2. Before the policy is sharded or wrapped (a threaded source may copy it for its engine).
        self.producer = Producer(self.env, self.accelerator, self.algo.filter_groups,
                                 prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size)
        self.source = build_source(self.source_cfg, self.env, self.producer,
                                   policy=lambda: self.accelerator.unwrap_model(self.env.model),
                                   total_steps=cfg.total_steps, num_processes=self.accelerator.num_processes,
                                   dynamic_sampling=self.algo.filter_groups.enabled,
                                   stop=lambda: self.signals.requested(self.accelerator))
        # 3. The policy (and the frozen reference and teacher) laid out before the optimizer sees the parameters.
        self.backend = backend = build_backend(self.accelerator, cfg)
        backend.shard(self.env.model, what="policy")
        for name, frozen in self.env.models.frozen.items():  # the reference copy, distillation's teacher: no optimizer
            backend.shard(frozen, what=name)
        optimizer = build_optimizer(self.env.model, self.optim_cfg, what="environment's model")
        # The scheduler is not prepared: Accelerate's wrapper steps it once per process at every call
        # (it assumes a dataloader split over processes), so 2 processes would warm up twice as fast.
        scheduler = build_scheduler(optimizer, self.optim_cfg, total_steps=cfg.total_steps * cfg.ppo_epochs *
                                    self.num_mini_batches())
        self.env.model, self.optimizer = backend.prepare(self.env.model, optimizer)
        self.scheduler = scheduler
        checkpoints.check_supported(self.accelerator)
        # 4. The step context (the critic needs its micro-batches) and the objects a checkpoint names.
        self.ctx = StepContext(env=self.env, backend=backend, algo=self.algo, cfg=cfg, optim=self.optim_cfg,
                               policy_loss=self.policy_loss, loss_settings=self.loss_settings,
                               bypass_mode=self.bypass_mode, distill=self.distill, optimizer=self.optimizer,
                               scheduler=scheduler, source=self.source)
        self.ctx.critic = self.critic = self._build_critic()
        self.state_objects = self._state_objects()
        self.run_log = RunLog(self.accelerator, self.run_dir, cfg)
        if cfg.resume:  # before config.yaml is rewritten: a refused resume leaves the run's record as it was
            self._resume()
        self.run_log.start(self.config_dict)
        self.perf = PerfMeter.start(self.accelerator, self.env.model, self.run_dir, cfg.ppo_epochs)  # run_info.json
        self.env.sampler.sync_weights()
        self.source.start(self.step, self.optimizer_steps)

    def _build_critic(self) -> Critic | None:
        """A critic when the advantage estimator reads values (``reads_values``: ``gae``), else None."""
        if not getattr(ADVANTAGE_ESTIMATORS.get(self.algo.adv_estimator), "reads_values", False):
            return None
        if self.critic_cfg is None:
            raise ValueError(f"algo.adv_estimator={self.algo.adv_estimator} trains a critic, and "
                             f"{type(self.env).__name__} has no critic config")
        return Critic(self.critic_cfg, env=self.env, backend=self.backend, micro_batches=self.ctx.micro_batches,
                      num_mini_batches=self.num_mini_batches(), ppo_epochs=self.cfg.ppo_epochs, seed=self.cfg.seed,
                      total_steps=self.cfg.total_steps)

    def _state_objects(self) -> dict[str, tuple[str, Any]]:
        """What a checkpoint saves besides the loop's counters, by name (``unirl.trainer.checkpoints``): the
        trained models and their optimizers, the environment's objects, the schedules and the batch source's
        in-flight batches, in the order earlier versions numbered their files (``legacy_stems``)."""
        objects: dict[str, tuple[str, Any]] = {"policy": ("model", self.env.model),
                                               "policy_optimizer": ("optimizer", self.optimizer)}
        if self.critic is not None:
            objects.update(critic=("model", self.critic.model), critic_optimizer=("optimizer", self.critic.optimizer))
        for name, obj in self.env.checkpoint_objects().items():
            if name in objects or name in ("policy_scheduler", "critic_scheduler", "source"):
                raise ValueError(f"{type(self.env).__name__}.checkpoint_objects: {name!r} is a name the trainer uses")
            objects[name] = ("state", obj)
        objects["policy_scheduler"] = ("scheduler", self.scheduler)
        if self.critic is not None:
            objects["critic_scheduler"] = ("scheduler", self.critic.scheduler)
        if hasattr(self.source, "state_dict"):
            objects["source"] = ("state", self.source)
        return objects

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
            if self.source is not None:
                self.source.close(wait=sys.exc_info()[0] is None)  # before the engine it samples with
            self.env.close()
        return history

    def train_step(self) -> dict[str, float]:
        """One step: the batch from the source (sampled now, or ahead with weights up to ``max_staleness``
        steps old), the step plan on it (``learn``), and the step's figures."""
        start = time.perf_counter()
        trained_from = self.optimizer_steps  # staleness: against the weights this step starts from
        batch, waited = self.source.get(self.step, self.optimizer_steps)
        times: dict[str, float] = dict(batch.times)
        rollout, learn_metrics = self.learn(batch.rollout, batch.rewards, times)
        self.step += 1
        metrics = {"step": self.step, **global_reward_metrics(self.accelerator, batch.rewards, batch.reward_metrics,
                                                              rollout),
                   **learn_metrics, **(batch.filter_metrics or {}),
                   **self.source.step_metrics(batch, trained_from, waited)}
        metrics.update({f"time/{k}": v for k, v in times.items()})
        metrics["time/step"] = time.perf_counter() - start  # the stages and the gathering of figures between them
        metrics.update(self.perf.step_metrics(rollout, metrics["time/step"]))  # perf/*: memory, throughput, MFU
        return metrics

    def learn(self, rollout: Rollout, rewards: torch.Tensor, times: dict[str, float] | None = None
              ) -> tuple[Rollout, dict[str, float]]:
        """The step plan on a scored rollout (``unirl.trainer.plan``: advantages, old/reference log-probs, the
        updates and the weight sync, in the order the config's stages need). Returns the rollout that trained
        (``algo.drop_zero_adv`` may drop samples) and the figures."""
        rollout.rewards = rewards
        return self.plan.run(self.ctx, self.state, rollout, {} if times is None else times)

    # ============================ single stages, for tests and tools (the plan runs them in a step)
    def advantages(self, rollout: Rollout, rewards: torch.Tensor) -> dict[str, float]:
        from unirl.trainer.advantages import compute_advantages

        rollout.rewards = rewards
        return compute_advantages(self.ctx, self.state, rollout)

    def drop_zero_advantage(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        return zero_advantage.drop_zero_advantage(self.ctx, self.state, rollout)

    def old_and_reference(self, rollout: Rollout) -> dict[str, float]:
        from unirl.trainer.logprobs import old_and_reference

        return old_and_reference(self.ctx, self.state, rollout)

    def update(self, rollout: Rollout) -> dict[str, float]:
        from unirl.trainer.update import update

        return update(self.ctx, self.state, rollout)

    def optimizer_step(self) -> float:
        from unirl.trainer.update import optimizer_step

        return optimizer_step(self.ctx, self.state)

    def num_mini_batches(self) -> int:
        from unirl.trainer.micro_batches import num_mini_batches

        return num_mini_batches(self.cfg.prompts_per_step, self.cfg.group_size, self.cfg.mini_batch_size)

    def on_policy(self) -> bool:
        return self.ctx.on_policy()

    def micro_batches(self, batch: Rollout) -> list[torch.Tensor]:
        return self.ctx.micro_batches(batch)

    def _evaluate_and_log(self) -> None:
        """``evaluate`` and its row in the logs; a failure says where the last checkpoint is."""
        try:
            with self.source.for_evaluation():  # threaded: the producer drained, the engine given the current weights
                self.run_log.log({"step": self.step, **self.evaluate()})
        except RewardError as e:
            raise RewardError(f"evaluation at step {self.step}: {e}; {checkpoints.last_checkpoint_hint(self.run_dir)}") from e
        except Exception as e:
            e.add_note(f"unirl: evaluation at step {self.step} failed; {checkpoints.last_checkpoint_hint(self.run_dir)}")
            raise

    def evaluate(self) -> dict[str, float]:
        start = time.perf_counter()
        out, media = self.env.evaluation(self.step, self.run_dir)
        if out:
            out["time/eval"] = time.perf_counter() - start
        self.run_log.log_media(media, self.step)
        return out

    def leave(self) -> None:
        """After ``train``: several processes leave together, since one tearing the process group down while
        another is still busy (the main process writing logs) can abort gloo ("terminate called without an
        active exception")."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # vLLM's shutdown may have torn it down already
            self.accelerator.wait_for_everyone()
            self.accelerator.state.destroy_process_group()

    # ========================================================= checkpoints
    def save_checkpoint(self) -> Path | None:
        """``checkpoints/step_N/``: the policy and ``trainer_state/`` (``unirl.trainer.checkpoints``); a
        non-finite state is not saved over the last good checkpoint (``unirl.trainer.nonfinite``)."""
        models = [obj for kind, obj in self.state_objects.values() if kind == "model"]
        why = self.nonfinite.unsafe_to_save(models)
        if why is not None:
            self.accelerator.print(skip_save_line(self.step, why, self.run_dir))
            return (checkpoints.checkpoint_dirs(self.run_dir) or [None])[-1]
        self.source.drain()  # threaded: the in-flight batches finished (saved with the state), prompt_batches settled
        state = {"step": self.step, "optimizer_steps": self.optimizer_steps, "prompt_batches": self.producer.prompt_batches}
        if self.kl_ctrl is not None:  # plain JSON in loop.json: the coefficient resumes exactly
            state["kl_ctrl"] = self.kl_ctrl.state_dict()
        return checkpoints.save_checkpoint(self.backend, self.env, self.run_dir, self.step, self.state_objects, state,
                                           keep=self.cfg.keep_checkpoints, config=self.config_dict)

    def _resume(self) -> None:
        state = checkpoints.resume(self.backend, self.run_dir, self.state_objects, self.config_dict)
        if state is not None:
            self.step, self.optimizer_steps = state["step"], state["optimizer_steps"]
            self.producer.prompt_batches = state.get("prompt_batches", 0)
            if self.kl_ctrl is not None and "kl_ctrl" in state:
                self.kl_ctrl.load_state_dict(state["kl_ctrl"])
