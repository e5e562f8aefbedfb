"""PPO's critic: the value model, its values for a rollout and its update, the actor's sibling in the loop.

verl's ``RayPPOTrainer.fit`` order, of which this file holds the critic's two stages::

    rollout -> score -> old / reference log-probs -> values (here) -> token rewards (KL penalty)
    -> GAE advantages and returns -> critic update (here) -> actor update

The value model comes from the environment (``Environment.value_model``: text builds verl's
``AutoModelForTokenClassification`` with one label), is prepared with the accelerator after the
policy (so checkpoints save and resume its weights and AdamW state with the trainer's; its schedule
is registered for checkpointing beside the actor's),
and trains on ``unirl.core.value_loss`` with the trainer's mini-batches, micro-batches and token
budget. Shapes: N samples, T tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from unirl.trainer.micro_batches import scatter_rows
from unirl.core import explained_variance, value_loss
from unirl.trainer.distributed import gather_rows
from unirl.env import Environment, Rollout
from unirl.trainer.metrics import MetricLog, reduce_over_processes
from unirl.trainer.update import global_denominator
from unirl.trainer.optim import build_optimizer, build_scheduler


class Critic:
    """The value model with its optimizer and schedule, prepared with ``accelerator``.

    ``backend`` lays it out and steps it as the policy (``unirl.trainer.backends``); ``micro_batches`` cuts a
    batch into micro-batches as the actor's update does (``StepContext.micro_batches``); ``num_mini_batches``
    is the actor's number of optimizer steps per pass; ``seed`` seeds the mini-batch shuffle (with the step)."""

    def __init__(self, cfg: Any, *, env: Environment, backend, micro_batches: Callable[[Rollout], list],
                 num_mini_batches: int, ppo_epochs: int, seed: int, total_steps: int):
        self.cfg, self.env, self.backend, self.accelerator = cfg, env, backend, backend.accelerator
        self.micro_batches, self.num_mini = micro_batches, num_mini_batches
        self.epochs = cfg.ppo_epochs or ppo_epochs
        self.seed = seed
        model = backend.shard(env.models.value_model(cfg), what="critic")  # before its optimizer sees the parameters
        optimizer = build_optimizer(model, cfg.optim, what="critic")
        # Its optimizer steps over the run: every training step's passes of mini-batches.
        self.scheduler = build_scheduler(optimizer, cfg.optim, total_steps=total_steps * self.epochs * num_mini_batches)
        # The scheduler is not prepared (Accelerate's wrapper would step it once per process); checkpoints
        # save it by name beside the actor's.
        self.model, self.optimizer = backend.prepare(model, optimizer)

    @torch.no_grad()
    def compute_values(self, rollout: Rollout) -> None:
        """The values [N, T] of the rollout's positions before any update (PPO's old values: GAE's
        baseline and the value clip's centre), stored as ``rollout.values``."""
        if len(rollout) == 0:
            return
        parts = []
        for idx in self.micro_batches(rollout):
            parts.append((idx, self.env.actions.values(self.model, self.env.actions.trim_padding(rollout.select(idx))).cpu()))
        rollout.values = scatter_rows(parts, len(rollout), self.env.actions.loss_mask(rollout).shape[1])  # [N, T]

    def update(self, rollout: Rollout, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of mini-batch AdamW steps on the clipped value loss against
        ``rollout.returns``, each micro-batch's loss its share of the global mini-batch's
        (as the actor's update). Logged: ``critic/vf_loss`` (global mini-batch value, mean over
        mini-batches), ``critic/vf_clipfrac`` and ``critic/vpred_mean`` (means over micro-batches and
        processes), ``critic/grad_norm``, ``critic/lr`` and ``critic/explained_var`` (of the rollout's
        values, before this update, over the global batch)."""
        if len(rollout) == 0:
            return {}
        out = {"critic/explained_var": self._explained_variance(rollout)}
        model, log = self.model, MetricLog()
        if not model.training:
            model.train()
        mini_size = -(-len(rollout) // self.num_mini)
        # Its own shuffle (seeded apart from the actor's), so the actor's order does not depend on the critic.
        generator = torch.Generator().manual_seed(self.seed * 7_927 + step) if self.num_mini > 1 else None
        for _ in range(self.epochs):
            order = torch.randperm(len(rollout), generator=generator) if self.num_mini > 1 else torch.arange(len(rollout))
            for mini_idx in order.split(mini_size):
                mini_batch = rollout.select(mini_idx)
                denominator = self._mini_denominator(mini_batch)
                chunks = self.micro_batches(mini_batch)
                mini = MetricLog()
                for k, micro_idx in enumerate(chunks):
                    micro = self.env.actions.trim_padding(mini_batch.select(micro_idx))
                    mini.add(self._micro_backward(micro, denominator, sync=k == len(chunks) - 1))
                log.add(mini.result(sum_shares=True))
                log.add({"critic/grad_norm": self._optimizer_step()})
        out.update(reduce_over_processes(self.accelerator, log.result(sum_shares=False)))
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _micro_backward(self, micro: Rollout, denominator: torch.Tensor, sync: bool) -> dict[str, float]:
        backend = self.backend
        device = backend.device
        # DDP and FSDP2 reduce the gradients in the mini-batch's last backward.
        hold_back = backend.holds_back(self.model) and not sync
        with backend.hold_gradients(self.model) if hold_back else contextlib.nullcontext():
            values = self.env.actions.values(self.model, micro)  # [n, T']
            mask = self.env.actions.loss_mask(micro).to(device).bool()  # [n, T']
            old, returns = (getattr(micro, k)[:, : values.shape[1]].to(device) for k in ("values", "returns"))
            loss, metrics = value_loss(values, old, returns, mask, clip=self.cfg.cliprange_value,
                                       agg=self.cfg.loss_agg, denominator=denominator)
            backend.backward(loss)  # scaled back up for DDP's average over processes (as the actor's update)
        figures = torch.stack([loss.detach(), metrics["vf_clipfrac"].float(), metrics["vpred_mean"].float()]).tolist()
        return dict(zip(("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"), figures))

    def _mini_denominator(self, mini: Rollout) -> torch.Tensor:
        return global_denominator(self.accelerator, self.env, mini, self.cfg.loss_agg)

    def _optimizer_step(self) -> float:
        return self.backend.clip_and_step(self.model, self.optimizer, self.scheduler, self.cfg.optim.max_grad_norm,
                                          what="critic")

    def _explained_variance(self, rollout: Rollout) -> float:
        acc = self.accelerator
        mask = gather_rows(acc, self.env.actions.loss_mask(rollout).bool())  # [N_all, T]
        values, returns = (gather_rows(acc, getattr(rollout, k).float()) for k in ("values", "returns"))
        return float(explained_variance(values, returns, mask))
