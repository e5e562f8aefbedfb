"""Rollout correction: the rollout engine (vLLM: other kernels, other precision) samples from a
slightly different distribution than the trainer computes, so the trainer's policy gradient is off
policy by that gap. Importance weights ``rho_t = pi_old(a_t) / pi_rollout(a_t)`` correct it, bounded
so their variance stays small.

Legend: N samples, T tokens. Pure functions over tensors: no config, no ``.item()``, no I/O.

The four modes are TRL's ``vllm_importance_sampling_mode`` (``GRPOConfig``; default
``sequence_mask``), which verl's ``algorithm.rollout_correction`` also offers (``rollout_is`` token /
sequence, ``rollout_rs`` masks), with bounds ``[low, high]`` (TRL's ``vllm_importance_sampling_clip_min``
/ ``_max``):

* ``token_truncate``: ``w_t = clamp(rho_t, low, high)`` (TIS, Yao et al. 2025,
  https://fengyao.notion.site/off-policy-rl; verl's ``rollout_is="token"`` has no lower bound).
* ``token_mask``: ``w_t = rho_t`` where ``low <= rho_t <= high``, else 0 (masked IS: the token is
  rejected, not clipped).
* ``sequence_truncate``: ``w_i = clamp(prod_t rho_t, low, high)`` at every token of sequence i
  (verl's Seq-TIS, ``rollout_is="sequence"``).
* ``sequence_mask``: ``w_i = prod_t rho_t`` where within the bounds, else 0: the whole sequence is
  rejected (Seq-MIS).

The bounds act on the ratio ``rho = pi_old / pi_rollout`` itself in every mode, as TRL's modes and verl's
IcePop (``rollout_is`` token/sequence with a ``"lower_upper"`` ``rollout_is_threshold``) do. verl's
rejection options ``token_k1`` / ``seq_sum_k1`` (``rollout_rs``; its Seq-MIS preset ``decoupled_seq_is_rs``
uses ``seq_sum_k1``) bound ``-log rho``, i.e. the *inverse* ratio: its ``rollout_rs_threshold: "a_b"``
keeps ``a <= 1/prod rho <= b``, which is ``low = 1/b``, ``high = 1/a`` here. For its symmetric default
(``"0.5_2.0"``, or one number b: ``1/b_b``) the two are the same set; ``tests/test_rollout_correction.py``
pins the convention against verl's ``seq_sum_k1`` re-typed.

The product is taken as ``exp(sum_t log rho_t)`` over the masked-in tokens, and bounds are compared in
log space, so nothing overflows. The weights multiply the per-token policy loss (detached), as both
references do; rejected tokens still count in the loss's normaliser, as in TRL.
"""

from __future__ import annotations

import math

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def rollout_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None, *,
                       mode: str = "token_truncate", high: float = 2.0, low: float | None = None) -> torch.Tensor:
    """Importance weights [N, T] (detached) for the rollout/trainer mismatch, see the module docstring.

    Args:
        old_logp: [N, T] the trainer's log-probs of the sampled tokens (the "old" policy).
        rollout_logp: [N, T] the rollout engine's log-probs of the same tokens.
        mask: [N, T] boolean or 0/1 (masked-out tokens add nothing to a sequence's product; their own
            weight does not matter, their loss is masked), or None: every token counts.
        mode: one of ``IS_MODES``.
        high: upper bound C_max > 0.
        low: lower bound C_min in (0, high), or None: no lower bound.

    Returns:
        [N, T] weights, no gradient.
    """
    if old_logp.shape != rollout_logp.shape or (mask is not None and mask.shape != old_logp.shape):
        raise ValueError(f"old_logp, rollout_logp and mask must have one shape, got {tuple(old_logp.shape)}, "
                         f"{tuple(rollout_logp.shape)}, {None if mask is None else tuple(mask.shape)}")
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    if not high > 0:
        raise ValueError(f"high must be > 0, got {high!r}")
    if low is not None and not 0 < low < high:
        raise ValueError(f"low must be in (0, high={high}) or None, got {low!r}")
    log_ratio = (old_logp - rollout_logp).detach()  # [N, T]
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # [N, 1]: log of the product over the sequence
    log_low = -math.inf if low is None else math.log(low)
    log_high = math.log(high)
    if mode.endswith("truncate"):
        # exp in the clamped log space (no overflow), clamped again so the bounds are exact.
        weights = torch.exp(log_ratio.clamp(min=log_low, max=log_high)).clamp(min=low or 0.0, max=high)
    else:
        inside = (log_ratio >= log_low) & (log_ratio <= log_high)
        weights = torch.where(inside, torch.exp(log_ratio.clamp(max=log_high)), 0.0)
    return weights.expand_as(old_logp)


def rollout_mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                             weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The engine-vs-trainer mismatch figures of verl's ``compute_offpolicy_metrics``, detached 0-dim:

    * ``mismatch_kl``: mean over tokens of ``rollout_logp - old_logp``, the direct estimator of
      KL(pi_rollout || pi_old).
    * ``mismatch_k3_kl``: mean over tokens of ``rho - log rho - 1``, its k3 estimator (>= 0).
    * ``training_ppl`` / ``rollout_ppl``: mean over sequences of ``exp(-mean_t logp)``.
    * ``ppl_ratio``: mean over sequences of ``exp(mean_t rollout_logp - mean_t old_logp)``, the
      trainer's perplexity over the engine's.

    With ``weights`` (from ``rollout_is_weights``) also ``is_mean`` (mean weight over tokens) and
    ``is_zero_frac`` (the share of tokens the mask modes rejected). Sequences without a masked-in
    token are left out of the sequence means.

    Args:
        old_logp, rollout_logp: [N, T].
        mask: [N, T] boolean or 0/1.
        weights: optional [N, T].
    """
    mask = mask.bool()
    old, rollout = old_logp.detach(), rollout_logp.detach()
    count = mask.sum().clamp_min(1)
    log_ratio = torch.where(mask, old - rollout, 0.0)  # [N, T] log rho
    lengths = mask.sum(dim=-1)  # [N]
    has = lengths > 0  # [N]
    seqs = has.sum().clamp_min(1)
    mean_old = torch.where(mask, old, 0.0).sum(-1) / lengths.clamp_min(1)  # [N]
    mean_rollout = torch.where(mask, rollout, 0.0).sum(-1) / lengths.clamp_min(1)  # [N]

    def over_sequences(values: torch.Tensor) -> torch.Tensor:
        return torch.where(has, values, 0.0).sum() / seqs

    out = {
        "mismatch_kl": -log_ratio.sum() / count,
        "mismatch_k3_kl": torch.where(mask, torch.expm1(log_ratio) - log_ratio, 0.0).sum() / count,
        "training_ppl": over_sequences(torch.exp(-mean_old)),
        "rollout_ppl": over_sequences(torch.exp(-mean_rollout)),
        "ppl_ratio": over_sequences(torch.exp(mean_rollout - mean_old)),
    }
    if weights is not None:
        out["is_mean"] = torch.where(mask, weights, 0.0).sum() / count
        out["is_zero_frac"] = (mask & (weights == 0)).sum() / count
    return out
