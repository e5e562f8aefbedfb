"""The policy update: ``ppo_epochs`` passes of mini-batch optimizer steps, micro-batches accumulating
gradients, each micro-batch's forward and backward run piece by piece over the environment's column
slices (diffusion: one trained step at a time), with the configured policy loss
(``unirl.core.policy_losses``) plus the KL to the reference and the entropy bonus.

Each micro-batch's loss is its share of the *global* mini-batch loss (the normaliser is summed over
processes), so micro-batch and process shares add up to the loss of the whole global mini-batch; DDP
averages gradients over processes, so the backward pass scales by their number. Logged ``loss/*`` (and
``actor/entropy``) are global mini-batch values (mean over mini-batches), other ``actor/*`` means over
micro-batches and processes (``*_max`` / ``*_min``: the extremes).

Shapes: n samples of a micro-batch, T columns (tokens or trained steps), T' those of one piece.
"""

from __future__ import annotations

import contextlib

import torch

from unirl.core import aggregate, aggregate_denominator, policy_loss_metrics, rollout_is_weights
from unirl.core.policy_losses import LossInputs, LossSettings, build_loss_args
from unirl.config.schema import AlgoConfig
from unirl.env import Environment, Rollout
from unirl.trainer.context import RunState, StepContext
from unirl.trainer.metrics import MetricLog, reduce_over_processes
from unirl.trainer.micro_batches import scatter_rows


def run_policy_loss(env: Environment, algo: AlgoConfig) -> str:
    """The registered policy loss of a run: ``algo.policy_loss`` when set (checked where the config loads),
    else the environment's rollout mode's (DiffusionNFT: ``nft``), else the ratio loss at ``algo.level``
    (``clipped`` per token, ``gspo`` per sequence)."""
    return algo.policy_loss or env.actions.policy_loss or ("gspo" if algo.level == "sequence" else "clipped")


def loss_settings(name: str | None, algo: AlgoConfig) -> LossSettings:
    """The numbers the policy loss ``name`` reads: ``algo``'s shared clip range and aggregation, and
    ``algo.loss_args`` as the loss's own settings (``unirl.core.policy_losses.build_loss_args``)."""
    return LossSettings(clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                        loss_agg=algo.loss_agg, args=None if name is None else build_loss_args(name, algo.loss_args))


def update(ctx: StepContext, state: RunState, rollout: Rollout) -> dict[str, float]:
    """``ppo_epochs`` passes of mini-batch steps over ``rollout`` (module docstring).

    Without ``old_logp`` in the rollout (on-policy, see ``unirl.trainer.logprobs``) each micro-batch's
    first forward gives its old log-probs (detached: ratio 1, the gradient of the ratio is that of the
    log-prob); they are stored in ``rollout.old_logp`` afterwards and the ``rollout/*`` figures (and TIS
    weights) come from them. In bypass mode (``source.bypass_mode``) the ratio is taken against the engine's
    log-probs instead, and the trainer's own still give the ``rollout/*`` figures."""
    from unirl.trainer.logprobs import rollout_metrics

    model = ctx.env.model
    log = MetricLog()
    if len(rollout) == 0:  # every sample dropped (algo.drop_zero_adv): nothing to learn from
        return {}
    # The first forward's log-probs are the old ones on-policy (a loss that reads no log-probs has none).
    first_forward = ctx.policy_loss.reads_logprobs and rollout.old_logp is None
    if first_forward and not ctx.on_policy():
        raise RuntimeError("update: the rollout has no old_logp; run the old_logprobs stage first (the update's first "
                           "forward gives them only on-policy: one mini-batch, trainer.ppo_epochs=1)")
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rollout rows, their first-forward log-probs)
    # As many mini-batches as B*G / mini_batch_size (fewer samples when zero advantages were dropped).
    num_mini = ctx.num_mini_batches()
    mini_size = -(-len(rollout) // num_mini)
    # The shuffle's generator, seeded by the step (only several mini-batches are shuffled).
    generator = torch.Generator().manual_seed(ctx.cfg.seed * 7919 + state.step) if num_mini > 1 else None
    # train() walks every submodule (0.5 ms a step for the tiny SD3 with LoRA), so it runs only when the model
    # is not in training mode: an environment that samples in eval mode switches back (the HF engine does).
    if not model.training:
        model.train()
    for _ in range(ctx.cfg.ppo_epochs):
        # A single mini-batch is the whole rollout in any order (its loss is a sum over samples):
        # it is taken as it is, without a shuffled copy of every stored tensor.
        order = torch.randperm(len(rollout), generator=generator) if num_mini > 1 else torch.arange(len(rollout))
        for mini_idx in order.split(mini_size):
            mini_batch = rollout.select(mini_idx)
            # The global mini-batch's normaliser, so micro and process shares add up to its loss.
            denominator = mini_denominator(ctx, mini_batch)
            micro_chunks = ctx.micro_batches(mini_batch)
            mini = MetricLog()
            for k, micro_idx in enumerate(micro_chunks):
                micro = ctx.env.actions.trim_padding(mini_batch.select(micro_idx))
                first_logp = [] if first_forward else None
                mini.add(micro_backward(ctx, model, micro, denominator, sync=k == len(micro_chunks) - 1,
                                        first_logp=first_logp))
                if first_forward:
                    recorded.append((mini_idx[micro_idx], first_logp[0]))
            log.add(mini.result(sum_shares=True))
            log.add({"actor/grad_norm": optimizer_step(ctx, state)})
    out = reduce_over_processes(ctx.accelerator, log.result(sum_shares=False))
    out["actor/lr"] = ctx.scheduler.get_last_lr()[0]
    if first_forward:
        rollout.old_logp = scatter_rows(recorded, len(rollout), ctx.env.actions.loss_mask(rollout).shape[1])
        out.update(rollout_metrics(ctx, rollout))
    return out


def micro_backward(ctx: StepContext, model, micro: Rollout, denominator: torch.Tensor, sync: bool,
                   first_logp: list | None = None) -> dict[str, float]:
    """Forward and backward of one micro-batch, piece by piece over the environment's column slices
    (diffusion: one trained step at a time, as FlowGRPO runs backward per step), so only one piece's
    graph is alive at a time; the pieces' losses add up to the micro-batch's. DDP synchronises
    gradients in the last backward of the mini-batch (``sync``).

    The ratio figures (``actor/clip_frac`` ...) are computed once over the whole micro-batch from the
    pieces' detached log-probs, and every figure reaches the host in one transfer at the end (not one
    per figure and piece: each is a device sync on an accelerator).

    ``first_logp``: when the micro-batch has no ``old_logp``, the detached log-probs [n, T] of this
    forward (used as the old ones) are appended to it."""
    backend, algo, policy_loss = ctx.backend, ctx.algo, ctx.policy_loss
    pieces = [slice(None)] if policy_loss.whole_sequences else ctx.env.actions.column_slices(micro)
    seq_lengths = None
    if len(pieces) > 1 and algo.loss_agg == "seq-mean-token-mean":  # it divides by each whole sequence's length
        seq_lengths = ctx.env.actions.loss_mask(micro).to(backend.device).sum(dim=-1)
    hold_back = backend.holds_back(model)  # gradient sync deferred to the last piece
    shares: dict[str, list[torch.Tensor]] = {}  # loss/* and actor/entropy of each piece (they add up)
    parts: dict[str, list[torch.Tensor]] = {}  # logp, old_logp, advantages, mask of each piece, [n, T']
    for k, columns in enumerate(pieces):
        last = sync and k == len(pieces) - 1
        # One process (without FSDP2's sharded gradients) holds nothing back, and accelerate's
        # no_sync costs ~0.1 ms a piece.
        with backend.hold_gradients(model) if not last and hold_back else contextlib.nullcontext():
            loss, piece_shares, piece_parts = micro_loss(ctx, model, micro, denominator, columns, seq_lengths)
            backend.backward(loss)  # scaled back up for DDP's average over processes
            # The piece's autograd graph goes now, while backward has just walked it (its nodes are
            # in cache), not when the next piece's loss replaces it after a whole forward: 1 ms a
            # tiny SD3 step, measured paired (benchmarks/diffusion_step_split.py --against).
            del loss
        for name, value in piece_shares.items():
            shares.setdefault(name, []).append(value)
        for name, value in piece_parts.items():
            parts.setdefault(name, []).append(value)
    if not parts:  # a loss that reads no log-probs: no ratio figures
        return on_host(shares)
    # [n, T] each; the mask None (every position trained) when the pieces have none.
    whole = {name: values[0] if len(values) == 1 or values[0] is None else torch.cat(values, dim=1)
             for name, values in parts.items()}
    if first_logp is not None:  # this forward's own log-probs (the anchor is the engine's in bypass mode)
        first_logp.append(whole["logp"].cpu())
    ratio = policy_loss_metrics(whole["logp"], whole["old_logp"], whole["advantages"], whole["mask"],
                                clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                                level=policy_loss.level)
    return on_host({**shares, **{f"actor/{name}": [value] for name, value in ratio.items()}})


def mini_denominator(ctx: StepContext, mini: Rollout) -> torch.Tensor:
    """The aggregation's normaliser of the global mini-batch (summed over processes)."""
    return global_denominator(ctx.accelerator, ctx.env, mini, ctx.algo.loss_agg)


def global_denominator(acc, env, mini: Rollout, loss_agg: str) -> torch.Tensor:
    """``loss_agg``'s normaliser of ``mini`` summed over processes: the actor's and the critic's losses
    share it, so micro-batch and process shares add up to the global mini-batch's loss."""
    local = aggregate_denominator(env.actions.loss_mask(mini).to(acc.device), loss_agg, norm_length=env.actions.loss_norm_length)
    if acc.num_processes == 1:
        return local
    return acc.reduce(local.reshape(1), reduction="sum").reshape(()).clamp_min(1)


def micro_loss(ctx: StepContext, model, micro: Rollout, denominator: torch.Tensor, columns: slice = slice(None),
               seq_lengths: torch.Tensor | None = None):
    """The loss share of one micro-batch (or of the columns ``columns`` of it), its shares of the logged
    losses (detached), and the detached inputs of its ratio figures, each [n, T']: ``logp``,
    ``old_logp``, ``advantages`` and ``mask`` (none for a loss that reads no log-probs).

    Without ``old_logp`` in ``micro`` (on-policy) this forward's detached log-probs are the old ones."""
    algo, device, policy_loss = ctx.algo, ctx.backend.device, ctx.policy_loss
    cur = ctx.env.actions.score_actions(model, micro, columns)
    mask = cur.get("mask")  # [n, T'], or None: every position trained
    agg = dict(denominator=denominator, seq_lengths=seq_lengths)
    inputs, figures_in = _loss_inputs(ctx, micro, cur, columns, device) if policy_loss.reads_logprobs else (
        LossInputs(cur, micro.advantages.to(device)), {})
    inputs.denominator, inputs.seq_lengths = denominator, seq_lengths
    policy, shares = policy_loss.fn(inputs, ctx.loss_settings)
    loss = policy
    if algo.kl_coef > 0:
        ref = {k: v[:, columns].to(device) for k, v in micro.ref.items()}
        kl = aggregate(ctx.env.actions.kl(cur, ref), mask, algo.loss_agg, **agg)
        loss = loss + algo.kl_coef * kl
        shares["loss/kl"] = kl.detach()
    if "entropy" in cur:  # logged whatever entropy_coef (text: from the chunked head, no gradient unless trained)
        entropy = aggregate(cur["entropy"], mask, algo.loss_agg, **agg)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * entropy
        shares["actor/entropy"] = entropy.detach()
    shares["loss/total"] = policy.detach() if loss is policy else loss.detach()
    return loss, shares, figures_in


def _loss_inputs(ctx: StepContext, micro: Rollout, cur: dict, columns: slice, device) -> tuple[LossInputs, dict]:
    """A ratio loss's inputs for the piece ``columns``: the old log-probs (this forward's, detached, when
    the micro-batch has none), the advantages as [n, T'] and the rollout-correction weights."""
    algo = ctx.algo
    mask = cur.get("mask")
    logp = cur["logp"].detach()  # [n, T']
    old_logp = micro.old_logp[:, columns].to(device) if micro.old_logp is not None else logp
    advantages = micro.advantages  # [n] or [n, T]
    if advantages.ndim == 2:
        advantages = advantages[:, columns].to(device)  # [n, T']
    else:  # one per sample: the [n, 1] column made once per micro-batch, not once a piece
        column = micro.cache.get("advantages_column")
        if column is None:
            column = micro.cache["advantages_column"] = advantages.to(device).unsqueeze(-1)  # [n, 1]
        advantages = column if column.shape == logp.shape else column.expand_as(logp)  # [n, T']
    weights = None
    if ctx.bypass_mode:  # the ratio against the behaviour policy: it carries the correction itself
        if micro.engine_logp is None:
            raise ValueError("source.bypass_mode takes the PPO ratio against the rollout engine's log-probs, and this "
                             "rollout has none (Rollout.engine_logp); set source.bypass_mode=false")
        old_logp = micro.engine_logp[:, columns].to(device)
    elif algo.tis_cap is not None and micro.engine_logp is not None:
        engine_logp = micro.engine_logp[:, columns].to(device)
        weights = rollout_is_weights(old_logp, engine_logp, mask, mode=algo.rollout_is, high=algo.tis_cap,
                                     low=algo.rollout_is_min)
    inputs = LossInputs(cur, advantages, old_logp=old_logp, weights=weights)
    return inputs, {"logp": logp, "old_logp": old_logp, "advantages": advantages, "mask": mask}


def optimizer_step(ctx: StepContext, state: RunState) -> float:
    """The policy's optimizer step through the backend (clip, step unless the norm is not finite, schedule,
    zero; ``Backend.clip_and_step``), counted in ``state.optimizer_steps``; returns the gradient norm."""
    grad_norm = ctx.backend.clip_and_step(ctx.env.model, ctx.optimizer, ctx.scheduler, ctx.optim.max_grad_norm,
                                          what=f"step {state.step}")
    state.optimizer_steps += 1
    ctx.env.after_optimizer_step(state.optimizer_steps)
    return grad_norm


def on_host(figures: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Each figure's 0-dim values summed (the pieces' shares of a loss add up), read in one transfer
    (one device sync) and summed in float64 on the host."""
    names = [name for name, values in figures.items() for _ in values]
    host = torch.stack([v if v.ndim == 0 and v.dtype == torch.float32 else v.float().reshape(())
                        for values in figures.values() for v in values]).tolist()
    out: dict[str, float] = {}
    for name, value in zip(names, host):
        out[name] = out.get(name, 0.0) + value
    return out
