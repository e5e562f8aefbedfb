"""The step plan: the stages after a batch is sampled and scored, each declaring the ``Rollout`` fields it
reads and writes, put in order once at setup from the config (``build_plan``) and run every step
(``StepPlan.run``). A stage receives the batch, the run state and the step context
(``unirl.trainer.context``), never the trainer.

The order is data, not ``if``s: the stages that use the batch (``CONSUMERS``) keep their order, and a stage
that only computes what others read (``PRODUCERS``: the old and reference log-probs, the critic's values)
is placed right before the first stage that reads a field it writes. So the KL in the reward (the
advantages read ``old`` and ``ref``) and on-policy distillation (they read ``old_logp`` and
``teacher_logp``) put the log-probs before the advantages (verl's order), and otherwise they come after the
zero-advantage drop, on the samples that train. ``unirl train ... --dry-run`` prints the plan.

The batch arrives from the run's source (``unirl.rollout.sources``) with ``tensors``, ``engine_logp``,
``policy_version`` and ``rewards``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from unirl.env import Rollout
from unirl.trainer.context import RunState, StepContext

#: What the batch holds when it arrives from the source.
FROM_SOURCE = ("tensors", "engine_logp", "policy_version", "rewards")


@dataclass(frozen=True)
class Stage:
    """One stage: ``run(ctx, state, rollout)`` returns its figures (or ``(rollout, figures)`` for a stage that
    keeps only some samples); ``reads`` / ``writes``: ``Rollout`` fields; ``actor``: runs only once the actor
    trains (from ``trainer.critic_warmup`` on); ``timer``: its ``time/<name>`` figure (None: not timed)."""

    name: str
    run: Callable
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    actor: bool = False
    timer: str | None = None
    about: str = ""
    #: A stage added to a run (``build_plan(extra=...)``, ``Trainer(stages=...)``): the consumer it runs before.
    before: str = "update"


@dataclass
class StepPlan:
    """The ordered stages of a run's step."""

    stages: list[Stage]

    def run(self, ctx: StepContext, state: RunState, rollout: Rollout, times: dict[str, float]
            ) -> tuple[Rollout, dict[str, float]]:
        """Every stage in order on ``rollout`` (a stage may replace it by a sub-batch); the trained rollout and
        the stages' figures. An ``actor`` stage runs once ``trainer.critic_warmup <= state.step + 1``: verl's
        critic warm-up, as its code counts (step numbers start at 1 and the actor trains when
        ``critic_warmup <= step``, so N holds it back N-1 steps)."""
        metrics: dict[str, float] = {}
        actor_trains = ctx.cfg.critic_warmup <= state.step + 1
        for stage in self.stages:
            if stage.actor and not actor_trains:
                continue
            start = time.perf_counter()
            out = stage.run(ctx, state, rollout)
            if isinstance(out, tuple):
                rollout, out = out
            metrics.update(out or {})
            if stage.timer is not None:
                times[stage.timer] = times.get(stage.timer, 0.0) + time.perf_counter() - start
        return rollout, metrics

    @property
    def names(self) -> list[str]:
        return [stage.name for stage in self.stages]

    def describe(self) -> str:
        """The plan as lines: each stage, what it reads and writes, and whether it waits for the warm-up."""
        lines = [f"  0. source: sample and score the batch (writes {', '.join(FROM_SOURCE)})"]
        for i, stage in enumerate(self.stages, 1):
            io = []
            if stage.reads:
                io.append("reads " + ", ".join(stage.reads))
            if stage.writes:
                io.append("writes " + ", ".join(stage.writes))
            warm = " [from trainer.critic_warmup on]" if stage.actor else ""
            lines.append(f"  {i}. {stage.name}: {stage.about}" + (f" ({'; '.join(io)})" if io else "") + warm)
        return "\n".join(lines)


# ------------------------------------------------------------------- the stages
def _sleep_engine(ctx, state, rollout):
    ctx.env.sampler.release_memory()  # vLLM asleep during the passes (rollout.sleep_level) until the publish


def _old_logprobs(ctx, state, rollout):
    from unirl.trainer.logprobs import old_and_reference

    return old_and_reference(ctx, state, rollout)


def _values(ctx, state, rollout):
    ctx.critic.compute_values(rollout)


def _advantages(ctx, state, rollout):
    from unirl.trainer.advantages import compute_advantages

    return compute_advantages(ctx, state, rollout)


def _drop_zero_adv(ctx, state, rollout):
    from unirl.trainer.zero_advantage import drop_zero_advantage

    return drop_zero_advantage(ctx, state, rollout)


def _update_critic(ctx, state, rollout):
    return ctx.critic.update(rollout, state.step)


def _update(ctx, state, rollout):
    from unirl.trainer.update import update

    return update(ctx, state, rollout)


def _publish(ctx, state, rollout):
    ctx.source.after_update()  # inline: the new weights into the engine; threaded: published at the next step


def build_plan(algo, trainer_cfg, *, critic: bool, distill: bool, reads_logprobs: bool = True,
               extra: list[Stage] = ()) -> StepPlan:
    """The stages a run with these settings takes, in order (module docstring): ``algo`` and ``trainer_cfg``
    (the run's blocks), ``critic`` (the estimator reads values: PPO's critic), ``distill`` (a teacher is set),
    ``reads_logprobs`` (the policy loss takes a ratio of log-probs). ``extra``: a user's stages, each run
    right before the stage its ``before`` names, with the producers of what it reads placed ahead of it."""
    adv_reads = ["rewards"]
    if algo.use_kl_in_reward:
        adv_reads += ["old", "ref"]  # the KL in the reward: the old policy's outputs against the reference's
    if distill:
        adv_reads += ["old_logp", "teacher_logp"]  # the reverse KL to the teacher on the sampled tokens
    if critic:
        adv_reads += ["values"]
    update_reads = ["advantages"] + (["old_logp"] if reads_logprobs else []) + (["ref"] if algo.kl_coef > 0 else [])
    producers = [
        Stage("old_logprobs", _old_logprobs, writes=("old_logp", "old", "ref", "teacher_logp"), timer="old_logprobs",
              about="the old policy's log-probs (recomputed by the trainer unless on-policy), the reference's and the teacher's"),
        *([Stage("values", _values, writes=("values",), timer="values", about="the critic's values")] if critic else []),
    ]
    consumers = [
        Stage("sleep_engine", _sleep_engine, actor=True, about="free the engine's device memory for the update"),
        Stage("advantages", _advantages, reads=tuple(adv_reads), writes=("advantages", "returns"), timer="advantages",
              about=f"{algo.adv_estimator} advantages over the global batch"),
        *([Stage("drop_zero_adv", _drop_zero_adv, reads=("advantages",), timer="advantages",
                 about="keep the samples with a non-zero advantage")] if algo.drop_zero_adv else []),
        *([Stage("update_critic", _update_critic, reads=("values", "returns"), timer="update_critic",
                 about="the critic's optimizer steps")] if critic else []),
        Stage("update", _update, reads=tuple(update_reads), actor=True, timer="update",
              about="the policy's optimizer steps on the configured loss"),
        Stage("publish", _publish, actor=True, timer="sync", about="the new weights to the rollout engine"),
    ]
    for stage in extra:
        names = [c.name for c in consumers]
        if stage.before not in names:
            raise ValueError(f"step plan: stage {stage.name!r} runs before {stage.before!r}, which this run's plan has "
                             f"not; its stages: {', '.join(names)}")
        if stage.name in names:
            raise ValueError(f"step plan: a stage is already called {stage.name!r}")
        consumers.insert(names.index(stage.before), stage)
    plan, written = [], set(FROM_SOURCE)
    for consumer in consumers:
        for field in consumer.reads:
            if field in written:
                continue
            producer = next((p for p in producers if field in p.writes), None)
            if producer is None:
                raise ValueError(f"step plan: {consumer.name} reads {field}, which no stage writes")
            plan.append(producer)
            written.update(producer.writes)
        plan.append(consumer)
        written.update(consumer.writes)
    return StepPlan(plan)
