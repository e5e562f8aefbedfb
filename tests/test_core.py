"""Tests for unirl.core: hand-derived values, reference formulas over seeds, and properties.

Expected numbers are worked out in the comments next to them. Reference implementations are written
independently of the library (Python loops over floats, ``statistics``, ``math``, ``torch.distributions``).
"""

from __future__ import annotations

import inspect
import math
import random
import statistics
from collections import defaultdict

import pytest
import torch

from unirl.config.schema import AlgoConfig

from unirl.core import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    aggregate,
    aggregate_denominator,
    clipped_policy_loss,
    compute_advantages,
    entropy_from_logits,
    gaussian_kl,
    group_advantages,
    group_stats,
    kl_divergence,
    masked_mean,
    policy_loss_metrics,
    truncated_importance_weights,
)

F64 = torch.float64
SEEDS = range(6)


# Every valid (level, agg) pair: GSPO (level="sequence") takes only seq-mean-token-mean.
_LEVEL_AGG = [("token", agg) for agg in AGG_MODES] + [("sequence", "seq-mean-token-mean")]

def close(actual, expected, tol=1e-12):
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol)


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------


def test_group_advantages_one_group_by_hand():
    # rewards [1, 0, 1, 1]: mean 0.75, deviations [0.25, -0.75, 0.25, 0.25],
    # squared sum 3 * 0.0625 + 0.5625 = 0.75, unbiased var 0.75 / 3 = 0.25, std 0.5
    # -> advantages [0.5, -1.5, 0.5, 0.5].
    adv = group_advantages(t([1.0, 0.0, 1.0, 1.0]), torch.tensor([3, 3, 3, 3]), eps=0.0)
    close(adv, [0.5, -1.5, 0.5, 0.5])
    # With the default eps=1e-6: 0.25 / (0.5 + 1e-6) etc.
    adv = group_advantages(t([1.0, 0.0, 1.0, 1.0]), torch.tensor([3, 3, 3, 3]))
    close(adv, [0.25 / 0.500001, -0.75 / 0.500001, 0.25 / 0.500001, 0.25 / 0.500001])


def test_group_advantages_two_interleaved_groups_all_scales_by_hand():
    rewards = t([2.0, 10.0, 4.0, 20.0])
    ids = torch.tensor([9, -1, 9, -1])  # not contiguous, not sorted, negative
    # group 9: [2, 4], mean 3, deviations [-1, 1], unbiased var (1 + 1) / 1 = 2, std sqrt(2)
    # group -1: [10, 20], mean 15, deviations [-5, 5], var 50, std 5 sqrt(2)
    # -> every sample is -/+ 1/sqrt(2).
    h = 1 / math.sqrt(2)
    close(group_advantages(rewards, ids, scale="group", eps=0.0), [-h, -h, h, h])
    # none (Dr. GRPO): deviations only.
    close(group_advantages(rewards, ids, scale="none"), [-1.0, -5.0, 1.0, 5.0])
    # batch (FlowGRPO global_std): batch mean 9, deviations [-7, 1, -5, 11], squares 49+1+25+121 = 196,
    # unbiased var 196 / 3, std 14 / sqrt(3).
    s = 14 / math.sqrt(3)
    close(group_advantages(rewards, ids, scale="batch", eps=0.0), [-1 / s, -5 / s, 1 / s, 5 / s])


def test_group_of_one_gets_zero_advantage_for_every_estimator():
    # Sample 0 is alone in group 0. Group 1 = [1, 2]: mean 1.5, deviations -/+ 0.5, unbiased var
    # 0.5, std sqrt(0.5) -> -/+ 0.5 / sqrt(0.5) = -/+ sqrt(0.5).
    rewards, ids = t([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, ids, scale=scale, eps=0.0)
        assert adv[0] == 0.0
    close(group_advantages(rewards, ids, eps=0.0)[1:], [-math.sqrt(0.5), math.sqrt(0.5)])
    for name in ADVANTAGE_ESTIMATORS:
        adv = compute_advantages(name, rewards, ids)
        if name == "reinforce++-baseline":
            # verl's baseline of a lone sample is 0, so it keeps its raw reward before whitening:
            # centred [3, -0.5, 0.5], mean 1, deviations [2, -1.5, -0.5], unbiased var 6.5 / 2.
            close(adv, [v / math.sqrt(3.25 + 1e-8) for v in (2.0, -1.5, -0.5)])
            continue
        if name in ("gae", "reinforce++"):
            # No groups: without values or tokens each reward is its own return, whitened over the
            # batch: mean 2, deviations [1, -1, 0], unbiased var 2 / 2 = 1.
            close(adv, [v / math.sqrt(1 + 1e-8) for v in (1.0, -1.0, 0.0)])
            continue
        assert adv[0] == 0.0, name
        assert torch.isfinite(adv).all(), name
    # A whole batch of one sample: no NaN anywhere.
    for name in ADVANTAGE_ESTIMATORS:
        close(compute_advantages(name, t([5.0]), torch.tensor([0])), [0.0])


def test_rloo_by_hand():
    # rewards [1, 0, 1, 1] in one group:
    # r0 = 1 - mean(0, 1, 1) = 1 - 2/3 = 1/3;  r1 = 0 - mean(1, 1, 1) = -1.
    # Second group [4, 6]: 4 - 6 = -2, 6 - 4 = 2. Third group [7] alone: 0.
    rewards = t([1.0, 0.0, 4.0, 1.0, 1.0, 6.0, 7.0])
    ids = torch.tensor([0, 0, 5, 0, 0, 5, 2])
    close(compute_advantages("rloo", rewards, ids), [1 / 3, -1.0, -2.0, 1 / 3, 1 / 3, 2.0, 0.0])


def test_reinforce_pp_baseline_by_hand_and_differs_from_batch_scale():
    # Groups: a = [1, 0, 1, 1] (mean 0.75), b = [0, 0] (mean 0).
    # Centred: [0.25, -0.75, 0.25, 0.25, 0, 0]; squares sum 0.75, unbiased var over 6: 0.75 / 5 = 0.15.
    rewards = t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    ids = torch.tensor([1, 1, 1, 1, 2, 2])
    s = math.sqrt(0.15 + 1e-8)  # verl's masked_whiten adds 1e-8 to the variance
    expected = [0.25 / s, -0.75 / s, 0.25 / s, 0.25 / s, 0.0, 0.0]
    close(compute_advantages("reinforce++-baseline", rewards, ids, eps=0.0), expected)
    # grpo scale="batch" uses the std of the raw rewards: mean 0.5, squares 6 * 0.25 = 1.5,
    # var 1.5 / 5 = 0.3 -> a different number.
    s_raw = math.sqrt(0.3)
    close(group_advantages(rewards, ids, scale="batch", eps=0.0)[0], 0.25 / s_raw)
    assert abs(0.25 / s - 0.25 / s_raw) > 0.1


def _random_groups(rng: random.Random, binary: bool):
    num_groups = rng.randint(1, 6)
    ids = rng.sample(range(-100, 100), num_groups)
    rows = []
    for g in ids:
        for _ in range(rng.randint(1, 5)):
            rows.append((float(rng.randint(0, 1)) if binary else rng.gauss(0, 3), g))
    rng.shuffle(rows)
    return [r for r, _ in rows], [g for _, g in rows]


def _loop_reference(name: str, rewards: list[float], ids: list[int], scale: str, eps: float) -> list[float]:
    groups = defaultdict(list)
    for r, g in zip(rewards, ids):
        groups[g].append(r)

    def stdev(xs):
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    out = []
    if name == "rloo":
        for r, g in zip(rewards, ids):
            others = list(groups[g])
            others.remove(r)
            out.append(r - statistics.fmean(others) if others else 0.0)
        return out
    centred = [r - statistics.fmean(groups[g]) for r, g in zip(rewards, ids)]
    if name == "reinforce++-baseline":
        # verl: a lone sample's baseline is 0; whiten with the mean and unbiased variance (+ 1e-8).
        centred = [r - (statistics.fmean(groups[g]) if len(groups[g]) > 1 else 0.0) for r, g in zip(rewards, ids)]
        if len(centred) < 2:
            return [0.0] * len(centred)
        m, var = statistics.fmean(centred), statistics.variance(centred)
        return [(c - m) / math.sqrt(var + 1e-8) for c in centred]
    assert name == "grpo"
    for c, g in zip(centred, ids):
        if scale == "group":
            out.append(c / (stdev(groups[g]) + eps))
        elif scale == "batch":
            out.append(c / (stdev(rewards) + eps))
        else:
            out.append(c)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_estimators_match_loop_reference(seed):
    rng = random.Random(seed)
    for binary in (False, True):
        rewards, ids = _random_groups(rng, binary)
        for name in ("grpo", "rloo", "reinforce++-baseline"):
            for scale in ("group", "batch", "none"):
                got = compute_advantages(name, t(rewards), torch.tensor(ids), scale=scale, eps=1e-6)
                close(got, _loop_reference(name, rewards, ids, scale, 1e-6), tol=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_advantages_zero_mean_per_group_and_permutation_equivariant(seed):
    rng = random.Random(100 + seed)
    rewards, ids = _random_groups(rng, binary=seed % 2 == 0)
    rewards, ids = t(rewards), torch.tensor(ids)
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(seed))
    for name in ADVANTAGE_ESTIMATORS:
        for scale in ("group", "batch", "none"):
            adv = compute_advantages(name, rewards, ids, scale=scale)
            if name in ("reinforce++-baseline", "reinforce++", "gae"):
                close(adv.sum(), 0.0, tol=1e-9)  # whitened over the batch (lone samples keep their reward)
            else:
                for g in ids.unique():
                    close(adv[ids == g].sum(), 0.0, tol=1e-9)
            close(compute_advantages(name, rewards[perm], ids[perm], scale=scale), adv[perm], tol=1e-12)


def test_float32_rewards_stay_float32():
    adv = group_advantages(t([1.0, 0.0, 1.0, 1.0], torch.float32), torch.tensor([0, 0, 0, 0]), eps=0.0)
    assert adv.dtype == torch.float32
    close(adv, [0.5, -1.5, 0.5, 0.5], tol=1e-6)


def test_group_stats_by_hand():
    # Groups: [0.1, 0.1, 0.1] (constant: std 0 even though 0.1 * 3 / 3 != 0.1 in floats),
    # [0, 1] (mean 0.5, unbiased var 0.5, std sqrt(0.5)), [5] alone (std 0).
    rewards = t([0.1, 0.0, 0.1, 5.0, 1.0, 0.1])
    ids = torch.tensor([4, 8, 4, 1, 8, 4])
    stats = group_stats(rewards, ids)
    assert int(stats["num_groups"]) == 3
    close(stats["zero_std_frac"], 2 / 3)
    close(stats["mean_group_std"], math.sqrt(0.5) / 3, tol=1e-9)
    r = rewards.clone().requires_grad_(True)
    assert not any(v.requires_grad for v in group_stats(r, ids).values())


def test_estimators_share_one_signature():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce++-baseline", "gae", "reinforce++"}
    keyword = ("mask", "scale", "eps", "unbiased", "token_rewards", "values", "gamma", "lam")
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        params = inspect.signature(fn).parameters
        assert list(params) == ["rewards", "group_ids", *keyword], name
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in keyword)
        assert params["mask"].default is None and params["unbiased"].default is True
        assert params["scale"].default == "group" and params["eps"].default == 1e-6
        assert params["token_rewards"].default is None and params["values"].default is None
        assert params["gamma"].default == 1.0 and params["lam"].default == 1.0


def test_advantage_bad_inputs():
    r, g = t([1.0, 0.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="scale.*'group'.*'batch'.*'none'"):
        group_advantages(r, g, scale="std")
    with pytest.raises(ValueError, match=r"group_ids.*\(2,\).*\(3,\)"):
        group_advantages(r, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages(r[None], g[None])
    with pytest.raises(ValueError, match="group_ids must be an integer"):
        group_advantages(r, g.double())
    with pytest.raises(ValueError, match="rewards must be a floating-point"):
        group_advantages(torch.tensor([1, 0]), g)
    with pytest.raises(ValueError, match="grpo.*reinforce\\+\\+-baseline.*rloo"):
        compute_advantages("ppo", r, g)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("rloo", r, torch.tensor([0]))


# --------------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    ln2 = math.log(2)
    # logp = 0, ref = ln 2: d = logp - ref = -ln 2.
    #   k1 = -ln 2 = -0.693147...; k2 = 0.5 ln^2 2 = 0.240227...;
    #   k3 = exp(-d) + d - 1 = 2 - ln 2 - 1 = 0.306853...
    # logp = ln 2, ref = 0: d = ln 2, k3 = 0.5 + ln 2 - 1 = 0.193147...
    logp, ref = t([0.0, ln2]), t([ln2, 0.0])
    close(kl_divergence(logp, ref, "k1"), [-ln2, ln2])
    close(kl_divergence(logp, ref, "k2"), [0.5 * ln2**2, 0.5 * ln2**2])
    close(kl_divergence(logp, ref, "k3"), [1 - ln2, ln2 - 0.5])
    close(kl_divergence(logp, ref, "k3"), [0.30685281944005466, 0.1931471805599453])
    close(kl_divergence(logp, ref, "k3+"), [1 - ln2, ln2 - 0.5])


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators_match_python_math(seed):
    rng = random.Random(seed)
    pairs = [(rng.uniform(-8, 0), rng.uniform(-8, 0)) for _ in range(50)]
    logp, ref = t([a for a, _ in pairs]), t([b for _, b in pairs])
    formulas = {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: math.exp(b - a) - (b - a) - 1,
        "k3+": lambda a, b: math.exp(b - a) - (b - a) - 1,
    }
    for name, f in formulas.items():
        close(kl_divergence(logp, ref, name), [f(a, b) for a, b in pairs], tol=1e-9)
    k3 = kl_divergence(logp, ref, "k3")
    assert (k3 >= 0).all()
    # k3 is non-negative far from 0 and tiny near 0 too (expm1 keeps precision there).
    wide = torch.linspace(-30, 30, 601, dtype=F64)
    assert (kl_divergence(wide, torch.zeros_like(wide), "k3") >= 0).all()
    assert (kl_divergence(t([1e-9]), t([0.0]), "k3") > 0).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_k1_and_k3_expectations_are_the_exact_kl(seed):
    # For tokens x ~ p: E_p[k1] = E_p[k3] = KL(p || q) exactly (a weighted sum, no Monte Carlo),
    # while E_p[k2] != KL in general.
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(7, generator=g, dtype=F64), -1)
    logq = torch.log_softmax(torch.randn(7, generator=g, dtype=F64), -1)
    p = logp.exp()
    exact = sum(float(pi) * (float(a) - float(b)) for pi, a, b in zip(p, logp, logq))
    close((p * kl_divergence(logp, logq, "k1")).sum(), exact, tol=1e-12)
    close((p * kl_divergence(logp, logq, "k3")).sum(), exact, tol=1e-12)
    assert abs(float((p * kl_divergence(logp, logq, "k2")).sum()) - exact) > 1e-4


def test_k3_plus_is_k3_value_with_k2_gradient():
    d = t([-1.5, -0.2, 0.4, 2.0])
    logp = d.clone().requires_grad_(True)
    ref = torch.zeros(4, dtype=F64)
    kl_divergence(logp, ref, "k3+").sum().backward()
    close(logp.grad, d)  # gradient of 0.5 d^2 is d
    logp3 = d.clone().requires_grad_(True)
    kl_divergence(logp3, ref, "k3").sum().backward()
    close(logp3.grad, 1 - torch.exp(-d))  # gradient of exp(-d) + d - 1 is 1 - exp(-d): different
    assert (logp3.grad - logp.grad).abs().min() > 0.01


def test_k3_clamp_like_verl():
    # d = -20: k3 = exp(20) - 21 = 4.85e8; clamped to 10. d = -25: the exponent is clamped to 20 first.
    logp, ref = t([-20.0, -25.0, 0.5]), t([0.0, 0.0, 0.0])
    close(kl_divergence(logp, ref, "k3"), [math.exp(20) - 21, math.exp(25) - 26, math.exp(-0.5) - 0.5], tol=1e-3)
    close(kl_divergence(logp, ref, "k3", clamp=10.0), [10.0, 10.0, math.exp(-0.5) - 0.5])
    x = logp.clone().requires_grad_(True)
    kl_divergence(x, ref, "k3+", clamp=10.0).sum().backward()
    close(x.grad, logp)  # k2's gradient, untouched by the clamp
    with pytest.raises(ValueError, match="clamp.*k3.*'k1'"):
        kl_divergence(logp, ref, "k1", clamp=10.0)
    with pytest.raises(ValueError, match="clamp must be positive"):
        kl_divergence(logp, ref, "k3", clamp=0.0)


def test_kl_bad_inputs():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "k3+"}
    with pytest.raises(ValueError, match="estimator.*k1, k2, k3, k3\\+"):
        kl_divergence(t([0.0]), t([0.0]), "low_var_kl")
    with pytest.raises(ValueError, match=r"logp.*\(2,\).*ref_logp.*\(3,\)"):
        kl_divergence(t([0.0, 1.0]), t([0.0, 1.0, 2.0]))


def test_gaussian_kl_by_hand():
    # mean [1, 2] vs ref [0, 0], std 2: per element 1/8 and 4/8, mean 5/16 = 0.3125.
    # Second sample identical -> 0.
    mean, ref = t([[1.0, 2.0], [3.0, 3.0]]), t([[0.0, 0.0], [3.0, 3.0]])
    close(gaussian_kl(mean, ref, 2.0), [0.3125, 0.0])
    # Per-sample std [2, 7]: same numbers (the second sample's difference is 0).
    close(gaussian_kl(mean, ref, t([2.0, 7.0])), [0.3125, 0.0])
    # reduce_dims=() keeps the elements.
    close(gaussian_kl(mean, ref, 2.0, reduce_dims=()), [[0.125, 0.5], [0.0, 0.0]])


@pytest.mark.parametrize("seed", SEEDS)
def test_gaussian_kl_matches_torch_distributions(seed):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(3, 2, 4, 5, generator=g, dtype=F64)
    ref = mean + 0.3 * torch.randn(3, 2, 4, 5, generator=g, dtype=F64)
    stds = {
        "scalar": torch.tensor(0.7, dtype=F64),
        "per-sample": torch.rand(3, generator=g, dtype=F64) + 0.1,
        "per-element": torch.rand(3, 2, 4, 5, generator=g, dtype=F64) + 0.1,
        "per-channel": torch.rand(1, 2, 1, 1, generator=g, dtype=F64) + 0.1,
    }
    for kind, std in stds.items():
        full = std.reshape(3, 1, 1, 1) if kind == "per-sample" else std
        full = full.expand_as(mean)
        want = torch.distributions.kl_divergence(
            torch.distributions.Normal(mean, full), torch.distributions.Normal(ref, full)
        ).mean(dim=(1, 2, 3))
        got = gaussian_kl(mean, ref, std)
        assert got.shape == (3,), kind
        close(got, want, tol=1e-12)


def test_gaussian_kl_bad_inputs():
    with pytest.raises(ValueError, match=r"mean and ref_mean.*\(2, 3\).*\(2, 4\)"):
        gaussian_kl(torch.zeros(2, 3), torch.zeros(2, 4), 1.0)
    with pytest.raises(ValueError, match=r"std.*\(5,\)"):
        gaussian_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(5))
    with pytest.raises(ValueError, match=r"std.*\(4, 2, 3\)"):
        gaussian_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(4, 2, 3))


# --------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------


def test_masked_mean_by_hand():
    values = t([[1.0, 2.0, 3.0], [4.0, 99.0, -7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(masked_mean(values, mask), 10 / 4)  # (1 + 2 + 3 + 4) / 4
    close(masked_mean(values, mask.bool(), dim=-1), [2.0, 4.0])
    close(masked_mean(values, torch.zeros(2, 3, dtype=torch.bool), dim=-1), [0.0, 0.0])  # empty -> 0
    with pytest.raises(ValueError, match=r"values.*\(2, 3\).*mask.*\(3,\)"):
        masked_mean(values, torch.ones(3))


def test_aggregate_by_hand():
    # Row 0: [1, 2, 3] (sum 6, mean 2); row 1: [4] (sum 4, mean 4); row 2 fully masked (not counted).
    values = t([[1.0, 2.0, 3.0], [4.0, 50.0, -50.0], [8.0, 8.0, 8.0]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    close(aggregate(values, mask, "token-mean"), 10 / 4)  # (1+2+3+4) / 4 tokens
    close(aggregate(values, mask, "seq-mean-token-mean"), 3.0)  # (2 + 4) / 2 sequences
    close(aggregate(values, mask, "seq-mean-token-sum"), 5.0)  # (6 + 4) / 2 sequences
    close(aggregate(values, mask, "seq-mean-token-sum-norm"), 10 / 6)  # (6 + 4) / (2 sequences * T=3)
    assert int(aggregate_denominator(mask, "token-mean")) == 4
    assert int(aggregate_denominator(mask, "seq-mean-token-mean")) == 2
    assert int(aggregate_denominator(mask, "seq-mean-token-sum")) == 2
    assert int(aggregate_denominator(mask, "seq-mean-token-sum-norm")) == 6
    # An explicit denominator replaces the batch's own.
    close(aggregate(values, mask, "token-mean", denominator=8), 10 / 8)
    close(aggregate(values, mask, "seq-mean-token-mean", denominator=torch.tensor(3)), 6 / 3)
    # All masked -> 0, not NaN.
    for mode in AGG_MODES:
        close(aggregate(values, torch.zeros_like(mask), mode), 0.0)


def _random_batch(seed, n=7, max_len=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g)
    lengths[seed % n] = 0  # one empty row
    mask = torch.arange(max_len)[None, :] < lengths[:, None]  # [N, T] right-padded
    return g, mask


@pytest.mark.parametrize("seed", SEEDS)
def test_aggregate_micro_batches_sum_to_full_batch(seed):
    g, mask = _random_batch(seed)
    values = torch.randn(mask.shape, generator=g, dtype=F64)
    splits = [(0, 2), (2, 3), (3, 7)]
    for mode in AGG_MODES:
        full_v = values.clone().requires_grad_(True)
        full = aggregate(full_v, mask, mode)
        full.backward()
        den = aggregate_denominator(mask, mode)
        micro_v = values.clone().requires_grad_(True)
        total = 0.0
        for a, b in splits:
            m = mask[a:b]
            cut = max(int(m.sum(-1).max()), 1)  # trim each micro-batch to its own padded length
            part = aggregate(micro_v[a:b, :cut], m[:, :cut], mode, denominator=den)
            part.backward()
            total = total + part
        close(total, full, tol=1e-12)
        close(micro_v.grad, full_v.grad, tol=1e-12)


# --------------------------------------------------------------------------------------------------
# Clipped policy loss
# --------------------------------------------------------------------------------------------------


def _hand_example():
    # Four real tokens with ratios [1.5, 0.5, 1.1, 0.7] and advantages [1, -1, 1, 1], plus a masked
    # fifth token full of junk.
    ratios = [1.5, 0.5, 1.1, 0.7]
    old = t([[-1.0, -2.0, -0.5, -3.0, 37.0]])
    logp = old.clone()
    logp[0, :4] += t([math.log(r) for r in ratios])
    logp[0, 4] = -45.0
    adv = t([[1.0, -1.0, 1.0, 1.0, 1e4]])
    mask = torch.tensor([[True, True, True, True, False]])
    return logp, old, adv, mask


def _check_hand_metrics(m):
    """The hand example's figures with clip_low = clip_high = 0.2: t0 clipped high, t1 clipped low."""
    close(m["clip_frac"], 0.5)
    close(m["clip_frac_low"], 0.25)
    close(m["clip_frac_high"], 0.25)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1 + 0.7) / 4)
    close(m["ratio_max"], 1.5)
    close(m["ratio_min"], 0.5)
    close(m["approx_kl"], sum(r - 1 - math.log(r) for r in [1.5, 0.5, 1.1, 0.7]) / 4)
    assert all(not v.requires_grad for v in m.values())


def test_clipped_loss_and_clip_metrics_by_hand():
    logp, old, adv, mask = _hand_example()
    x = logp.clone().requires_grad_(True)
    loss, m = clipped_policy_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # t0: r 1.5, A  1: max(-1.5, -1.2) = -1.2  (clipped high)
    # t1: r 0.5, A -1: max( 0.5,  0.8) =  0.8  (clipped low)
    # t2: r 1.1, A  1: max(-1.1, -1.1) = -1.1
    # t3: r 0.7, A  1: max(-0.7, -0.8) = -0.7  (a low ratio with A > 0 is not clipped)
    # token-mean: (-1.2 + 0.8 - 1.1 - 0.7) / 4 = -0.55
    close(loss, -0.55)
    _check_hand_metrics(m)
    assert "dual_clip_frac" not in m
    # Gradient: clipped tokens 0; others d(-A r)/d logp / 4 = -A r / 4.
    loss.backward()
    close(x.grad, [[0.0, 0.0, -1.1 / 4, -0.7 / 4, 0.0]])
    # Clip-higher (DAPO): clip_high 0.6 leaves t0 unclipped: (-1.5 + 0.8 - 1.1 - 0.7) / 4 = -0.625.
    loss, m = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.6)
    close(loss, -0.625)
    close(m["clip_frac_high"], 0.0)
    close(m["clip_frac"], 0.25)


def test_dual_clip_by_hand():
    # t0: A -1, r 5: PPO max(5, 0.8 * 1) = 5, dual min(5, 3 * 1) = 3 (dual clip active, gradient 0)
    # t1: A -1, r 2: max(2, 1.2) = 2 < 3, gradient -A r = 2
    # t2: A  1, r 5: max(-5, -1.2) = -1.2 (clipped high, gradient 0; dual clip ignores A > 0)
    ratios = [5.0, 2.0, 5.0]
    old = torch.zeros(1, 3, dtype=F64)
    logp = t([[math.log(r) for r in ratios]]).requires_grad_(True)
    adv = t([-1.0, 1.0])[t([[0, 0, 1]]).long()]
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = clipped_policy_loss(logp, old, adv, mask, dual_clip=3.0)
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(m["dual_clip_frac"], 1 / 3)
    close(m["clip_frac"], 1 / 3)  # only t2
    loss.backward()
    close(logp.grad, [[0.0, 2.0 / 3, 0.0]])
    # Without dual clip t0 contributes 5: (5 + 2 - 1.2) / 3.
    loss, _ = clipped_policy_loss(logp, old, adv, mask)
    close(loss, (5.0 + 2.0 - 1.2) / 3)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):  # checked once, where the config loads
        AlgoConfig(dual_clip=1.0)


def test_policy_loss_metrics_by_hand():
    # The hand example's figures, without the loss (a loss computed in pieces logs these once).
    logp, old, adv, mask = _hand_example()
    m = policy_loss_metrics(logp.requires_grad_(True), old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    _check_hand_metrics(m)
    close(m["dual_clip_frac"], 0.0)  # no ratio above 3


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_policy_loss_metrics_equal_those_of_the_loss(seed, level, dual_clip):
    """``with_metrics=False`` gives the same loss and gradient and no figures; ``policy_loss_metrics``
    gives the loss's figures exactly, for advantages [N] and [N, T]."""
    g, mask = _random_batch(seed)
    old = torch.randn(mask.shape, generator=g, dtype=F64) - 2
    logp = old + 0.4 * torch.randn(mask.shape, generator=g, dtype=F64)
    logp[~mask] = 99.0  # junk where masked out
    for adv in (torch.randn(mask.shape[0], generator=g, dtype=F64), torch.randn(mask.shape, generator=g, dtype=F64)):
        kwargs = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, level=level)
        agg = "seq-mean-token-mean" if level == "sequence" else "token-mean"
        x1, x2 = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        loss, full = clipped_policy_loss(x1, old, adv, mask, agg=agg, **kwargs)
        bare, none = clipped_policy_loss(x2, old, adv, mask, agg=agg, with_metrics=False, **kwargs)
        assert none == {}
        assert torch.equal(bare, loss)
        loss.backward(), bare.backward()
        assert torch.equal(x1.grad, x2.grad)
        alone = policy_loss_metrics(logp, old, adv, mask, **kwargs)
        assert alone.keys() == full.keys()
        for name in full:
            assert torch.equal(alone[name], full[name]), name


@pytest.mark.parametrize("seed", SEEDS)
def test_ratio_one_gives_minus_advantage_mean(seed):
    g, mask = _random_batch(seed)
    logp = (torch.randn(mask.shape, generator=g, dtype=F64) - 2).requires_grad_(True)
    adv = torch.randn(mask.shape[0], generator=g, dtype=F64)
    adv_tok = adv[:, None].expand(mask.shape)
    lengths = mask.sum(-1)
    nonempty = lengths > 0
    want = {
        # token-mean: -sum_i A_i * len_i / sum_i len_i
        "token-mean": -(adv * lengths).sum() / lengths.sum(),
        # seq-mean-token-mean: -mean over non-empty sequences of A_i
        "seq-mean-token-mean": -adv[nonempty].mean(),
        "seq-mean-token-sum": -(adv * lengths).sum() / nonempty.sum(),
        "seq-mean-token-sum-norm": -(adv * lengths).sum() / (nonempty.sum() * mask.shape[1]),
    }
    for level in ("token", "sequence"):
        for agg, expected in want.items():
            if level == "sequence" and agg != "seq-mean-token-mean":
                continue  # GSPO takes only seq-mean-token-mean (test_gspo_refuses_other_aggregations)
            for a in (adv, adv_tok):
                loss, m = clipped_policy_loss(logp, logp.detach(), a, mask, level=level, agg=agg)
                close(loss, expected)
                close(m["clip_frac"], 0.0)
                close(m["ratio_mean"], 1.0)
                close(m["approx_kl"], 0.0)
    # At ratio 1 the token-level gradient is the vanilla policy gradient -A_i / (number of tokens).
    loss, _ = clipped_policy_loss(logp, logp.detach(), adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, torch.where(mask, -adv_tok / lengths.sum(), 0.0))


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_positions_change_nothing(seed):
    g, mask = _random_batch(seed)
    shape = mask.shape
    logp = torch.randn(shape, generator=g, dtype=F64) - 2
    old = logp + 0.3 * torch.randn(shape, generator=g, dtype=F64)
    adv = torch.randn(shape, generator=g, dtype=F64)
    weights = torch.rand(shape, generator=g, dtype=F64) + 0.5

    def junk(x, scale):
        return torch.where(mask, x, scale * torch.randn(shape, generator=g, dtype=F64))

    for level, agg in _LEVEL_AGG:
        kw = dict(level=level, agg=agg, clip_low=0.1, clip_high=0.15, dual_clip=2.0)
        x = logp.clone().requires_grad_(True)
        loss, m = clipped_policy_loss(x, old, adv, mask, weights=weights, **kw)
        loss.backward()
        # Junk large enough that exp() of it overflows to inf: multiplying by the mask would give NaN.
        y = junk(logp, 400.0).requires_grad_(True)
        loss2, m2 = clipped_policy_loss(y, junk(old, 400.0), junk(adv, 1e4), mask, weights=junk(weights, 1e3), **kw)
        loss2.backward()
        assert loss2.item() == loss.item()
        assert torch.equal(x.grad, y.grad)
        assert (y.grad[~mask] == 0).all()
        for k in m:
            assert torch.equal(m[k], m2[k]), k


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_no_mask_equals_an_all_true_mask(seed, dtype):
    """``mask=None`` (every position counts, diffusion's stored steps) gives the losses, gradients and
    metrics of an all-True mask bit for bit, for every level/aggregation, per-sample and per-token
    advantages, weights, the dual clip, a column slice's seq_lengths and a mini-batch denominator."""
    g = torch.Generator().manual_seed(seed)
    n, width = 7, 5
    logp = torch.randn(n, width, generator=g, dtype=dtype) - 2
    old = logp + 0.3 * torch.randn(n, width, generator=g, dtype=dtype)
    everything = torch.ones(n, width, dtype=torch.bool)
    weights = torch.rand(n, width, generator=g, dtype=dtype) + 0.5
    for level, agg in _LEVEL_AGG:
        for adv in (torch.randn(n, generator=g, dtype=dtype), torch.randn(n, width, generator=g, dtype=dtype)):
            for extra in ({}, dict(weights=weights, dual_clip=2.0), dict(denominator=torch.tensor(11)),
                          dict(seq_lengths=torch.full((n,), 9)) if level == "token" else {}):
                kw = dict(level=level, agg=agg, clip_low=0.1, clip_high=0.15, **extra)
                x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
                loss, m = clipped_policy_loss(x, old, adv, everything, **kw)
                loss_none, m_none = clipped_policy_loss(y, old, adv, None, **kw)
                (loss + 0 * x.sum()).backward()
                (loss_none + 0 * y.sum()).backward()
                assert torch.equal(loss, loss_none), (level, agg, extra)
                assert torch.equal(x.grad, y.grad), (level, agg, extra)
                assert m.keys() == m_none.keys()
                for k in m:
                    assert torch.equal(m[k], m_none[k]), (k, level, agg, extra)
                metrics = policy_loss_metrics(logp, old, adv, None, level=level, clip_low=0.1, clip_high=0.15,
                                              dual_clip=extra.get("dual_clip"))
                for k in metrics:
                    assert torch.equal(metrics[k], m[k]), (k, level, agg, extra)
        values = torch.randn(n, width, generator=g, dtype=dtype)
        for extra in ({}, dict(denominator=torch.tensor(11)), dict(seq_lengths=torch.full((n,), 9)), dict(norm_length=8)):
            assert torch.equal(aggregate(values, everything, agg, **extra), aggregate(values, None, agg, **extra)), (agg, extra)


def test_weights_multiply_the_per_token_loss():
    logp, old, adv, mask = _hand_example()
    # Per-token losses from the hand example: [-1.2, 0.8, -1.1, -0.7]; weights [2, 0.5, 1, 3]:
    # (-2.4 + 0.4 - 1.1 - 2.1) / 4 = -5.2 / 4 = -1.3. Gradients of unclipped tokens scale by the weight.
    w = t([[2.0, 0.5, 1.0, 3.0, 123.0]]).requires_grad_(True)
    x = logp.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(x, old, adv, mask, weights=w)
    close(loss, -1.3)
    loss.backward()
    close(x.grad, [[0.0, 0.0, -1.1 / 4, -3 * 0.7 / 4, 0.0]])
    assert w.grad is None  # weights are detached


def test_gspo_sequence_ratio_by_hand():
    # Sequence 0 log-ratios [0.1, 0.3, (masked 5.0)] -> s0 = exp(0.2); sequence 1 [-0.4, 0, 0.1] -> s1 = exp(-0.1).
    old = torch.zeros(2, 3, dtype=F64)
    logp = t([[0.1, 0.3, 5.0], [-0.4, 0.0, 0.1]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = t([1.0, -1.0])
    _, m = clipped_policy_loss(logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean", clip_low=0.5, clip_high=0.5)
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    close(m["ratio_max"], s0)
    close(m["ratio_min"], s1)
    close(m["ratio_mean"], (2 * s0 + 3 * s1) / 5)  # mean over the 5 masked-in tokens
    # With clip bounds 0.05, s0 = 1.2214 > 1.05 and A0 > 0: both of its tokens clip; s1 = 0.905 < 0.95
    # with A1 < 0: all three clip. Per-token losses: -1.05 (sequence 0), 0.95 (sequence 1);
    # seq-mean-token-mean: (-1.05 + 0.95) / 2 = -0.05.
    loss, m = clipped_policy_loss(logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean",
                                  clip_low=0.05, clip_high=0.05)
    close(m["clip_frac"], 1.0)
    close(m["clip_frac_high"], 2 / 5)
    close(loss, -0.05)


def test_gspo_refuses_other_aggregations():
    # verl hard-codes seq-mean-token-mean for GSPO; token-mean would weight sequences by length.
    logp, old, adv, mask = _hand_example()
    for agg in AGG_MODES:
        if agg != "seq-mean-token-mean":
            with pytest.raises(ValueError, match=f"level='sequence'.*seq-mean-token-mean.*got agg='{agg}'"):
                clipped_policy_loss(logp, old, adv, mask, level="sequence", agg=agg)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_direct_sequence_level_objective(seed):
    g, mask = _random_batch(seed)
    mask[seed % mask.shape[0], 0] = True  # GSPO's sequence mean needs every sequence non-empty
    shape = mask.shape
    old = torch.randn(shape, generator=g, dtype=F64) - 2
    # A per-sequence drift of a few percent plus token noise. Sequence 0 drifts up with A > 0 (clips),
    # sequence 1 drifts up with A < 0 (does not clip); the rest are random.
    drift = 0.04 * torch.randn(shape[0], 1, generator=g, dtype=F64)
    drift[:2] = 0.08
    logp0 = old + drift + 0.01 * torch.randn(shape, generator=g, dtype=F64)
    adv = torch.randn(shape[0], generator=g, dtype=F64)
    adv[0], adv[1] = adv[0].abs(), -adv[1].abs()
    cl, ch = 0.02, 0.03  # small, so some sequences clip and some do not
    m = mask.to(F64)

    x = logp0.clone().requires_grad_(True)
    loss, metrics = clipped_policy_loss(
        x, old, adv, mask, level="sequence", agg="seq-mean-token-mean", clip_low=cl, clip_high=ch
    )
    (grad,) = torch.autograd.grad(loss, x)

    # GSPO, arXiv 2507.18071 eq. 5-7: s_i = exp(mean_t log-ratio); J = mean_i min(s_i A_i, clip(s_i) A_i).
    y = logp0.clone().requires_grad_(True)
    s = torch.exp(((y - old) * m).sum(-1) / m.sum(-1))  # [N]
    ref_loss = -torch.minimum(s * adv, s.clamp(1 - cl, 1 + ch) * adv).mean()
    (ref_grad,) = torch.autograd.grad(ref_loss, y)

    close(loss, ref_loss)
    close(grad, ref_grad)
    clipped_seqs = ((s < 1 - cl) & (adv < 0)) | ((s > 1 + ch) & (adv > 0))
    assert 0 < clipped_seqs.sum() < len(s)  # the example exercises both branches
    close(metrics["clip_frac"], (clipped_seqs.to(F64) * m.sum(-1)).sum() / m.sum(), tol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_token_gradient_with_per_token_advantages(seed):
    # GSPO-token (arXiv 2507.18071 eq. 13-17): r_t = sg[s_i] * pi_t / sg[pi_t], so with per-token
    # advantages the gradient at token t is -s_i * A_it / (N * |y_i|) where (s_i, A_it) is not clipped,
    # else 0 (agg seq-mean-token-mean). A plain broadcast of s_i (no stop-gradient trick) would instead
    # give every token of a sequence the average of these.
    g, mask = _random_batch(seed)
    mask[:, 0] = True
    shape = mask.shape
    old = torch.randn(shape, generator=g, dtype=F64) - 2
    logp = old + 0.05 * torch.randn(shape, generator=g, dtype=F64)
    adv = torch.randn(shape, generator=g, dtype=F64)
    cl, ch = 0.01, 0.01
    x = logp.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(x, old, adv, mask, level="sequence", agg="seq-mean-token-mean", clip_low=cl, clip_high=ch)
    loss.backward()
    n = shape[0]
    expected = torch.zeros(shape, dtype=F64)
    for i in range(n):
        idx = [j for j in range(shape[1]) if mask[i, j]]
        s_i = math.exp(sum(float(logp[i, j] - old[i, j]) for j in idx) / len(idx))
        for j in idx:
            a = float(adv[i, j])
            clipped = (s_i > 1 + ch and a > 0) or (s_i < 1 - cl and a < 0)
            expected[i, j] = 0.0 if clipped else -s_i * a / (n * len(idx))
    close(x.grad, expected)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_policy_loss_micro_batches_sum_to_full_batch(seed):
    g, mask = _random_batch(seed)
    shape = mask.shape
    old = torch.randn(shape, generator=g, dtype=F64) - 2
    logp = old + 0.3 * torch.randn(shape, generator=g, dtype=F64)
    adv = torch.randn(shape[0], generator=g, dtype=F64)
    for level, agg in _LEVEL_AGG:
        x = logp.clone().requires_grad_(True)
        full, _ = clipped_policy_loss(x, old, adv, mask, level=level, agg=agg)
        full.backward()
        den = aggregate_denominator(mask, agg)
        y = logp.clone().requires_grad_(True)
        total = 0.0
        for a, b in [(0, 3), (3, 4), (4, 7)]:
            part, _ = clipped_policy_loss(y[a:b], old[a:b], adv[a:b], mask[a:b], level=level, agg=agg, denominator=den)
            part.backward()
            total = total + part
        close(total, full)
        close(y.grad, x.grad)


def test_policy_loss_bad_inputs():
    logp, old, adv, mask = _hand_example()
    with pytest.raises(ValueError, match=r"logp, old_logp, mask.*old_logp \(1, 4\)"):
        clipped_policy_loss(logp, old[:, :4], adv, mask)
    with pytest.raises(ValueError, match=r"advantages.*\(3,\)"):
        clipped_policy_loss(logp, old, torch.zeros(3), mask)
    with pytest.raises(ValueError, match=r"weights \(1, 2\)"):
        clipped_policy_loss(logp, old, adv, mask, weights=torch.ones(1, 2))
    with pytest.raises(ValueError, match="clip_low"):  # the ranges are checked once, where the config loads
        AlgoConfig(clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        AlgoConfig(clip_high=-0.1)
    with pytest.raises(ValueError, match="level.*'token'.*'sequence'.*'seq'"):
        clipped_policy_loss(logp, old, adv, mask, level="seq")
    with pytest.raises(ValueError, match="agg.*'token-mean'.*'seq-mean-token-sum-norm'"):
        clipped_policy_loss(logp, old, adv, mask, agg="sum")
    with pytest.raises(ValueError, match="logp must be 2-D"):
        clipped_policy_loss(logp[0], old[0], adv[0], mask[0])
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate(logp, mask, "mean")
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate_denominator(mask, "mean")


# --------------------------------------------------------------------------------------------------
# Truncated importance sampling, entropy
# --------------------------------------------------------------------------------------------------


def test_truncated_importance_weights_by_hand():
    # old - rollout = [ln 1.5, ln 3, -ln 2, 1000] -> [1.5, min(3, 2) = 2, 0.5, 2 (no overflow)].
    old = t([[math.log(1.5), math.log(3.0), -math.log(2.0), 1000.0]]).requires_grad_(True)
    w = truncated_importance_weights(old, torch.zeros(1, 4, dtype=F64), cap=2.0)
    close(w, [[1.5, 2.0, 0.5, 2.0]])
    assert not w.requires_grad
    close(truncated_importance_weights(old, torch.zeros(1, 4, dtype=F64), cap=5.0)[0, 1], 3.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(old, old, cap=0.0)
    with pytest.raises(ValueError, match=r"old_logp.*rollout_logp \(4,\)"):
        truncated_importance_weights(old, torch.zeros(4))


def test_entropy_by_hand():
    # Uniform over 4: ln 4. One-hot (other logits -inf): 0. [0, 0, -inf]: ln 2. Huge equal logits: ln 2.
    logits = t([[0.0, 0.0, 0.0, 0.0], [3.0, -math.inf, -math.inf, -math.inf], [0.0, 0.0, -math.inf, -math.inf], [1e4, 1e4, -1e4, -1e4]])
    close(entropy_from_logits(logits), [math.log(4), 0.0, math.log(2), math.log(2)])
    x = logits.clone().requires_grad_(True)
    entropy_from_logits(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    # p = [0.5, 0.25, 0.25] from logits log p: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2.
    close(entropy_from_logits(t([math.log(0.5), math.log(0.25), math.log(0.25)])), 1.5 * math.log(2))


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_matches_categorical(seed):
    g = torch.Generator().manual_seed(seed)
    logits = 5 * torch.randn(3, 4, 11, generator=g, dtype=F64)
    want = torch.distributions.Categorical(logits=logits).entropy()
    close(entropy_from_logits(logits), want, tol=1e-12)
    got32 = entropy_from_logits(logits.float())
    assert got32.dtype == torch.float32 and got32.shape == (3, 4)
    close(got32, want.float(), tol=1e-5)
    got_bf16 = entropy_from_logits(logits.bfloat16())
    assert got_bf16.dtype == torch.float32  # the math runs in float32
    want_bf16 = torch.distributions.Categorical(logits=logits.bfloat16().double()).entropy()
    close(got_bf16, want_bf16.float(), tol=1e-5)
