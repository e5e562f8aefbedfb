"""PPO's math in unirl.core and unirl.trainer.kl_control: rewards on tokens, the KL penalty in the reward and
its controllers, GAE, REINFORCE++'s returns and the clipped value loss.

Each is checked against the reference's formula re-typed here as plain Python loops over floats
(verl's ``compute_gae_advantage_return``, ``compute_reinforce_plus_plus_outcome_advantage``,
``apply_kl_penalty``, ``AdaptiveKLController``, ``compute_value_loss``), over several seeds, and
against values derived by hand in the comments.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from unirl.core import (compute_advantages, discounted_returns, estimate_advantages, explained_variance,
                        gae_advantages, kl_penalized_rewards, token_scores, value_loss)
from unirl.trainer.kl_control import AdaptiveKLController, FixedKLController, build_kl_controller

F64 = torch.float64
SEEDS = range(5)


def close(actual, expected, tol=1e-12):
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=tol)


def _random_batch(rng: random.Random, holes: bool):
    """Rows of random length (some empty), masks right-padded, with holes inside some responses."""
    n, T = rng.randint(2, 6), rng.randint(2, 9)
    rewards = [[rng.uniform(-2, 2) for _ in range(T)] for _ in range(n)]
    values = [[rng.uniform(-2, 2) for _ in range(T)] for _ in range(n)]
    mask = []
    for _ in range(n):
        length = rng.randint(0, T)
        row = [t < length for t in range(T)]
        if holes:
            row = [m and rng.random() > 0.3 for m in row]
        mask.append(row)
    mask[0] = [True] * T  # at least two trained tokens for the whitening
    return rewards, values, mask


def _whiten(rows, mask):
    """verl's masked_whiten over floats: unbiased variance over the masked-in entries, + 1e-8."""
    xs = [x for row, m in zip(rows, mask) for x, k in zip(row, m) if k]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) if k else 0.0 for x, k in zip(row, m)] for row, m in zip(rows, mask)]


def _gae_loop(rewards, values, mask, gamma, lam):
    """verl's reversed loop, one sequence at a time: masked positions carry the next value and the
    running advantage through unchanged."""
    advantages, returns = [], []
    for r, v, m in zip(rewards, values, mask):
        next_value, running = 0.0, 0.0
        adv = [0.0] * len(r)
        for t in reversed(range(len(r))):
            delta = r[t] + gamma * next_value - v[t]
            candidate = delta + gamma * lam * running
            if m[t]:
                next_value, running = v[t], candidate
                adv[t] = candidate
        advantages.append(adv)
        returns.append([a + x if k else 0.0 for a, x, k in zip(adv, v, m)])
    return _whiten(advantages, mask), returns


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_the_reversed_loop(seed, holes):
    rng = random.Random(seed)
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)]:
        rewards, values, mask = _random_batch(rng, holes)
        adv, ret = gae_advantages(torch.tensor(rewards, dtype=F64), torch.tensor(values, dtype=F64),
                                  torch.tensor(mask), gamma=gamma, lam=lam)
        ref_adv, ref_ret = _gae_loop(rewards, values, mask, gamma, lam)
        close(adv, ref_adv, tol=1e-9)
        close(ret, ref_ret, tol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_special_cases(seed):
    rng = random.Random(100 + seed)
    rewards, values, mask = _random_batch(rng, holes=False)
    r, v, m = torch.tensor(rewards, dtype=F64), torch.tensor(values, dtype=F64), torch.tensor(mask)
    # gamma = lam = 1: the returns are the reward-to-go over the trained tokens (values cancel).
    _, ret = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    to_go = [[sum(x for x, k in zip(row[t:], mrow[t:]) if k) if mrow[t] else 0.0 for t in range(len(row))]
             for row, mrow in zip(rewards, mask)]
    close(ret, to_go, tol=1e-12)
    # lam = 0: the advantages (before whitening) are one-step TD errors r_t + gamma V_{t+1} - V_t.
    gamma = 0.9
    _, ret = gae_advantages(r, v, m, gamma=gamma, lam=0.0)
    td = [[(row[t] + gamma * (vrow[t + 1] if t + 1 < len(row) and mrow[t + 1] else 0.0) - vrow[t]) if mrow[t] else 0.0
           for t in range(len(row))] for row, vrow, mrow in zip(rewards, values, mask)]
    close(ret - torch.where(m, v, 0.0), td, tol=1e-12)


def test_gae_hole_passes_values_over_observation_tokens_by_hand():
    # One row [r0, obs, r2] with mask [1, 0, 1], values [1, 99, 2], rewards [0, 5, 1], gamma 0.5, lam 1.
    # t=2: delta = 1 + 0 - 2 = -1, A2 = -1.
    # t=1 (masked): skipped; the 99 and the reward 5 there reach nothing.
    # t=0: delta = 0 + 0.5 * V2 - V0 = 1 - 1 = 0; A0 = 0 + 0.5 * A2 = -0.5.
    # Returns: A0 + V0 = 0.5, A2 + V2 = 1. A second row of zeros gives the whitening something to
    # compare with; the raw advantages are checked through the returns.
    r = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    v = torch.tensor([[1.0, 99.0, 2.0], [0.0, 0.0, 0.0]], dtype=F64)
    m = torch.tensor([[True, False, True], [True, True, True]])
    adv, ret = gae_advantages(r, v, m, gamma=0.5, lam=1.0)
    close(ret[0], [0.5, 0.0, 1.0])
    assert adv[0, 1] == 0.0
    # Whitened over 5 trained tokens: raw [-0.5, -1, 0, 0, 0], mean -0.3.
    raw = [-0.5, -1.0, 0.0, 0.0, 0.0]
    mean = sum(raw) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 4 + 1e-8)
    close(adv[0, [0, 2]], [(-0.5 - mean) / std, (-1.0 - mean) / std])


def test_gae_whitening_is_over_the_whole_input():
    # Two halves whitened separately differ from the whole: the trainer passes the global batch.
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(8, 5, generator=g, dtype=F64), torch.randn(8, 5, generator=g, dtype=F64)
    m = torch.ones(8, 5, dtype=torch.bool)
    whole, _ = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    half, _ = gae_advantages(r[:4], v[:4], m[:4], gamma=1.0, lam=1.0)
    close(torch.where(m, whole, 0.0).sum(), 0.0, tol=1e-9)
    assert (whole[:4] - half).abs().max() > 1e-3


def _discounted_loop(rewards, mask, gamma):
    out = []
    for r, m in zip(rewards, mask):
        running, row = 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            running = r[t] + gamma * running
            row[t] = running if m[t] else 0.0
            if not m[t]:
                running = 0.0  # verl resets the running return after a masked position
        out.append(row)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_matches_the_reversed_loop(seed):
    rng = random.Random(200 + seed)
    for gamma in (1.0, 0.9):
        rewards, _, mask = _random_batch(rng, holes=seed % 2 == 1)
        r, m = torch.tensor(rewards, dtype=F64), torch.tensor(mask)
        ref = _discounted_loop(rewards, mask, gamma)
        close(discounted_returns(r, m, gamma=gamma), ref, tol=1e-12)
        adv, returns = estimate_advantages("reinforce++", r.sum(-1), torch.arange(len(r)), mask=m, token_rewards=r,
                                           gamma=gamma)
        assert returns is None
        close(adv, _whiten(ref, mask), tol=1e-9)


def test_token_scores_sit_on_the_last_trained_token():
    # Rows: length 3 of 4; a hole at 1 with the last trained token at 2; an empty response (column 0).
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    scores = torch.tensor([2.0, -1.0, 0.5])
    close(token_scores(scores, mask), [[0, 0, 2.0, 0], [0, 0, -1.0, 0], [0.5, 0, 0, 0]])


@pytest.mark.parametrize("seed", SEEDS)
def test_outcome_estimators_give_todays_numbers_from_token_scores(seed):
    # The trainer passes the row sums of the token scores as ``rewards``: bit for bit the scores.
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(12, generator=g)
    ids = torch.arange(12) // 4
    mask = torch.rand(12, 7, generator=g) > 0.3
    tokens = token_scores(scores, mask)
    assert torch.equal(tokens.sum(-1), scores)
    for name in ("grpo", "rloo", "reinforce++-baseline"):
        today = compute_advantages(name, scores, ids, mask=mask)
        assert torch.equal(compute_advantages(name, tokens.sum(-1), ids, mask=mask, token_rewards=tokens), today)


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_in_the_reward_matches_verls_formula(seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(5, 6, generator=g) > 0.3
    mask[0] = False  # an empty response: no penalty, KL 0
    scores = token_scores(torch.randn(5, generator=g, dtype=F64), mask)
    kl = torch.randn(5, 6, generator=g, dtype=F64)
    beta = 0.05
    rewards, seq_kl = kl_penalized_rewards(scores, kl, mask, beta)
    for i in range(5):
        trained = [kl[i, t].item() for t in range(6) if mask[i, t]]
        close(seq_kl[i], sum(trained) / len(trained) if trained else 0.0)
        for t in range(6):
            expected = scores[i, t].item() - (beta * kl[i, t].item() if mask[i, t] else 0.0)
            close(rewards[i, t], expected)


def test_controllers_by_hand_over_a_kl_sequence():
    # Adaptive, target 0.1, horizon 1000, 100 sequences a step, beta 0.2:
    #   KL 0.3: error clip(3 - 1) = 0.2 -> beta * (1 + 0.2 * 0.1) = 0.2 * 1.02 = 0.204
    #   KL 0.1: error 0                  -> 0.204
    #   KL 0.05: error -0.5 -> -0.2      -> 0.204 * 0.98 = 0.19992
    #   KL 0.11: error 0.1              -> 0.19992 * 1.01 = 0.2019192
    ctrl = build_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=1000)
    assert isinstance(ctrl, AdaptiveKLController)
    expected = [0.204, 0.204, 0.19992, 0.2019192]
    for kl, value in zip([0.3, 0.1, 0.05, 0.11], expected):
        ctrl.update(kl, n=100)
        assert ctrl.value == pytest.approx(value, rel=1e-12, abs=0)
    fixed = build_kl_controller("fixed", kl_coef=0.2, target_kl=0.1, horizon=1000)
    assert type(fixed) is FixedKLController
    for kl in (0.3, 0.0, 5.0):
        fixed.update(kl, n=100)
    assert fixed.value == 0.2
    with pytest.raises(ValueError, match="unknown KL controller 'adaptiv'.*adaptive"):
        build_kl_controller("adaptiv", kl_coef=0.2, target_kl=0.1, horizon=1000)


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_controller_matches_the_loop_and_resumes_exactly(seed):
    rng = random.Random(300 + seed)
    kls = [rng.uniform(0, 0.5) for _ in range(20)]
    beta, target, horizon, n = 0.1, 0.15, 500, 64
    ctrl = AdaptiveKLController(beta, target, horizon)
    for k, kl in enumerate(kls):
        beta *= 1 + min(max(kl / target - 1, -0.2), 0.2) * n / horizon
        ctrl.update(kl, n)
        if k == 9:  # a checkpoint in the middle, through JSON as loop.json stores it
            import json

            resumed = AdaptiveKLController(0.1, target, horizon)
            resumed.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))
            ctrl = resumed
        assert ctrl.value == beta


def _value_loss_loop(v, old, ret, mask, clip):
    """verl's compute_value_loss with token-mean over floats: (loss, clip fraction)."""
    losses, clipped_count, count = 0.0, 0, 0
    for vr, orow, rr, mr in zip(v, old, ret, mask):
        for x, o, r, m in zip(vr, orow, rr, mr):
            if not m:
                continue
            xc = min(max(x, o - clip), o + clip)
            l1, l2 = (x - r) ** 2, (xc - r) ** 2
            losses += max(l1, l2)
            clipped_count += l2 > l1
            count += 1
    return 0.5 * losses / count, clipped_count / count


def test_value_loss_by_hand():
    # v = [1.0, 0.0], old = [0.0, 0.0], returns = [2.0, -1.0], clip 0.5.
    # Token 0: clip(1, -0.5, 0.5) = 0.5; (1 - 2)^2 = 1, (0.5 - 2)^2 = 2.25 -> 2.25, clipped.
    # Token 1: v = old, clip changes nothing: (0 + 1)^2 = 1 both -> 1, not clipped (strictly larger only).
    # token-mean: 0.5 * (2.25 + 1) / 2 = 0.8125; clip fraction 1/2; vpred mean 0.5.
    v = torch.tensor([[1.0, 0.0]], dtype=F64, requires_grad=True)
    loss, metrics = value_loss(v, torch.zeros(1, 2, dtype=F64), torch.tensor([[2.0, -1.0]], dtype=F64),
                               torch.ones(1, 2, dtype=torch.bool), clip=0.5)
    close(loss, 0.8125)
    close(metrics["vf_clipfrac"], 0.5)
    close(metrics["vpred_mean"], 0.5)
    loss.backward()
    # Token 0's clipped term wins: no gradient through v there; token 1: 0.5 * 2 (v - R) / 2 = 0.5.
    close(v.grad, [[0.0, 0.5]])


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_verls_formula(seed):
    g = torch.Generator().manual_seed(seed)
    v, old, ret = (torch.randn(4, 6, generator=g, dtype=F64) for _ in range(3))
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[0, 0] = True
    v_junk = torch.where(mask, v, torch.tensor(1e6, dtype=F64))  # junk at masked positions changes nothing
    loss, metrics = value_loss(v_junk, old, ret, mask, clip=0.3)
    ref_loss, ref_frac = _value_loss_loop(v.tolist(), old.tolist(), ret.tolist(), mask.tolist(), 0.3)
    close(loss, ref_loss)
    close(metrics["vf_clipfrac"], ref_frac)
    # Micro-batch shares with the mini-batch's denominator add up to the whole.
    from unirl.core import aggregate_denominator

    den = aggregate_denominator(mask, "token-mean")
    parts = sum(value_loss(v[i:i + 2], old[i:i + 2], ret[i:i + 2], mask[i:i + 2], clip=0.3, denominator=den)[0]
                for i in (0, 2))
    close(parts, ref_loss)


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), -float("inf")])
def test_value_loss_non_finite_at_masked_positions_reaches_no_gradient(junk):
    """A hand-made batch whose masked positions hold NaN / inf in the values, the old values and the
    returns: the loss, its figures and the gradient are those of the masked-in positions alone."""
    # Row 0: token 0 in, token 1 out; row 1: token 0 out, token 1 in. The masked-in values as in
    # test_value_loss_by_hand: v = [1.0, 0.0], old 0, returns [2.0, -1.0] -> loss 0.8125, grad [0, 0.5].
    mask = torch.tensor([[True, False], [False, True]])
    v = torch.tensor([[1.0, junk], [junk, 0.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, junk], [junk, 0.0]], dtype=F64)
    ret = torch.tensor([[2.0, junk], [junk, -1.0]], dtype=F64)
    loss, metrics = value_loss(v, old, ret, mask, clip=0.5)
    close(loss, 0.8125)
    close(metrics["vf_clipfrac"], 0.5)
    close(metrics["vpred_mean"], 0.5)
    loss.backward()
    close(v.grad, [[0.0, 0.0], [0.0, 0.5]])  # finite everywhere: masked positions get exactly 0


def test_explained_variance_by_hand():
    # returns [1, 2, 3, 4] (var 5/3); values = returns: 1; values = mean 2.5: 1 - (5/3)/(5/3 + 1e-5).
    ret = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    close(explained_variance(ret, ret, mask), 1.0)
    close(explained_variance(torch.full_like(ret, 2.5), ret, mask), 1 - (5 / 3) / (5 / 3 + 1e-5))
    # A masked-out position is ignored whatever it holds.
    mask[1, 1] = False
    junk = ret.clone()
    junk[1, 1] = 100.0
    close(explained_variance(junk, ret, mask), 1.0)
