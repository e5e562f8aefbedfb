"""Outcome advantages for group-sampled rollouts (one scalar reward per sample).

Shapes use one legend: B prompts, G samples per prompt, N = B*G samples. ``group_ids`` [N] says
which prompt each sample answers; ids are arbitrary integers (not necessarily contiguous, sorted or
equal-sized groups), so a batch that lost some samples to filtering still works.

Every estimator in ``ADVANTAGE_ESTIMATORS`` has the same signature::

    fn(rewards [N], group_ids [N], *, scale="group", eps=1e-6) -> advantages [N]

so a trainer calls ``compute_advantages(name, rewards, group_ids, ...)`` and never branches on the
name. Estimators that have no use for ``scale`` (or ``eps``) accept and ignore it.

Std convention: every std here is the *unbiased* one (Bessel's correction, ``torch.std``'s default),
as GRPO implementations (verl, TRL) use; a group of one sample has std 0 by definition (not NaN) and
gets advantage 0. FlowGRPO's reference code uses numpy's biased std (``np.std``); for a group of G
samples the two differ by the factor sqrt(G / (G - 1)).
"""

from __future__ import annotations

import torch

from unirl.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")

SCALES = ("group", "batch", "none")


def _check(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have the shape of rewards [N]: rewards {tuple(rewards.shape)}, "
            f"group_ids {tuple(group_ids.shape)}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got dtype {rewards.dtype}")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")


def _group_moments(rewards: torch.Tensor, group_ids: torch.Tensor):
    """``inverse`` [N] (group index of each sample) and per-group ``counts``, ``means``, unbiased
    ``stds``, each [num_groups]. Vectorised with ``unique(return_inverse=True)`` + ``index_add``."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)  # [num_groups], [N]
    zeros = rewards.new_zeros(uniq.numel())  # [num_groups]
    counts = zeros.index_add(0, inverse, torch.ones_like(rewards))  # [num_groups]
    means = zeros.index_add(0, inverse, rewards) / counts  # [num_groups]
    sq = zeros.index_add(0, inverse, (rewards - means[inverse]).square())  # [num_groups]
    # Unbiased variance; a group of one has no spread to estimate, so its std is defined as 0.
    var = torch.where(counts > 1, sq / (counts - 1).clamp_min(1), torch.zeros_like(sq))  # [num_groups]
    return inverse, counts, means, var.sqrt()


def _safe_divide(centered: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``centered / scale``, 0 where ``scale`` is 0 (possible only with ``eps=0``): no NaN."""
    return torch.where(scale > 0, centered / torch.where(scale > 0, scale, 1), torch.zeros_like(centered))


def _batch_std(values: torch.Tensor) -> torch.Tensor:
    """Unbiased std of all N values; 0 for N < 2 instead of NaN."""
    if values.numel() < 2:
        return values.new_zeros(())
    return values.std()


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages: subtract the group mean, then optionally divide by a std.

    * ``scale="group"``: ``(r - mean_g) / (std_g + eps)``, GRPO (DeepSeekMath,
      https://arxiv.org/abs/2402.03300).
    * ``scale="batch"``: ``(r - mean_g) / (std(rewards over the whole batch) + eps)``, FlowGRPO's
      ``global_std`` option (https://arxiv.org/abs/2505.05470), which keeps small differences inside
      low-variance groups from being blown up.
    * ``scale="none"``: ``r - mean_g``, Dr. GRPO (https://arxiv.org/abs/2503.20783), which argues the
      per-group std biases learning towards too-easy and too-hard prompts.

    Stds are unbiased (see the module docstring). A group of one sample gets advantage 0.

    Args:
        rewards: [N] floating-point rewards, N = B*G.
        group_ids: [N] integer group (prompt) id of each sample.
        scale: ``"group"``, ``"batch"`` or ``"none"``.
        eps: added to the std before dividing. With ``eps=0`` a zero std gives advantage 0, not NaN.

    Returns:
        advantages [N], same dtype as ``rewards``.
    """
    _check(rewards, group_ids)
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(map(repr, SCALES))}, got {scale!r}")
    inverse, _, means, stds = _group_moments(rewards, group_ids)
    centered = rewards - means[inverse]  # [N]
    if scale == "group":
        return _safe_divide(centered, stds[inverse] + eps)
    if scale == "batch":
        return _safe_divide(centered, _batch_std(rewards) + eps)
    return centered


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO (https://arxiv.org/abs/2402.03300): ``group_advantages`` under the registry contract."""
    return group_advantages(rewards, group_ids, scale=scale, eps=eps)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE leave-one-out: ``r_i - mean of the other samples of its group``.

    Kool et al. 2019 (https://openreview.net/forum?id=r1lgTGL5DE), used for LLMs by Ahmadian et al.
    2024 (https://arxiv.org/abs/2402.14740). Equals ``G / (G - 1) * (r_i - mean_g)`` for a group of
    size G; a group of one has no other sample and gets 0. ``scale`` and ``eps`` are ignored.

    Args:
        rewards: [N] floating-point rewards.
        group_ids: [N] integer group ids.

    Returns:
        advantages [N].
    """
    _check(rewards, group_ids)
    inverse, counts, means, _ = _group_moments(rewards, group_ids)
    # r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_g); zero when n == 1.
    factor = torch.where(counts > 1, counts / (counts - 1).clamp_min(1), torch.zeros_like(counts))  # [num_groups]
    return factor[inverse] * (rewards - means[inverse])


@ADVANTAGE_ESTIMATORS.register("reinforce++-baseline")
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++ with a group baseline (https://arxiv.org/abs/2501.03262).

    Subtract the group mean, then normalise the *centred* values by their std over the whole batch
    (their batch mean is already 0, because each group's centred values sum to 0), as verl's
    ``reinforce_plus_plus_baseline`` whitening does. This differs from
    ``group_advantages(scale="batch")``, which divides by the std of the raw rewards. ``scale`` is
    ignored.

    Args:
        rewards: [N] floating-point rewards.
        group_ids: [N] integer group ids.
        eps: added to the batch std before dividing.

    Returns:
        advantages [N].
    """
    _check(rewards, group_ids)
    inverse, _, means, _ = _group_moments(rewards, group_ids)
    centered = rewards - means[inverse]  # [N]
    return _safe_divide(centered, _batch_std(centered) + eps)


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Look up estimator ``name`` in ``ADVANTAGE_ESTIMATORS`` and apply it.

    Raises ValueError (listing the registered names) for an unknown ``name``.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(ADVANTAGE_ESTIMATORS.unknown_message(name))
    return ADVANTAGE_ESTIMATORS.get(name)(rewards, group_ids, **kwargs)


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Detached per-batch statistics of the groups, for logging.

    * ``num_groups``: number of distinct group ids.
    * ``zero_std_frac``: fraction of groups whose rewards are all equal (std exactly 0; groups of one
      included). Such groups have zero advantage and give no learning signal (DAPO's dynamic sampling,
      https://arxiv.org/abs/2503.14476, resamples them). Tested with max == min, so rounding in the
      mean cannot make a constant group look non-constant.
    * ``mean_group_std``: mean over groups of the unbiased group std.
    """
    _check(rewards, group_ids)
    rewards = rewards.detach()
    inverse, _, _, stds = _group_moments(rewards, group_ids)  # [N], [num_groups]
    num_groups = stds.numel()
    high = rewards.new_full((num_groups,), -torch.inf).scatter_reduce(0, inverse, rewards, "amax")
    low = rewards.new_full((num_groups,), torch.inf).scatter_reduce(0, inverse, rewards, "amin")
    return {
        "num_groups": torch.tensor(num_groups),
        "zero_std_frac": (high == low).to(rewards.dtype).mean(),
        "mean_group_std": stds.mean(),
    }
