"""Outcome advantages for group-sampled rollouts (one scalar reward per sample).

Shapes use one legend: B prompts, G samples per prompt, N = B*G samples. ``group_ids`` [N] says
which prompt each sample answers; ids are arbitrary integers (not necessarily contiguous, sorted or
equal-sized groups), so a batch that lost some samples to filtering still works.

Every estimator in ``ADVANTAGE_ESTIMATORS`` has the same signature::

    fn(rewards [N], group_ids [N], *, mask=None, scale="group", eps=1e-6, unbiased=True,
       token_rewards=None, values=None, gamma=1.0, lam=1.0) -> (advantages [N] or [N, T], returns [N, T] or None)

so a trainer calls ``estimate_advantages(name, rewards, group_ids, mask=..., ...)`` and never
branches on the name (``compute_advantages`` gives the advantages alone). ``mask`` [N, T] marks the
trained tokens (or denoising steps); estimators that whiten over tokens (``reinforce++-baseline``
and the token-reward ones) need it and return per-token advantages [N, T], the others return [N]
(the same advantage for every token of a sample). ``token_rewards`` [N, T] are the rewards placed on
tokens (``unirl.core.token_rewards``: the score on the last one, minus a KL penalty); the outcome
estimators read ``rewards`` [N] instead, which the trainer passes as their row sums. ``values``
[N, T] are a critic's; ``returns`` are the critic's regression target, None for estimators without
one. Estimators that have no use for an argument accept and ignore it; an estimator that reads
``values`` says so with the attribute ``reads_values = True`` (the trainer then builds a critic).
The token-reward estimators (``gae``, ``reinforce++``) live in ``unirl/core/returns.py``.

Std convention: by default every std here is the *unbiased* one (Bessel's correction, ``torch.std``'s
default), as GRPO implementations (verl, TRL) use; ``unbiased=False`` gives the biased one (numpy's
``np.std``), which FlowGRPO's ``PerPromptStatTracker`` uses (with ``eps=1e-4``); a group of one
sample has std 0 by definition (not NaN) and gets advantage 0 from ``grpo`` and ``rloo`` (verl gives
a lone sample ``r / (1 + eps)``, its mean being set to 0 and its std to 1; a group of one carries no
relative signal, so unirl keeps it out). For a group of G samples the two stds differ by the factor
sqrt(G / (G - 1)).
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


def _group_moments(rewards: torch.Tensor, group_ids: torch.Tensor, unbiased: bool = True):
    """``inverse`` [N] (group index of each sample) and per-group ``counts``, ``means``, ``stds``
    (unbiased unless ``unbiased=False``), each [num_groups]. Vectorised with
    ``unique(return_inverse=True)`` + ``index_add``."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)  # [num_groups], [N]
    zeros = rewards.new_zeros(uniq.numel())  # [num_groups]
    counts = zeros.index_add(0, inverse, torch.ones_like(rewards))  # [num_groups]
    means = zeros.index_add(0, inverse, rewards) / counts  # [num_groups]
    sq = zeros.index_add(0, inverse, (rewards - means[inverse]).square())  # [num_groups]
    # A group of one has no spread to estimate, so its std is defined as 0 (either convention).
    dof = (counts - 1).clamp_min(1) if unbiased else counts  # [num_groups]
    var = torch.where(counts > 1, sq / dof, torch.zeros_like(sq))  # [num_groups]
    return inverse, counts, means, var.sqrt()


def _safe_divide(centered: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``centered / scale``, 0 where ``scale`` is 0 (possible only with ``eps=0``): no NaN."""
    return torch.where(scale > 0, centered / torch.where(scale > 0, scale, 1), torch.zeros_like(centered))


def _batch_std(values: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Std of all N values (unbiased unless ``unbiased=False``); 0 for N < 2 instead of NaN."""
    if values.numel() < 2:
        return values.new_zeros(())
    return values.std(correction=1 if unbiased else 0)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
) -> torch.Tensor:
    """Group-relative advantages: subtract the group mean, then optionally divide by a std.

    * ``scale="group"``: ``(r - mean_g) / (std_g + eps)``, GRPO (DeepSeekMath,
      https://arxiv.org/abs/2402.03300).
    * ``scale="batch"``: ``(r - mean_g) / (std(rewards over the whole batch) + eps)``, FlowGRPO's
      ``global_std`` option (https://arxiv.org/abs/2505.05470), which keeps small differences inside
      low-variance groups from being blown up.
    * ``scale="none"``: ``r - mean_g``, Dr. GRPO (https://arxiv.org/abs/2503.20783), which argues the
      per-group std biases learning towards too-easy and too-hard prompts.

    Stds are unbiased unless ``unbiased=False`` (see the module docstring). A group of one sample
    gets advantage 0. FlowGRPO's advantages are ``scale="batch", eps=1e-4, unbiased=False``.

    Args:
        rewards: [N] floating-point rewards, N = B*G.
        group_ids: [N] integer group (prompt) id of each sample.
        scale: ``"group"``, ``"batch"`` or ``"none"``.
        eps: added to the std before dividing. With ``eps=0`` a zero std gives advantage 0, not NaN.
        unbiased: Bessel-corrected stds (True) or numpy's biased ones (False).

    Returns:
        advantages [N], same dtype as ``rewards``.
    """
    _check(rewards, group_ids)
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(map(repr, SCALES))}, got {scale!r}")
    inverse, _, means, stds = _group_moments(rewards, group_ids, unbiased)
    centered = rewards - means[inverse]  # [N]
    if scale == "group":
        return _safe_divide(centered, stds[inverse] + eps)
    if scale == "batch":
        return _safe_divide(centered, _batch_std(rewards, unbiased) + eps)
    return centered


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, None]:
    """GRPO (https://arxiv.org/abs/2402.03300): ``group_advantages`` under the registry contract."""
    return group_advantages(rewards, group_ids, scale=scale, eps=eps, unbiased=unbiased), None


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, None]:
    """REINFORCE leave-one-out: ``r_i - mean of the other samples of its group``.

    Kool et al. 2019 (https://openreview.net/forum?id=r1lgTGL5DE), used for LLMs by Ahmadian et al.
    2024 (https://arxiv.org/abs/2402.14740). Equals ``G / (G - 1) * (r_i - mean_g)`` for a group of
    size G; a group of one has no other sample and gets 0. ``mask``, ``scale``, ``eps`` and
    ``unbiased`` are ignored.

    Args:
        rewards: [N] floating-point rewards.
        group_ids: [N] integer group ids.

    Returns:
        ``(advantages [N], None)``.
    """
    _check(rewards, group_ids)
    inverse, counts, means, _ = _group_moments(rewards, group_ids)
    # r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_g); zero when n == 1.
    factor = torch.where(counts > 1, counts / (counts - 1).clamp_min(1), torch.zeros_like(counts))  # [num_groups]
    return factor[inverse] * (rewards - means[inverse]), None


@ADVANTAGE_ESTIMATORS.register("reinforce++-baseline")
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, None]:
    """REINFORCE++ with a group baseline (https://arxiv.org/abs/2501.03262), as verl computes it
    (``compute_reinforce_plus_plus_baseline_outcome_advantage``).

    1. Subtract the group mean from each reward. A group of one sample keeps its raw reward (verl
       sets the baseline of a lone sample to 0, not to its own reward).
    2. Broadcast the centred value to every response token and *whiten over tokens*: with ``x`` the
       token values where ``mask`` is set, ``(x - mean(x)) / sqrt(var(x) + 1e-8)``, the mean and the
       Bessel-corrected variance taken over all masked-in tokens of the batch (verl's
       ``masked_whiten``). Long responses therefore weigh more in the mean and the variance: rewards
       [1, 0, 1, 0] in one group with lengths [1, 10, 1, 10] give 3.09 and -0.31, not +-0.87.

    Without ``mask`` every sample counts as one token (whitening over samples). ``scale`` is
    ignored; ``eps`` and ``unbiased`` are unused too: the variance is Bessel-corrected and gets verl's
    fixed 1e-8.

    Args:
        rewards: [N] floating-point rewards.
        group_ids: [N] integer group ids.
        mask: [N, T] boolean or 0/1 response mask, or None.

    Returns:
        ``(advantages, None)``: advantages [N, T] (0 at masked positions) when ``mask`` is given, else [N].
    """
    _check(rewards, group_ids)
    inverse, counts, means, _ = _group_moments(rewards, group_ids)
    baseline = torch.where(counts > 1, means, torch.zeros_like(means))  # [num_groups]
    centered = rewards - baseline[inverse]  # [N]
    if mask is None:
        ones = torch.ones_like(centered, dtype=torch.bool).unsqueeze(-1)  # [N, 1]
        return masked_whiten(centered.unsqueeze(-1), ones).squeeze(-1), None
    mask = check_mask(mask, rewards.shape[0])
    return masked_whiten(centered.unsqueeze(-1).expand(mask.shape), mask), None  # [N, T]


def check_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """``mask`` as a boolean [N, T], or a ValueError naming the expected shape."""
    if mask.ndim != 2 or mask.shape[0] != n:
        raise ValueError(f"mask must be [N, T] with N = {n}, got shape {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` over the masked-in entries (unbiased var), 0 elsewhere
    (verl's ``masked_whiten``).

    Fewer than two masked-in entries have no variance to estimate: the whitened values are 0."""
    count = mask.sum()
    zeros = torch.zeros_like(values)
    if count < 2:
        return zeros
    mean = torch.where(mask, values, zeros).sum() / count
    centered = torch.where(mask, values - mean, zeros)
    var = centered.square().sum() / (count - 1)
    return torch.where(mask, centered * torch.rsqrt(var + 1e-8), zeros)


def estimate_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, **kwargs
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Look up estimator ``name`` in ``ADVANTAGE_ESTIMATORS`` and apply it: ``(advantages, returns)``.

    Raises ValueError (listing the registered names) for an unknown ``name``.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(ADVANTAGE_ESTIMATORS.unknown_message(name))
    return ADVANTAGE_ESTIMATORS.get(name)(rewards, group_ids, **kwargs)


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The advantages of ``estimate_advantages`` (without the critic's returns)."""
    return estimate_advantages(name, rewards, group_ids, **kwargs)[0]


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
