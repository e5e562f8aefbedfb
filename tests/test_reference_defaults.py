"""Defaults and claims that follow a reference (issue 23's audit): each checked against that
reference's formula, re-typed here from its source, over several seeds and on the audit's hand cases.

verl: dual-clip in its vanilla PPO loss (``clip_ratio_c=3``), the clamp of GSPO's sequence
log-ratio at 10. TRL: ``multi_objective_aggregation="normalize_then_sum"`` (per-reward group
normalisation, then a batch normalisation of the weighted sum, both with ``+ 1e-4``). FlowGRPO: the
zero-advantage filter tops up to a multiple of the per-process sampling batches.
"""

from __future__ import annotations

import math

import pytest
import torch

from unirl.config import CONFIGS_ROOT, load_config
from unirl.core import clipped_policy_loss, compute_advantages
from unirl.trainer.context import RunState
from unirl.trainer.zero_advantage import drop_zero_advantage
from unirl.config.schema import AlgoConfig, RewardConfig, TrainerConfig
from unirl.reward_set import RewardSet
from unirl.text.config import TextConfig
from stage_helpers import stage_context  # tests/stage_helpers.py

SEEDS = [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------- verl's dual-clip
def _verl_vanilla(logp, old, adv, clip_low, clip_high, clip_ratio_c):
    """verl ``compute_policy_loss_vanilla`` per token: PPO clip, then for A < 0 the minimum with -A * c."""
    ratio = torch.exp(logp - old)
    pg1 = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    pg3 = -adv * clip_ratio_c
    return torch.where(adv < 0, torch.minimum(pg3, pg1), pg1)


def test_gsm8k_config_dual_clips_like_verls_vanilla_loss():
    cfg = load_config(TextConfig, CONFIGS_ROOT / "text" / "gsm8k.yaml")
    assert cfg.algo.dual_clip == 3.0
    # The audit's case: one token, log-ratio 5, A = -1. Without dual-clip: e^5 = 148.4; verl: 3.0.
    logp, old, adv = torch.tensor([[5.0]]), torch.tensor([[0.0]]), torch.tensor([-1.0])
    loss, _ = clipped_policy_loss(logp, old, adv, None, clip_low=cfg.algo.clip_low, clip_high=cfg.algo.clip_high,
                                  dual_clip=cfg.algo.dual_clip)
    assert loss.item() == pytest.approx(3.0)
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        logp = 2 * torch.randn(6, 9, generator=g, dtype=torch.float64)
        old = 2 * torch.randn(6, 9, generator=g, dtype=torch.float64)
        adv = torch.randn(6, generator=g, dtype=torch.float64)
        expected = _verl_vanilla(logp, old, adv[:, None], 0.2, 0.2, 3.0).mean()
        loss, _ = clipped_policy_loss(logp, old, adv, None, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
        torch.testing.assert_close(loss, expected)


# ------------------------------------------------------------------------- verl's GSPO clamp
def _verl_gspo(logp, old, adv, mask, clip_low, clip_high):
    """verl ``compute_policy_loss_gspo``: the sequence log-ratio (masked mean) at every token, clamped
    at 10, PPO clip, then seq-mean-token-mean."""
    seq_len = mask.sum(-1).clamp(min=1)
    seq_kl = ((logp - old) * mask).sum(-1) / seq_len
    log_ratio = (logp - logp.detach() + seq_kl.detach()[:, None]).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(1 - clip_low, 1 + clip_high))
    return ((pg * mask).sum(-1) / seq_len).mean()


def test_gspo_clamps_the_sequence_log_ratio_at_10_like_verl():
    # The audit's case: one token, log-ratio 12, A = -1: e^12 = 162,755 unclamped, e^10 = 22,026 in verl.
    logp = torch.tensor([[12.0]], requires_grad=True)
    loss, metrics = clipped_policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), None, level="sequence",
                                        agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(math.exp(10.0))
    loss.backward()
    assert logp.grad.item() == 0.0  # past the clamp the sequence has no gradient, as in verl
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        n, t = 8, 6
        old = torch.randn(n, t, generator=g, dtype=torch.float64)
        shift = torch.zeros(n, 1, dtype=torch.float64)
        shift[:3] = 14.0  # three sequences past the clamp, the others below it
        base = old + shift + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
        mask = torch.rand(n, t, generator=g) < 0.8
        mask[:, 0] = True
        adv = torch.randn(n, generator=g, dtype=torch.float64)
        ours_logp = base.clone().requires_grad_(True)
        ref_logp = base.clone().requires_grad_(True)
        loss, _ = clipped_policy_loss(ours_logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean",
                                      clip_low=3e-4, clip_high=4e-4)
        expected = _verl_gspo(ref_logp, old, adv, mask.double(), 3e-4, 4e-4)
        torch.testing.assert_close(loss, expected)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(ours_logp.grad, ref_logp.grad)


# ------------------------------------------------------------------ TRL's normalize_then_sum
def _nanstd(x, dim=None, keepdim=False):
    """TRL's ``nanstd``: Bessel-corrected, NaNs ignored."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    out = var.sqrt()
    return out if keepdim or dim is None else out.squeeze(dim)


def _trl_normalize_then_sum(per_func, weights, group_size):
    """TRL ``_generate_and_score_completions`` with ``multi_objective_aggregation="normalize_then_sum"``."""
    grouped = per_func.view(-1, group_size, per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = _nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, per_func.shape[1])
    rewards = (reward_k * weights).nansum(dim=1)
    return (rewards - torch.nanmean(rewards)) / (_nanstd(rewards) + 1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_normalize_then_sum_with_batch_scale_is_trls(tmp_path, seed):
    path = tmp_path / "two.py"
    path.write_text("def a(samples, **kw):\n    return [0.0] * len(samples)\n"
                    "def b(samples, **kw):\n    return [0.0] * len(samples)\n")
    weights = [1.0, 0.5]
    rs = RewardSet([RewardConfig(f"{path}:a", weights[0]), RewardConfig(f"{path}:b", weights[1])],
                   aggregation="normalize_then_sum", eps=1e-4)
    g = torch.Generator().manual_seed(seed)
    B, G = 6, 4
    per_func = torch.randn(B * G, 2, generator=g, dtype=torch.float64)
    per_func[:, 1] = per_func[:, 1].round()  # some ties, a constant group now and then
    per_func[torch.rand(B * G, generator=g) < 0.2, 1] = float("nan")  # b does not apply to a few samples
    group_ids = torch.arange(B * G) // G
    total, _ = rs.combine({"a": per_func[:, 0].float(), "b": per_func[:, 1].float()}, group_ids)
    ours = compute_advantages("grpo", total.double(), group_ids, scale="batch", eps=1e-4, unbiased=True)
    expected = _trl_normalize_then_sum(per_func, torch.tensor(weights, dtype=torch.float64), G)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # Group normalisation alone (the default adv_scale: group) is not TRL's: the check can fail.
    group_scaled = compute_advantages("grpo", total.double(), group_ids, scale="group", eps=1e-4)
    assert (group_scaled - expected).abs().max() > 1e-3


# ------------------------------------------------------------- FlowGRPO's zero-advantage top-up
def _flowgrpo_kept(nonzero: int, samples: int, micro_batch: int) -> int:
    """FlowGRPO train_sd3.py: the non-zero count topped up to a multiple of num_batches_per_epoch, the
    per-process sampling batches (each one of its training micro-batches)."""
    num_batches = samples // micro_batch
    return nonzero + (num_batches - nonzero % num_batches) % num_batches


@pytest.mark.parametrize("nonzero", [76, 1, 64, 127, 128])
def test_zero_adv_filter_tops_up_like_flowgrpo_at_sd3_ocr_shape(tmp_path, nonzero):

    from unirl.env import Rollout

    cfg = load_config(_diffusion_config(), CONFIGS_ROOT / "diffusion" / "sd3_ocr.yaml").trainer
    n = cfg.prompts_per_step * cfg.group_size  # 8 x 16 = 128, micro-batches of 8: 16 of them
    adv = torch.zeros(n, 9)
    adv[torch.randperm(n, generator=torch.Generator().manual_seed(nonzero))[:nonzero]] = 1.0
    ctx = stage_context(AlgoConfig(drop_zero_adv=True),
                        TrainerConfig(prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size,
                                      mini_batch_size=cfg.mini_batch_size, micro_batch_size=cfg.micro_batch_size))
    rollout = Rollout(tensors={}, advantages=adv, group_ids=torch.arange(n) // cfg.group_size,
                      prompts=[""] * n, samples=list(range(n)))
    kept, _ = drop_zero_advantage(ctx, RunState(), rollout)
    assert len(kept) == _flowgrpo_kept(nonzero, n, cfg.micro_batch_size)
    if nonzero == 76:
        assert len(kept) == 80  # the audit's figure (a multiple of the 2 mini-batches would keep 76)


def _diffusion_config():
    from unirl.diffusion.config import DiffusionConfig

    return DiffusionConfig
