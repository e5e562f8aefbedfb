"""The one training loop, for every environment, on Accelerate.

Each step is a short sequence of named stages, each timed as ``time/<stage>``:

    rollout -> score -> advantages -> old_logprobs (+ reference) -> update -> sync -> log
    (+ evaluate and checkpoint every N steps)

The algorithm lives in ``unirl/core`` (advantages, clipped loss, KL, aggregation); the environment
(``unirl/env.py``) supplies samples, rewards and log-probs. Shapes: N = B*G samples, T tokens or
trained denoising steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch

from rewards.registry import RewardError
from unirl.core import (aggregate, aggregate_denominator, clipped_policy_loss, compute_advantages, group_stats,
                        policy_loss_metrics, truncated_importance_weights)
from unirl.distributed import cpu_processes, gather_rows, sum_over_processes
from unirl.env import Environment, Rollout
from unirl.metrics import MetricLog, reduce_over_processes
from unirl.schema import AlgoConfig, OptimConfig, TrainerConfig

#: Exit status of a run stopped by a signal after it saved its checkpoint (128 + the signal's number).
_SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}


class Preempted(RuntimeError):
    """The run stopped on SIGTERM/SIGINT after finishing a step and saving a checkpoint."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Trainer:
    def __init__(self, env: Environment, *, algo: AlgoConfig, optim: OptimConfig, trainer: TrainerConfig,
                 run_dir: str | Path, config_dict: dict[str, Any] | None = None):
        self.env, self.algo, self.optim_cfg, self.cfg = env, algo, optim, trainer
        self.run_dir = Path(run_dir)
        self.config_dict = config_dict or {}
        self.step = 0
        self.optimizer_steps = 0  # across all training steps; drives Environment.after_optimizer_step
        self._stop_signal: int | None = None  # set by SIGTERM/SIGINT: stop after the current step

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
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the environment's model has no trainable parameters")
        o = self.optim_cfg
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        warmup = o.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.env.model = model
        for obj in self.env.checkpoint_objects():
            self.accelerator.register_for_checkpointing(obj)
        if self.accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _write_yaml(self.run_dir / "config.yaml", self.config_dict)
            if cfg.log_with:
                # Every tracker writes under the run directory (tensorboard: <run>/<project>/).
                self.accelerator.init_trackers(cfg.project, config=_flatten(self.config_dict), init_kwargs={
                    "wandb": {"dir": str(self.run_dir), "name": self.run_dir.name}})
        if cfg.resume:
            self._resume()
        self.env.sync_weights()

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
        A second SIGINT interrupts at once."""
        self.setup()
        history = []
        progress = _progress(self.cfg, self.step, self.accelerator.is_main_process)
        previous = self._install_signal_handlers()
        try:
            if self.cfg.eval_every and self.step == 0:
                self._log({"step": 0, **self.evaluate()}, history=None)
            while self.step < self.cfg.total_steps:
                try:
                    metrics = self.train_step()
                except RewardError as e:  # say what a crash leaves behind, with the reward's message
                    raise RewardError(f"{e}; {self._last_checkpoint_hint()}") from e
                history.append(metrics)
                self._log(metrics, history)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(_progress_fields(metrics), refresh=False)
                last = self.step == self.cfg.total_steps
                if self.cfg.eval_every and (self.step % self.cfg.eval_every == 0 or last):
                    self._log({"step": self.step, **self.evaluate()}, history=None)
                saved = None
                if (self.cfg.save_every and self.step % self.cfg.save_every == 0) or last:
                    saved = self.save_checkpoint()
                if not last and self._stop_requested():
                    self._stop(saved or self.save_checkpoint())
        finally:
            _restore_signal_handlers(previous)
            if progress is not None:
                progress.close()
            for tracker in self.accelerator.trackers:  # not end_training: the process group is the caller's
                tracker.finish()
            self.env.close()
        return history

    def _last_checkpoint_hint(self) -> str:
        steps = sorted((self.run_dir / "checkpoints").glob("step_*"))
        if not steps:
            return "no checkpoint was written yet"
        return f"the last checkpoint is {steps[-1]} (resume with trainer.resume=true)"

    # ========================================================== preemption
    def _install_signal_handlers(self) -> dict:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}  # signal handlers can only be set from the main thread

        def handler(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self._stop_signal = signum

        return {sig: signal.signal(sig, handler) for sig in _SIGNAL_EXIT}

    def _stop_requested(self) -> bool:
        """Whether any process got a stop signal; every process stops after the same step."""
        flag = torch.tensor([0 if self._stop_signal is None else int(self._stop_signal)], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        if int(flag) and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM  # another process was signalled
        return bool(int(flag))

    def _stop(self, checkpoint: Path) -> None:
        name = signal.Signals(self._stop_signal).name
        raise Preempted(
            f"stopped by {name} after step {self.step}; checkpoint {checkpoint}; resume with the same command "
            f"plus trainer.resume=true (--output-dir {self.run_dir})",
            _SIGNAL_EXIT.get(self._stop_signal, 143),
        )

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        times: dict[str, float] = {}
        with _timer(times, "rollout"):
            rollout = self.env.rollout(self.env.next_prompts(self.step), self.cfg.group_size)
        with _timer(times, "score"):
            rewards, reward_metrics = self.env.score(rollout)
        with _timer(times, "advantages"):
            adv_metrics = self.advantages(rollout, rewards)
            if self.algo.drop_zero_adv:
                rollout, drop_metrics = self.drop_zero_advantage(rollout)
                adv_metrics.update(drop_metrics)
        with _timer(times, "old_logprobs"):
            rollout_metrics = self.old_and_reference(rollout)
        with _timer(times, "update"):
            update_metrics = self.update(rollout)
        with _timer(times, "sync"):
            self.env.sync_weights()
        self.step += 1
        metrics = {"step": self.step, **self._global_reward_metrics(rewards, reward_metrics, rollout),
                   **adv_metrics, **rollout_metrics, **update_metrics}
        metrics.update({f"time/{k}": v for k, v in times.items()})
        metrics["time/step"] = time.perf_counter() - start  # the stages and the gathering of figures between them
        return metrics

    # ============================================================== stages
    def advantages(self, rollout: Rollout, rewards: torch.Tensor) -> dict[str, float]:
        """Advantages from rewards [N]: [N] (the same for every token / step of a sample) or [N, T]
        for estimators that work per token (``reinforce++-baseline`` whitens over tokens).

        With several processes the rewards, group ids and masks of all of them are gathered and the
        advantages (and their statistics: FlowGRPO's batch std, REINFORCE++'s whitening) computed over
        the global batch; each process keeps its own rows."""
        algo = self.algo
        mask = self.env.loss_mask(rollout).bool()  # [N, T]
        # Group ids made unique across processes: local ids renumbered 0..k-1, then offset by rank (one
        # process: its ids as they are, the estimators take any integers).
        rank, n = self.accelerator.process_index, len(rollout)
        all_rewards = gather_rows(self.accelerator, rewards.float())  # [N_all]
        if self.accelerator.num_processes > 1:
            local_ids = torch.unique(rollout.group_ids, return_inverse=True)[1]  # [N]
            all_ids = gather_rows(self.accelerator, local_ids + rank * n)  # [N_all]
        else:
            all_ids = rollout.group_ids  # [N]
        all_mask = gather_rows(self.accelerator, mask)  # [N_all, T_max]
        adv = compute_advantages(algo.adv_estimator, all_rewards, all_ids, mask=all_mask, scale=algo.adv_scale,
                                 eps=algo.adv_eps, unbiased=algo.adv_std == "unbiased")
        if algo.adv_clip is not None:
            adv = adv.clamp(-algo.adv_clip, algo.adv_clip)
        stats = group_stats(all_rewards, all_ids)
        per_token = adv if adv.ndim == 2 else adv.unsqueeze(-1).expand(all_mask.shape)  # [N_all, T_max]
        local = adv[rank * n:(rank + 1) * n]  # every process has N samples here (before any drop)
        rollout.tensors["advantages"] = local[:, : mask.shape[1]] if local.ndim == 2 else local
        rollout.tensors["rewards"] = rewards
        # Every figure in one host transfer: the masked means as sums over the mask, no boolean indexing.
        masked = torch.where(all_mask, per_token, 0.0)  # [N_all, T_max]
        count = all_mask.sum().clamp_min(1)
        names = ["adv/mean", "adv/abs_mean", *(f"adv/{k}" for k in stats)]
        values = torch.stack([masked.sum() / count, masked.abs().sum() / count, *(v.float() for v in stats.values())])
        return dict(zip(names, values.tolist()))

    def drop_zero_advantage(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """FlowGRPO's filter: keep the samples with a non-zero advantage at some token/step, topped up
        with dropped ones (at random) until the kept count divides into the step's number of
        mini-batches, so the number of optimizer steps does not change."""
        adv = rollout.tensors["advantages"]
        nonzero = adv.ne(0) if adv.ndim == 1 else adv.ne(0).any(dim=-1)  # [N]
        num_mini = self._num_mini_batches()
        count = int(nonzero.sum())
        target = count + (-count % num_mini)
        if target == 0 and sum_over_processes(self.accelerator, count) > 0:
            target = num_mini  # other processes train: this one must take part in every optimizer step
        if target > count:
            dropped = (~nonzero).nonzero().squeeze(-1)
            generator = torch.Generator().manual_seed(self.cfg.seed * 6_151 + self.step)
            nonzero[dropped[torch.randperm(len(dropped), generator=generator)[: target - count]]] = True
        kept = nonzero.nonzero().squeeze(-1)
        total, kept_total = sum_over_processes(self.accelerator, len(rollout)), sum_over_processes(self.accelerator, len(kept))
        metrics = {"adv/dropped_frac": 1.0 - kept_total / total, "adv/kept": float(kept_total)}
        return rollout.select(kept), metrics

    def _num_mini_batches(self) -> int:
        return self.cfg.prompts_per_step * self.cfg.group_size // self.cfg.mini_batch_size

    def _on_policy(self) -> bool:
        """Whether every forward of the update sees the weights that the old log-probs belong to: one
        mini-batch and one epoch, so the only optimizer step comes after all of them."""
        return self.cfg.ppo_epochs == 1 and self._num_mini_batches() == 1

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
        if self.env.recompute_old_logprobs:
            if self._on_policy():
                rollout.tensors.pop("old_logp", None)  # a stale copy would be used instead of the first forward's
            else:
                rollout.tensors["old_logp"] = self._evaluate_all(model, rollout)["logp"]
                metrics.update(self._rollout_metrics(rollout))
        if self.algo.kl_coef > 0:
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
        return {k: _scatter_rows([(idx, out[k]) for idx, out in parts], len(rollout)) for k in parts[0][1]}

    def _micro_batches(self, batch: Rollout) -> list[torch.Tensor]:
        """The micro-batches of ``batch`` as index tensors.

        ``trainer.micro_batch_tokens`` unset: ``micro_batch_size`` samples each, in order. Set: verl's
        dynamic batch size for padded batches: samples sorted by ``env.sample_tokens`` (longest
        first) and packed while the micro-batch's sample count x its longest sample stays within
        the budget (a longer sample goes alone); each micro-batch is then padded only to its own
        longest (``env.trim_padding``). With several processes every one runs as many micro-batches
        as the busiest (split further where it has the samples), as FSDP's collective forwards need."""
        budget = self.cfg.micro_batch_tokens
        if budget is None:
            return list(torch.arange(len(batch)).split(self.cfg.micro_batch_size))
        lengths = self.env.sample_tokens(batch)  # [n]
        order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
        chunks: list[list[int]] = []
        for i in order:
            if chunks and (len(chunks[-1]) + 1) * int(lengths[chunks[-1][0]]) <= budget:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        if self.accelerator.num_processes > 1:
            count = torch.tensor([len(chunks)], device=self.accelerator.device)
            target = min(int(self.accelerator.reduce(count, reduction="max")), len(batch))
            while len(chunks) < target:  # halve the largest chunk: its cost can only go down
                largest = max(range(len(chunks)), key=lambda c: len(chunks[c]))
                chunk = chunks.pop(largest)
                chunks[largest:largest] = [chunk[: len(chunk) // 2], chunk[len(chunk) // 2:]]
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
        first_forward = "old_logp" not in rollout.tensors
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
            rollout.tensors["old_logp"] = _scatter_rows(recorded, len(rollout))
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

        Without ``old_logp`` in ``micro`` (on-policy) this forward's detached log-probs are the old ones."""
        algo, device = self.algo, self.accelerator.device
        cur = self.env.evaluate(model, micro, columns)
        mask = cur["mask"]  # [n, T'], or None: every position trained
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
            weights = truncated_importance_weights(old_logp, engine_logp, cap=algo.tis_cap)
        agg = dict(denominator=denominator, seq_lengths=seq_lengths)
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
        if algo.entropy_coef > 0 and "entropy" in cur:
            entropy = aggregate(cur["entropy"], mask, algo.loss_agg, **agg)
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

    def evaluate(self) -> dict[str, float]:
        start = time.perf_counter()
        out = self.env.evaluation(self.step, self.run_dir)
        if out:
            out["time/eval"] = time.perf_counter() - start
        if self.cfg.log_with and self.accelerator.is_main_process:
            self._log_media(self.env.evaluation_media())
        return out

    def _log_media(self, media: dict) -> None:
        """The evaluation's images and tables to the trackers (metrics.jsonl keeps only numbers)."""
        import numpy as np

        for tracker in self.accelerator.trackers:
            for key, image in media.get("images", {}).items():
                if tracker.name == "tensorboard":  # add_images takes a batch: [1, H, W, 3]
                    tracker.log_images({key: np.asarray(image.convert("RGB"))[None]}, step=self.step,
                                       dataformats="NHWC")
                else:
                    tracker.log_images({key: [image]}, step=self.step)
            for key, (columns, rows) in media.get("tables", {}).items():
                if tracker.name == "wandb":
                    tracker.log_table(key, columns=columns, data=rows, step=self.step)
                elif tracker.name == "tensorboard":  # no tables there: one markdown table as text
                    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                    lines += ["| " + " | ".join(str(v).replace("|", "/").replace("\n", " ") for v in row) + " |"
                              for row in rows]
                    tracker.writer.add_text(key, "\n".join(lines), global_step=self.step)

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

    # ============================================================ logging
    def _log(self, metrics: dict[str, float], history) -> None:
        if not self.accelerator.is_main_process or len(metrics) <= 1:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.cfg.log_with:
            self.accelerator.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    # ========================================================= checkpoints
    def save_checkpoint(self) -> Path:
        """``checkpoints/step_N/``: the policy (``save_pretrained``) and ``trainer_state/`` (optimizer,
        scheduler, RNG, loop step). Written to a temporary name and renamed, so a crash never leaves
        a half checkpoint that ``resume`` would pick."""
        acc = self.accelerator
        root = self.run_dir / "checkpoints"
        final = root / f"step_{self.step:06d}"
        tmp = root / f".tmp_step_{self.step:06d}"
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()  # the directory exists before any process writes into it
        self.env.save_pretrained(tmp)  # every process: FSDP gathers the full weights collectively
        acc.save_state(str(tmp / "trainer_state"))
        if acc.is_main_process:
            (tmp / "trainer_state" / "loop.json").write_text(
                json.dumps({"step": self.step, "optimizer_steps": self.optimizer_steps}))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._prune(root)
        acc.wait_for_everyone()
        return final

    def _prune(self, root: Path) -> None:
        keep = self.cfg.keep_checkpoints
        steps = sorted(root.glob("step_*"))
        if keep is not None:
            for old in steps[:-keep]:
                shutil.rmtree(old, ignore_errors=True)

    def _resume(self) -> None:
        steps = sorted((self.run_dir / "checkpoints").glob("step_*"))
        if not steps:
            self.accelerator.print(f"resume: no checkpoint in {self.run_dir / 'checkpoints'}; starting at step 0")
            return
        latest = steps[-1]
        self.accelerator.load_state(str(latest / "trainer_state"))
        state = json.loads((latest / "trainer_state" / "loop.json").read_text())
        self.step, self.optimizer_steps = state["step"], state["optimizer_steps"]
        if self.accelerator.is_main_process:
            for name in ("metrics.jsonl", "eval_samples.jsonl"):
                _drop_rows_after(self.run_dir / name, self.step)
        self.accelerator.wait_for_everyone()
        self.accelerator.print(f"resumed from {latest} (step {self.step})")


# ================================================================ helpers
def _scatter_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> torch.Tensor:
    """Rows ``[k, T_k, ...]`` of sub-batches (given as index tensors into n samples) put back in
    sample order: ``[n, max T_k, ...]``, narrower parts right-padded with zeros (micro-batches
    trimmed to their own longest sample). 1-D parts ``[k]`` give ``[n]``."""
    first = parts[0][1]
    shape = [n] + [max(v.shape[d] for _, v in parts) for d in range(1, first.ndim)]
    out = first.new_zeros(shape)
    for idx, v in parts:
        if v.ndim >= 2:
            out[idx, : v.shape[1]] = v
        else:
            out[idx] = v
    return out


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


def _restore_signal_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite a JSONL log without the rows of steps after ``step`` (logged after the checkpoint a
    run resumes from), so that every step appears once. Written to a temporary file and renamed."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


@contextlib.contextmanager
def _timer(times: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start


def _progress(cfg: TrainerConfig, start: int, main: bool):
    """One line: steps done, elapsed and time left (tqdm's estimate), reward, KL when it is on."""
    if not (cfg.progress and main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.total_steps, initial=start, desc="train", unit="step", dynamic_ncols=True, leave=True)


def _progress_fields(metrics: dict[str, float]) -> dict[str, str]:
    fields = {"reward": f"{metrics['reward/mean']:.3f}"}
    if "loss/kl" in metrics:
        fields["kl"] = f"{metrics['loss/kl']:.2e}"
    return fields


def _write_yaml(path: Path, data: dict) -> None:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out
