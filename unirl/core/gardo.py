"""GARDO (He et al., 2025, "Gated and Adaptive Regularization with Diversity-aware Optimization",
https://arxiv.org/abs/2512.24138), as flow_grpo's ``scripts/train_sd3_gardo.py`` and ``flow_grpo/stat_tracking.py``
(``type='gardo'``) compute it (commit 94e23ee), the registered loss ``gardo`` and its pieces:

* **Gate** (``uncertainty``, ``uncertainty_gate``, ``next_gate_fraction``): a sample's uncertainty is the rank of
  its trained reward minus the mean of its ranks under the auxiliary rewards (ranks over the whole batch, 1 the
  highest: ``u = rank(r) - mean_k rank(r_k)``). The KL to the reference applies only to the samples whose ``u`` is
  above the ``100 (1 - f)``-th percentile of the non-negative ``u`` (numpy's linear percentile), the top fraction
  ``f``. ``f`` follows the code's ``RiskCompensator``: it starts at 0.1; each step, with ``m`` the mean of the
  non-negative ``u`` and the last 20 steps' ``m``: ``f <- 1.1 f`` if ``m`` is above all of them, ``0.9 f`` if below
  all, clipped to [0.02, 0.2].
* **Diversity** (``diversity_weights``, ``diversity_advantages``): with unit feature vectors of a prompt's images
  (DINOv3's there), each image's diversity is its smallest cosine distance ``1 - cos`` to another image of its
  group; a positive centred reward ``r - mean_g`` is multiplied by ``d / mean_g(d)``, a negative one is kept.
  The code does not divide by a std (``adv_scale: none``) and clamps the result to ``[-5, 5]`` in the loss.
* **Loss**: the clipped ratio loss on those advantages plus ``kl_coef`` times the mean, over the gated samples of
  the piece, of the step KL ``mean((mu - mu_ref)^2) / (2 std_dev_t^2)`` (FlowGRPO's form, ``kl_form: flowgrpo``)
  to a reference that the rollout mode resets to the policy (``unirl/diffusion/gardo.py``). A piece without a
  gated sample adds no KL, as the code's ``if True in idx``.

The code also weights each sample's clipped loss by ``std_dev_t / mean(std_dev_t)`` over its micro-batch; every
sample of a micro-batch is at the same step there, so the weight is 1, and it is left out here.

Shapes: N samples, K auxiliary rewards, D feature size; n samples and T' steps of a loss piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.losses import aggregate
from unirl.core.policy_losses import LossInputs, LossSettings, register_policy_loss


def reward_ranks(rewards: torch.Tensor) -> torch.Tensor:
    """[N] ranks of ``rewards`` [N] over the batch, 1 for the highest (ties in batch order)."""
    order = torch.sort(rewards, descending=True, stable=True).indices  # [N]
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, len(rewards) + 1, device=rewards.device)
    return ranks.float()


def uncertainty(rewards: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """GARDO's uncertainty [N]: ``rank(rewards) - mean_k rank(aux[k])`` (``rewards`` [N], ``aux`` [K, N])."""
    if aux.ndim != 2 or aux.shape[1] != rewards.shape[0] or aux.shape[0] == 0:
        raise ValueError(f"aux must be [K >= 1, N={rewards.shape[0]}], got {tuple(aux.shape)}")
    return reward_ranks(rewards) - torch.stack([reward_ranks(a) for a in aux]).mean(dim=0)


def uncertainty_gate(u: torch.Tensor, fraction: float) -> torch.Tensor:
    """[N] bool: ``u`` above the ``100 (1 - fraction)``-th percentile (linear) of its non-negative values."""
    nonneg = u[u >= 0]
    if nonneg.numel() == 0:  # ranks minus mean ranks sum to 0, so only an empty batch gets here
        return torch.zeros_like(u, dtype=torch.bool)
    return u > torch.quantile(nonneg.double(), 1 - fraction).to(u.dtype)


def next_gate_fraction(fraction: float, mean_u: float, history: list[float], *, base: float = 0.1,
                       rate: float = 0.1, low: float = 0.02, high: float = 0.2) -> float:
    """The gate's next fraction (the code's ``RiskCompensator.update``): ``base`` with no history, else
    ``fraction`` times ``1 + rate`` when ``mean_u`` exceeds every value of ``history``, ``1 - rate`` when below
    all, clipped to ``[low, high]``. The caller appends ``mean_u`` to ``history`` (its last 20)."""
    if not history:
        fraction = base
    elif mean_u > max(history):
        fraction = fraction * (1 + rate)
    elif mean_u < min(history):
        fraction = fraction * (1 - rate)
    return min(max(fraction, low), high)


def diversity_weights(features: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] ``d / mean_g(d)``: ``d`` each sample's smallest cosine distance to another sample of its group
    (``features`` [N, D]). A group whose images are all one (every ``d`` 0), or a group of one, gets 1: the code
    divides 0 by 0 there, and its centred rewards are 0 anyway."""
    unit = torch.nn.functional.normalize(features.double(), dim=1)  # [N, D]
    distance = 1 - (unit @ unit.T).clamp(-1, 1)  # [N, N]
    other = (group_ids[:, None] == group_ids[None, :]) & ~torch.eye(len(group_ids), dtype=torch.bool)  # [N, N]
    d = torch.where(other, distance, torch.inf).amin(dim=1)  # [N]; inf for a group of one
    ids, inverse = torch.unique(group_ids, return_inverse=True)
    finite = torch.isfinite(d)
    d = torch.where(finite, d, 0.0)
    sums = torch.zeros(len(ids), dtype=d.dtype).index_add(0, inverse, d)
    counts = torch.zeros(len(ids), dtype=d.dtype).index_add(0, inverse, finite.double())
    mean = (sums / counts.clamp_min(1))[inverse]  # [N]
    return torch.where(mean > 0, d / torch.where(mean > 0, mean, 1.0), 1.0).to(features.dtype)


def diversity_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """GARDO's advantages: ``advantages * weights`` where ``advantages >= 0``, unchanged where negative
    (same shapes, or ``weights`` broadcastable)."""
    return torch.where(advantages < 0, advantages, advantages * weights)


@dataclass(frozen=True)
class GardoArgs:
    """GARDO's loss settings (``algo.loss_args`` with ``algo.policy_loss: gardo``): its OCR config's."""

    #: The KL's coefficient (``config.train.beta``: 0.04 for OCR in flow_grpo's ``config/grpo_gardo.py``).
    kl_coef: float = 0.04
    #: The advantages are clamped to ``[-adv_clip, adv_clip]`` after the diversity weight (``adv_clip_max``).
    adv_clip: float = 5.0
    #: Multiply the positive advantages by the diversity weight (GARDO's diversity-aware optimisation).
    diversity: bool = True

    def __post_init__(self):
        for name in ("kl_coef", "adv_clip"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")


def gated_kl(kl: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """0-dim: the mean of ``kl`` [n, T'] over the gated samples (``gate`` [n, T'] of 0/1), 0 when none is."""
    count = gate.sum()
    return torch.where(count > 0, (kl * gate).sum() / count.clamp_min(1), torch.zeros((), dtype=kl.dtype))


@register_policy_loss("gardo", settings=GardoArgs, reads=("ref_kl", "kl_gate", "diversity"))
def gardo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GARDO's loss (module docstring): the clipped loss of the diversity-weighted advantages, aggregated with
    ``loss_agg``, plus ``kl_coef`` times the piece's gated KL mean, scaled by the piece's share of the
    normaliser (its ``n T'`` samples over ``denominator``) so that the pieces of a mini-batch average it as the
    code's gradient accumulation does."""
    f, s, args = inputs.forward, settings, settings.args or GardoArgs()
    adv = inputs.advantages.float()  # [n, T']
    if args.diversity:
        adv = diversity_advantages(adv, f["diversity"].float())
    adv = adv.clamp(-args.adv_clip, args.adv_clip)
    ratio = torch.exp(f["logp"].float() - inputs.old_logp.float())  # [n, T']
    per_step = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - s.clip_low, 1 + s.clip_high))  # [n, T']
    if inputs.weights is not None:
        per_step = per_step * inputs.weights
    agg = dict(denominator=inputs.denominator, seq_lengths=inputs.seq_lengths)
    policy = aggregate(per_step, inputs.mask, s.loss_agg, **agg)
    kl = gated_kl(f["ref_kl"].float(), f["kl_gate"].float())
    share = per_step.numel() / inputs.denominator if inputs.denominator is not None else 1.0
    loss = policy + args.kl_coef * kl * share
    with torch.no_grad():
        figures = {"loss/policy": policy.detach(), "loss/gardo_kl": (kl * share).detach(),
                   "loss/gardo_gate_frac": aggregate(f["kl_gate"].float(), inputs.mask, s.loss_agg, **agg)}
    return loss, figures
