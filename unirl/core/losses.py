"""Policy-gradient losses over per-token (or per-denoising-step) log-probs.

Legend: B prompts, G group size, N = B*G samples, T tokens (text) or denoising steps (diffusion).
Every function takes tensors and returns tensors: no config objects, no ``.item()``, no I/O. Losses
return ``(loss, metrics)`` where metrics are detached tensors; the caller decides when to sync.

Masks are boolean (or 0/1) [N, T]. Masked positions never reach a loss, a gradient or a metric: they
are replaced with ``torch.where`` (not multiplied by 0), so finite junk there changes nothing. The
loss functions (``aggregate``, ``clipped_policy_loss``, ``policy_loss_metrics``) also take
``mask=None``: every position counts (diffusion trains every stored step), with the results of an
all-True mask (tested bit for bit) and without the masking operations.

Loss aggregation (``aggregate``) uses verl's mode names. TRL's ``GRPOConfig.loss_type`` maps to them:

* ``grpo``    ~ ``seq-mean-token-mean``: mean over each sequence's tokens, then over sequences
  (DeepSeekMath, https://arxiv.org/abs/2402.03300).
* ``bnpo``    ~ ``token-mean`` over the local batch; ``dapo`` ~ ``token-mean`` normalised by the
  global token count, i.e. pass ``denominator`` (DAPO, https://arxiv.org/abs/2503.14476).
* ``dr_grpo`` ~ ``seq-mean-token-sum-norm``: token sums divided by a constant, (number of sequences)
  x ``norm_length``, so long answers are not down-weighted (Dr. GRPO,
  https://arxiv.org/abs/2503.20783). TRL divides by ``batch size x max_completion_length``: pass
  ``norm_length=max_completion_length`` (the text environment passes ``rollout.max_new_tokens``) so
  the normaliser does not change with the longest response of a step. Without it T =
  ``mask.shape[-1]`` is used, which is that constant only when responses are padded to it. (verl's
  ``agg_loss`` divides the token sums by T alone and scales per micro-batch; the normaliser here is
  TRL's.)

GSPO (``level="sequence"``) aggregates with ``seq-mean-token-mean`` only, as verl hard-codes for it;
another mode would weight sequences by their length and is refused.
"""

from __future__ import annotations

import math

import torch

from unirl.core.rollout_correction import rollout_is_weights

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LEVELS = ("token", "sequence")
#: verl's clamp of GSPO's sequence log-ratio (``compute_policy_loss_gspo``).
GSPO_LOG_RATIO_MAX = 10.0


def bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    return mask if mask is None or mask.dtype == torch.bool else mask != 0


def masked(mask: torch.Tensor | None, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``values`` where the boolean ``mask`` is set and ``fill`` elsewhere; ``values`` itself when
    ``mask`` is None (every position counts)."""
    return values if mask is None else torch.where(mask, values, fill)


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise unless the given tensors (None ones skipped: an absent mask) have one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{', '.join(shapes)} must have the same shape, got {listed}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set, over ``dim`` (all dims when None).

    A slice with no masked-in element gives 0 (not NaN).

    Args:
        values: [...] e.g. [N, T].
        mask: boolean or 0/1, same shape as ``values``.
        dim: dim(s) to reduce.
    """
    check_same_shape(values=values, mask=mask)
    mask = bool_mask(mask)
    total = torch.where(mask, values, 0.0)
    if dim is None:
        return total.sum() / mask.sum().clamp_min(1)
    return total.sum(dim) / mask.sum(dim).clamp_min(1)


def aggregate_denominator(mask: torch.Tensor, mode: str, *, norm_length: int | None = None) -> torch.Tensor:
    """The normaliser ``aggregate`` divides by, computed for a whole mini-batch.

    * ``token-mean``: number of masked-in tokens.
    * ``seq-mean-token-mean`` and ``seq-mean-token-sum``: number of sequences with at least one
      masked-in token (fully masked rows, e.g. padding rows, are not counted).
    * ``seq-mean-token-sum-norm``: that sequence count times ``norm_length`` (Dr. GRPO's constant,
      TRL's ``max_completion_length``), or times T = ``mask.shape[-1]`` when ``norm_length`` is None.

    Clamped to at least 1, so an all-masked batch aggregates to 0 rather than NaN.

    Args:
        mask: [N, T] boolean or 0/1 mask of the full mini-batch.
        mode: one of ``AGG_MODES``.
        norm_length: the constant length of ``seq-mean-token-sum-norm``; ignored by other modes.

    Returns:
        0-dim integer tensor.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, AGG_MODES))}, got {mode!r}")
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D [N, T], got shape {tuple(mask.shape)}")
    mask = bool_mask(mask)
    if mode == "token-mean":
        return mask.sum().clamp_min(1)
    num_seqs = mask.any(dim=-1).sum()
    if mode == "seq-mean-token-sum-norm":
        if norm_length is not None and not norm_length >= 1:
            raise ValueError(f"norm_length must be a positive length or None, got {norm_length!r}")
        return (num_seqs * (mask.shape[-1] if norm_length is None else int(norm_length))).clamp_min(1)
    return num_seqs.clamp_min(1)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor | None,
    mode: str,
    *,
    denominator: torch.Tensor | float | None = None,
    norm_length: int | None = None,
    seq_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [N, T] to a scalar (verl's ``agg_loss`` modes).

    ``aggregate = numerator / denominator`` with

    * ``token-mean``: sum of all masked-in values / number of masked-in tokens.
    * ``seq-mean-token-mean``: sum over sequences of each sequence's token mean / number of sequences.
    * ``seq-mean-token-sum``: sum over sequences of each sequence's token sum / number of sequences.
    * ``seq-mean-token-sum-norm``: the same sums / (number of sequences x ``norm_length``), by
      default ``norm_length`` = T = ``mask.shape[-1]`` (Dr. GRPO).

    Sequences count only if they have at least one masked-in token. See ``aggregate_denominator``.

    Gradient accumulation: when ``values`` is one micro-batch of a larger mini-batch, pass
    ``denominator=aggregate_denominator(mini_batch_mask, mode)``; the micro-batch losses then sum to
    exactly the mini-batch's ``aggregate`` (and their gradients to its gradient). When ``values`` is a
    slice of the columns (e.g. one denoising step at a time), also pass ``seq_lengths``, each
    whole sequence's masked-in count, so ``seq-mean-token-mean`` divides by it: the slices' losses
    then add up to the whole's too.

    Args:
        values: [N, T] per-token values.
        mask: [N, T] boolean or 0/1, or None: every position counts.
        mode: one of ``AGG_MODES``.
        denominator: normaliser of the full mini-batch; default this batch's own.
        norm_length: see ``aggregate_denominator`` (used only when ``denominator`` is None).
        seq_lengths: [N] masked-in tokens of each whole sequence (column slices); default the row
            sums of ``mask`` (T without one).

    Returns:
        0-dim tensor.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, AGG_MODES))}, got {mode!r}")
    if values.ndim != 2:
        raise ValueError(f"values must be 2-D [N, T], got shape {tuple(values.shape)}")
    check_same_shape(values=values, mask=mask)
    mask = bool_mask(mask)
    if denominator is None:
        everything = torch.ones_like(values, dtype=torch.bool) if mask is None else mask
        denominator = aggregate_denominator(everything, mode, norm_length=norm_length)
    kept = masked(mask, values)  # [N, T]
    if mode == "token-mean":
        return kept.sum() / denominator
    seq_sums = kept.sum(dim=-1)  # [N]
    if mode == "seq-mean-token-mean":
        if seq_lengths is None and mask is None:  # every sequence has all T positions
            return (seq_sums / max(values.shape[-1], 1)).sum() / denominator
        lengths = mask.sum(dim=-1) if seq_lengths is None else seq_lengths.to(seq_sums.device)  # [N]
        return (seq_sums / lengths.clamp_min(1)).sum() / denominator
    return seq_sums.sum() / denominator


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    level: str = "token",
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
    denominator: torch.Tensor | float | None = None,
    seq_lengths: torch.Tensor | None = None,
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (https://arxiv.org/abs/1707.06347) with its LLM-era variants.

    Per token, with ratio ``r = exp(logp - old_logp)`` and advantage ``A``::

        loss = max(-A * r, -A * clamp(r, 1 - clip_low, 1 + clip_high))

    * Asymmetric bounds: ``clip_high > clip_low`` is DAPO's clip-higher
      (https://arxiv.org/abs/2503.14476), leaving room for low-probability tokens to grow.
    * ``dual_clip=c`` (c > 1): for ``A < 0`` the loss is also capped at ``c * |A|``, so a huge ratio on
      a bad token cannot produce an unbounded loss (dual-clip PPO, https://arxiv.org/abs/1912.09729).
    * ``level="sequence"``: GSPO (https://arxiv.org/abs/2507.18071). The ratio of sequence i is
      ``s_i = exp(mean over its masked tokens of (logp - old_logp))``, applied token-wise as GSPO-token:
      ``r_t = exp(sg[log s_i] + logp_t - sg[logp_t])`` (sg = stop-gradient). Its value is ``s_i`` at
      every token; with ``agg="seq-mean-token-mean"`` (what GSPO uses) and a per-sequence advantage,
      the gradient equals that of the sequence-level objective ``-mean_i min(s_i A_i, clip(s_i) A_i)``.
      Clipping then acts on whole sequences. ``log s_i`` is clamped at 10 as verl does (a sequence past
      it gets ratio e^10 and no gradient). GSPO's paper uses tiny bounds (3e-4 / 4e-4). ``agg`` must
      be ``"seq-mean-token-mean"`` (verl hard-codes it for GSPO; another mode is a ValueError).

    ``weights`` multiply the per-token loss after clipping (detached), e.g. truncated importance
    sampling weights for the rollout/trainer mismatch (``truncated_importance_weights``).

    Args:
        logp: [N, T] log-probs of the sampled tokens under the policy being trained.
        old_logp: [N, T] log-probs under the policy that the advantages refer to (no gradient).
        advantages: [N] (broadcast over T) or [N, T].
        mask: [N, T] boolean or 0/1; False marks prompt/padding positions. None: every position counts.
        clip_low: lower clip range, ratio >= 1 - clip_low; in [0, 1).
        clip_high: upper clip range, ratio <= 1 + clip_high; >= 0.
        dual_clip: None or the dual-clip constant c > 1.
        level: ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO).
        agg: aggregation mode, see ``aggregate``.
        weights: optional [N, T] per-token weights.
        denominator: mini-batch normaliser for gradient accumulation, see ``aggregate``.
        seq_lengths: [N] whole-sequence lengths when the inputs are a column slice (token level
            only), see ``aggregate``.
        with_metrics: False skips the metrics (``{}``): a caller that computes the loss piece by
            piece can compute them once over the whole batch with ``policy_loss_metrics``.

    Returns:
        ``(loss, metrics)``; metrics are detached 0-dim tensors averaged over masked-in tokens:
        ``clip_frac`` (clipping active: ``clip_frac_low`` = ratio below ``1 - clip_low`` with A < 0, plus
        ``clip_frac_high`` = ratio above ``1 + clip_high`` with A > 0), ``approx_kl`` (k3 estimate of
        KL(old || new) from the token log-ratios, ``(r - 1) - log r`` as in CleanRL,
        http://joschu.net/blog/kl-approx.html), ``ratio_mean``, ``ratio_max``, ``ratio_min`` (of the
        ratio used in the loss: the sequence ratio for GSPO), and ``dual_clip_frac`` (A < 0 and
        ratio > c) when ``dual_clip`` is set.
    """
    # 1. Check inputs.
    if logp.ndim != 2:
        raise ValueError(f"logp must be 2-D [N, T], got shape {tuple(logp.shape)}")
    check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be [N] or [N, T] with [N, T] = {tuple(logp.shape)}, "
            f"got advantages {tuple(advantages.shape)}"
        )
    if weights is not None:
        check_same_shape(logp=logp, weights=weights)
    # clip_low in [0, 1), clip_high >= 0 and dual_clip > 1 are checked where the config loads (AlgoConfig).
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(map(repr, LEVELS))}, got {level!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {', '.join(map(repr, AGG_MODES))}, got {agg!r}")
    if level == "sequence" and seq_lengths is not None:
        raise ValueError("level='sequence' (GSPO) needs whole sequences: seq_lengths (a column slice) is not allowed")
    if level == "sequence" and agg != "seq-mean-token-mean":
        raise ValueError(
            f"level='sequence' (GSPO) aggregates with agg='seq-mean-token-mean' (as verl does), got agg={agg!r}"
        )

    # 2. Log-ratios (masked positions are 0, so junk there cannot reach values or gradients).
    mask = bool_mask(mask)
    token_log_ratio, log_ratio = _log_ratios(logp, old_logp, mask, level)  # [N, T] each
    ratio = torch.exp(log_ratio)  # [N, T]

    # 3. Clipped surrogate, then the optional dual clip and weights.
    adv = _masked_advantages(advantages, mask)  # [N, T] ([N, 1] for per-sample advantages without a mask)
    neg_adv = -adv  # [N, T]
    unclipped = neg_adv * ratio  # [N, T]
    clipped = neg_adv * ratio.clamp(1 - clip_low, 1 + clip_high)  # [N, T]
    per_token = torch.maximum(unclipped, clipped)  # [N, T]
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, neg_adv * dual_clip), per_token)  # [N, T]
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, agg, denominator=denominator, seq_lengths=seq_lengths)
    if not with_metrics:
        return loss, {}
    return loss, _ratio_metrics(ratio.detach(), token_log_ratio.detach(), adv, mask, clip_low, clip_high, dual_clip)


def policy_loss_metrics(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    level: str = "token",
) -> dict[str, torch.Tensor]:
    """The metrics ``clipped_policy_loss`` returns, from the same inputs, without the loss.

    For a loss computed in pieces (``with_metrics=False`` on column slices) this gives the metrics of
    the whole batch at once, as ``clipped_policy_loss`` would on the whole batch: one set of small
    reductions (and, on an accelerator, one later host sync) instead of one per piece.

    Args: as ``clipped_policy_loss``; ``logp`` is detached here.

    Returns:
        detached 0-dim tensors, see ``clipped_policy_loss``.
    """
    check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(map(repr, LEVELS))}, got {level!r}")
    with torch.no_grad():
        mask = bool_mask(mask)
        token_log_ratio, log_ratio = _log_ratios(logp.detach(), old_logp, mask, level)
        adv = _masked_advantages(advantages, mask)
        return _ratio_metrics(torch.exp(log_ratio), token_log_ratio, adv, mask, clip_low, clip_high, dual_clip)


def _log_ratios(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor | None, level: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_log_ratio, log_ratio)`` [N, T]: ``logp - old_logp`` (0 where masked out) and the
    log-ratio the loss uses (the same at token level; GSPO's sequence log-ratio at every token)."""
    if level == "token":
        # Masked after the difference (one where instead of one per input): 0 there in value and in
        # gradient (where's backward sends 0 to the masked positions) whatever junk either side holds.
        token_log_ratio = masked(mask, logp - _detached(old_logp))  # [N, T]
        return token_log_ratio, token_log_ratio
    if mask is None:  # GSPO's sequence means need the counts: an all-True mask
        mask = torch.ones_like(logp, dtype=torch.bool)
    logp = torch.where(mask, logp, 0.0)  # [N, T]: GSPO uses the masked log-probs themselves below
    old_logp = torch.where(mask, old_logp.detach(), 0.0)  # [N, T]
    token_log_ratio = logp - old_logp  # [N, T]
    seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1)  # [N]
    # GSPO-token: value log s_i at every token, gradient d logp_t; clamped above at verl's 10 for
    # numerical safety (a sequence past it has ratio e^10 = 22,026 and, as in verl, no gradient).
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logp - logp.detach()  # [N, T]
    return token_log_ratio, log_ratio.clamp(max=GSPO_LOG_RATIO_MAX)


def _masked_advantages(advantages: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Advantages [N] or [N, T] as a detached [N, T], 0 where masked out; without a mask per-sample
    ones stay a [N, 1] column (the operations they meet broadcast it)."""
    adv = _detached(advantages)
    return masked(mask, adv.unsqueeze(-1) if adv.ndim == 1 else adv)  # [N, T]: where broadcasts [N, 1]


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without gradient: ``t.detach()`` only when it has one (the loss's inputs other than
    ``logp`` usually have none; a detach is an operation, a few a piece)."""
    return t.detach() if t.requires_grad else t


@torch.no_grad()
def _ratio_metrics(r: torch.Tensor, token_log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor | None,
                   clip_low: float, clip_high: float, dual_clip: float | None) -> dict[str, torch.Tensor]:
    """Detached metrics over masked-in tokens from the ratio ``r`` the loss used, see ``clipped_policy_loss``
    (all [N, T] but ``adv``, which may be a [N, 1] column; ``mask`` boolean or None, as its callers made them)."""
    low = (r < 1 - clip_low) & (adv < 0)  # [N, T]
    high = (r > 1 + clip_high) & (adv > 0)  # [N, T]
    names = ["clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean"]
    values = [low | high, low, high,
              torch.expm1(token_log_ratio) - token_log_ratio,  # CleanRL's approx_kl: (r - 1) - log r, the k3 estimator of KL(old || new)
              r]
    if dual_clip is not None:
        names.append("dual_clip_frac")
        values.append((adv < 0) & (r > dual_clip))
    # The masked means of all of them in one pass (masked_mean's formula over a stack), not one each.
    stacked = torch.stack([v.to(r.dtype) for v in values])  # [K, N, T]
    count = mask.sum().clamp_min(1) if mask is not None else max(r.numel(), 1)
    means = masked(mask, stacked).sum(dim=(1, 2)) / count  # [K]
    metrics = dict(zip(names, means.unbind()))
    metrics["ratio_max"] = masked(mask, r, -math.inf).amax()
    metrics["ratio_min"] = masked(mask, r, math.inf).amin()
    return metrics


def truncated_importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cap: float = 2.0,
) -> torch.Tensor:
    """Truncated importance sampling weights ``min(exp(old_logp - rollout_logp), cap)``, detached.

    The rollout engine (vLLM, different kernels/precision) samples from a slightly different
    distribution than the trainer computes; reweighting the per-token loss by the truncated ratio
    trainer/rollout corrects for it without the variance of untruncated weights (TIS: Yao et al.
    2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
    https://fengyao.notion.site/off-policy-rl). Computed as ``exp(min(d, log cap))`` so no ``exp``
    overflows. Pass the result as ``weights`` to ``clipped_policy_loss``. The ``token_truncate`` mode of
    ``unirl.core.rollout_correction.rollout_is_weights``, which has the others.

    Args:
        old_logp: [N, T] trainer log-probs of the sampled tokens (the "old" policy).
        rollout_logp: [N, T] log-probs reported by the rollout engine.
        cap: truncation C > 0.

    Returns:
        [N, T] weights in (0, cap], no gradient.
    """
    check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp)
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    return rollout_is_weights(old_logp, rollout_logp, None, mode="token_truncate", high=cap)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dim, ``-sum p log p``.

    Uses ``log_softmax`` (a logsumexp) so large logits do not overflow, and treats ``0 * log 0`` as 0
    so ``-inf`` logits (masked vocabulary) are allowed. Half-precision logits are upcast: the math and
    the result are float32 (float64 stays float64).

    Args:
        logits: [..., V], e.g. [N, T, V].

    Returns:
        [...] entropies, e.g. [N, T].
    """
    if logits.ndim < 1:
        raise ValueError(f"logits must have a vocabulary dim [..., V], got shape {tuple(logits.shape)}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)  # [..., V]
    p = logp.exp()  # [..., V]
    # 0 * log 0 := 0; replacing log p (not the product) keeps -inf out of the backward pass too.
    logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * logp).sum(dim=-1)
