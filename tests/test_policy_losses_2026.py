"""The policy losses added in issue 50 (``unirl/core/is_weighted_losses.py``, ``smooth_ratio_losses.py``,
``covariance_losses.py``) against their references, re-typed here from the reference's code (never imported):

* verl ``verl/trainer/ppo/core_algos.py`` at verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9
  (identical for these losses to volcengine/verl b178a3cd): ``compute_policy_loss_cispo``, ``_sapo``,
  ``_geo_mean``, ``_dppo_tv``, ``_dppo_kl``, ``_clip_cov``, ``_kl_cov`` and ``agg_loss``;
* TRL ``trl/trainer/grpo_trainer.py`` (f2cd5771) for SAPO's gate (the same as verl's).

verl multiplies by the mask (``loss_mat * loss_mask``); the re-typed references below do so too, on inputs
without junk in masked positions. Each loss is compared on the same tensors (loss and gradient, float64,
several seeds, with and without rollout-correction weights), on a hand-derived case, for masked positions
changing nothing, and for micro-batch shares adding up to the mini-batch's loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core import POLICY_LOSSES, LossInputs, LossSettings, aggregate_denominator
from unirl.core.covariance_losses import ClipCovArgs, KlCovArgs
from unirl.core.is_weighted_losses import CispoArgs, DppoKlArgs, DppoTvArgs
from unirl.core.smooth_ratio_losses import GeoMeanArgs, SapoArgs

SEEDS = [0, 1, 2, 3]
EPS = 0.0  # verl's 1e-8 in a sequence's length (ref_agg's docstring)


# ---- references, re-typed from verl ------------------------------------------------------------------


def ref_agg(loss_mat, mask, mode):
    """verl ``agg_loss`` on one batch (dp_size 1, no global batch info). verl adds 1e-8 to a sequence's token
    count in ``seq-mean-token-mean`` (and GMPO's); the references here leave it out (``EPS``), so the
    comparison can be to float64 rounding: with it the figures move by about 1e-8 relative, which
    ``test_verls_length_epsilon_is_all_that_differs`` bounds."""
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_sum = (loss_mat * mask).sum(-1)
    has = (mask.sum(-1) > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-mean":
        return ((seq_sum / (mask.sum(-1) + EPS)) * has).sum() / has.sum()
    loss = (seq_sum * has).sum() / has.sum()
    return loss / mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss


def ref_cispo(old, logp, adv, mask, low, high, mode, w=None):
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    clipped = torch.clamp(ratio, 1 - low, 1 + high).detach()
    losses = -clipped * adv * logp
    return ref_agg(losses if w is None else losses * w, mask, mode)


def ref_sapo(old, logp, adv, mask, tau_pos, tau_neg, w=None):
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    taus = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    losses = -gates * adv
    return ref_agg(losses if w is None else losses * w, mask, "seq-mean-token-mean")  # verl hard-codes it


def ref_geo_mean(old, logp, adv, mask, low, high, w=None):
    mask = mask.to(logp.dtype)
    nak = logp - old
    sgn = torch.sign(adv)
    nak_clamp = torch.clamp(nak, -low, high)
    nak_min = sgn * torch.min(sgn * nak, sgn * nak_clamp)
    length = mask.sum(dim=-1)
    ratio = torch.exp((nak_min * mask).sum(dim=-1) / (length + EPS))
    advantage = (adv * mask).sum(dim=-1) / (length + EPS)
    losses = -advantage * ratio
    if w is not None:
        losses = losses * torch.exp((torch.log(w + 1e-10) * mask).sum(dim=-1) / (length + EPS))
    return torch.mean(losses)


def ref_dppo(old, logp, adv, mask, low, high, cap, kind, mode, w=None):
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    truncated = torch.clamp(ratio, max=cap).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if kind == "tv":
        pos, neg = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        pos, neg = (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob)
    valid = torch.where(adv > 0, pos, neg).detach().to(logp.dtype)
    losses = -adv * truncated * logp * valid
    return ref_agg(losses if w is None else losses * w, mask, mode)


def _masked_mean(x, m):
    return (x * m).sum() / m.sum()


def ref_clip_cov(old, logp, adv, mask, low, high, ratio_k, lb, ub, mode, w=None):
    """verl's Clip-Cov, its random choice by ``randperm`` on the global generator."""
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    corr = torch.ones_like(adv)
    by_origin = (pg2 > pg1) & (mask > 0)
    cov = (adv - _masked_mean(adv, mask)) * (logp - _masked_mean(logp.detach(), mask))
    cov[mask == 0] = -torch.inf
    cov[by_origin] = -torch.inf
    clip_num = max(int(ratio_k * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    if len(idx) > 0:
        idx = idx[torch.randperm(len(idx))[: min(clip_num, len(idx))]]
    corr[idx[:, 0], idx[:, 1]] = 0
    losses = torch.maximum(pg1, pg2) * corr
    return ref_agg(losses if w is None else losses * w, mask, mode), corr == 0


def ref_kl_cov(old, logp, adv, mask, ratio_k, coef, mode, w=None):
    nak = logp - old
    ratio = torch.exp(nak)
    pg1 = -adv * ratio
    pg_kl = -adv * ratio + coef * nak.abs()
    losses = pg1.clone()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach().reshape(-1), logp[valid].detach().reshape(-1)
    if len(a):
        cov = (a - a.mean()) * (lp - lp.mean())
        top = valid_idx[torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices]
        rows, cols = top // adv.shape[1], top % adv.shape[1]
        losses[rows, cols] = pg_kl[rows, cols]
    return ref_agg(losses if w is None else losses * w, mask, mode)


# ---- helpers -----------------------------------------------------------------------------------------


def _batch(seed, n=5, t=7, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(n, t, generator=g, dtype=torch.float64) - 0.01).requires_grad_(True)
    old = (logp.detach() + spread * torch.randn(n, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, t, generator=g) > 0.3
    mask[:, 0] = True  # every row trains a token (verl's torch.mean counts empty rows, unirl does not)
    weights = 0.5 + torch.rand(n, t, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, weights


def _run(name, logp, old, adv, mask, args=None, *, agg="token-mean", weights=None, denominator=None,
         seq_lengths=None, clip=(0.2, 0.28)):
    settings = LossSettings(clip_low=clip[0], clip_high=clip[1], loss_agg=agg, args=args)
    inputs = LossInputs({"logp": logp, "mask": mask}, adv, old_logp=old, weights=weights, denominator=denominator,
                        seq_lengths=seq_lengths)
    return POLICY_LOSSES.get(name).fn(inputs, settings)


def _assert_same(got, want, logp, rtol=1e-10):
    """Loss and gradient equal to float64 rounding."""
    g_got, = torch.autograd.grad(got, logp, retain_graph=True)
    g_want, = torch.autograd.grad(want, logp, retain_graph=True)
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=rtol, atol=1e-12)


# ---- against the references -------------------------------------------------------------------------


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", AGGS)
def test_cispo_is_verls(seed, agg):
    logp, old, adv, mask, w = _batch(seed)
    adv_t = adv[:, None].expand_as(logp)
    for args, low in ((CispoArgs(), 10.0), (CispoArgs(is_low=0.2, is_high=0.28), 0.2)):  # None: no lower bound
        for weights in (None, w):
            got, figures = _run("cispo", logp, old, adv, mask, args, agg=agg, weights=weights)
            _assert_same(got, ref_cispo(old, logp, adv_t, mask, low, args.is_high, agg, weights), logp)
            assert torch.equal(figures["loss/policy"], got.detach())


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_is_verls_and_trls(seed):
    logp, old, adv, mask, w = _batch(seed, spread=1.0)
    adv_t = adv[:, None].expand_as(logp)
    for args in (SapoArgs(), SapoArgs(tau_pos=0.5, tau_neg=2.0)):
        for weights in (None, w):
            got, _ = _run("sapo", logp, old, adv_t, mask, args, agg="seq-mean-token-mean", weights=weights)
            _assert_same(got, ref_sapo(old, logp, adv_t, mask, args.tau_pos, args.tau_neg, weights), logp)


@pytest.mark.parametrize("seed", SEEDS)
def test_geo_mean_is_verls(seed):
    logp, old, adv, mask, w = _batch(seed)
    adv_t = adv[:, None].expand_as(logp)
    for args in (GeoMeanArgs(), GeoMeanArgs(log_clip_low=0.1, log_clip_high=0.3)):
        for weights in (None, w):
            got, _ = _run("geo_mean", logp, old, adv, mask, args, agg="seq-mean-token-mean", weights=weights)
            want = ref_geo_mean(old, logp, adv_t, mask, args.log_clip_low, args.log_clip_high, weights)
            _assert_same(got, want, logp)  # verl's lengths + 1e-8 against unirl's exact lengths


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_is_verls(seed, kind):
    logp, old, adv, mask, w = _batch(seed, spread=0.8)
    adv_t = adv[:, None].expand_as(logp)
    name, cls = ("dppo_tv", DppoTvArgs) if kind == "tv" else ("dppo_kl", DppoKlArgs)
    for args in (cls(), cls(*(0.05, 0.3, 1.5))):
        low, high, cap = (getattr(args, f) for f in (f"{kind}_low", f"{kind}_high", "ratio_cap"))
        for agg in ("token-mean", "seq-mean-token-sum-norm"):  # verl's DPPO example uses the latter
            for weights in (None, w):
                got, _ = _run(name, logp, old, adv, mask, args, agg=agg, weights=weights)
                _assert_same(got, ref_dppo(old, logp, adv_t, mask, low, high, cap, kind, agg, weights), logp)
    # The masks bite on these tensors (some tokens lose their gradient, not all).
    grad, = torch.autograd.grad(_run(name, logp, old, adv, mask, cls())[0], logp)
    assert 0 < int(((grad == 0) & mask).sum()) < int(mask.sum())


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_cov_is_verls(seed):
    logp, old, adv, mask, w = _batch(seed, n=8, t=10)
    adv_t = adv[:, None].expand_as(logp)
    for args in (KlCovArgs(), KlCovArgs(kl_cov_ratio=0.1, ppo_kl_coef=1.0)):
        for agg in ("token-mean", "seq-mean-token-mean"):
            for weights in (None, w):
                got, _ = _run("kl_cov", logp, old, adv, mask, args, agg=agg, weights=weights)
                want = ref_kl_cov(old, logp, adv_t, mask, args.kl_cov_ratio, args.ppo_kl_coef, agg, weights)
                _assert_same(got, want, logp)


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_is_verls_where_the_draw_takes_every_candidate(seed):
    """With ``clip_cov_ratio`` 1 every candidate is dropped, so verl's random draw is no draw: equal."""
    logp, old, adv, mask, w = _batch(seed, n=8, t=10, spread=0.3)
    adv_t = adv[:, None].expand_as(logp)
    for lb, ub in ((-0.5, 0.5), (0.0, 5.0), (1.0, 5.0)):
        args = ClipCovArgs(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
        for weights in (None, w):
            got, _ = _run("clip_cov", logp, old, adv, mask, args, weights=weights)
            want, _ = ref_clip_cov(old, logp, adv_t, mask, 0.2, 0.28, 1.0, lb, ub, "token-mean", weights)
            _assert_same(got, want, logp)


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_drops_a_uniform_random_subset_of_verls_candidates(seed):
    """With a small share the draw is random (verl: ``randperm``; unirl: ranked uniform keys, no host sync):
    the same number of tokens is dropped, every dropped token is one of verl's candidates, the loss is verl's
    formula with those tokens' gradient removed, and over many draws every candidate is dropped about as often."""
    from unirl.core.covariance_losses import clip_cov_per_token
    from unirl.core.loss_terms import token_terms

    logp, old, adv, mask, _ = _batch(seed, n=8, t=10, spread=0.3)
    adv_t = adv[:, None].expand_as(logp)
    args = ClipCovArgs(clip_cov_ratio=0.05, clip_cov_lb=-0.5, clip_cov_ub=0.5)
    _, every = ref_clip_cov(old, logp, adv_t, mask, 0.2, 0.28, 1.0, -0.5, 0.5, "token-mean")  # all candidates
    k = max(int(0.05 * int(mask.sum())), 1)
    assert int(every.sum()) > k  # a real draw
    terms = token_terms(logp, old, adv, mask)
    counts = torch.zeros_like(logp, dtype=torch.float64)
    torch.manual_seed(seed)
    draws = 600
    for _ in range(draws):
        per_token, dropped = clip_cov_per_token(terms, 0.2, 0.28, args)
        assert int(dropped.sum()) == k and not (dropped & ~every).any()
        counts += dropped
    ratio = torch.exp(logp - old)
    kept = torch.maximum(-adv_t * ratio, -adv_t * ratio.clamp(0.8, 1.28))
    torch.testing.assert_close(per_token, torch.where(mask & ~dropped, kept, 0.0) * mask)
    share = counts[every] / draws  # each candidate's drop frequency, expected k / #candidates
    expected = k / int(every.sum())
    assert (share - expected).abs().max() < 5 * math.sqrt(expected * (1 - expected) / draws) + 1e-9


def test_verls_length_epsilon_is_all_that_differs(monkeypatch):
    """With verl's own 1e-8 in the sequence lengths the figures differ by < 1e-7 relative, no more."""
    monkeypatch.setitem(globals(), "EPS", 1e-8)
    logp, old, adv, mask, w = _batch(0)
    adv_t = adv[:, None].expand_as(logp)
    got, _ = _run("geo_mean", logp, old, adv, mask, GeoMeanArgs(), agg="seq-mean-token-mean", weights=w)
    _assert_same(got, ref_geo_mean(old, logp, adv_t, mask, 0.4, 0.4, w), logp, rtol=1e-7)
    got, _ = _run("sapo", logp, old, adv, mask, SapoArgs(), agg="seq-mean-token-mean", weights=w)
    _assert_same(got, ref_sapo(old, logp, adv_t, mask, 1.0, 1.05, w), logp, rtol=1e-7)


# ---- hand-derived cases ------------------------------------------------------------------------------


def _one(values, dtype=torch.float64):
    return torch.tensor([values], dtype=dtype)


def test_cispo_hand_case():
    # ratio 0.5 / 0.25 = 2, weight clipped at 1 + 0.2; A = 1: loss = -1.2 * log 0.5, d loss / d logp = -1.2.
    logp = _one([math.log(0.5)]).requires_grad_(True)
    loss, _ = _run("cispo", logp, _one([math.log(0.25)]), _one([1.0])[0], None, CispoArgs())
    grad, = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-1.2 * math.log(0.5)) and grad.item() == pytest.approx(-1.2)
    # No lower bound by default: ratio 0.1 weighs 0.1 (with is_low 0.2 it would weigh 0.8).
    logp = _one([math.log(0.01)]).requires_grad_(True)
    for args, weight in ((CispoArgs(), 0.1), (CispoArgs(is_low=0.2), 0.8)):
        grad, = torch.autograd.grad(_run("cispo", logp, _one([math.log(0.1)]), _one([1.0])[0], None, args)[0], logp)
        assert grad.item() == pytest.approx(-weight)


def test_sapo_hand_case():
    # On policy r = 1: f(1) = sigmoid(0) * 4 / tau = 2 / tau and f'(1) = 1, so with A = 2, tau_pos = 1 the loss
    # is -4 and d loss / d logp = -A f'(1) r = -2. For A = -2 (tau_neg = 1.05): loss 2 * 2 / 1.05, gradient 2.
    for a, loss_want, grad_want in ((2.0, -4.0, -2.0), (-2.0, 4 / 1.05, 2.0)):
        logp = _one([-0.7]).requires_grad_(True)
        loss, _ = _run("sapo", logp, _one([-0.7]), _one([a])[0], None, SapoArgs(), agg="seq-mean-token-mean")
        grad, = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(loss_want) and grad.item() == pytest.approx(grad_want)


def test_geo_mean_hand_case():
    # A = 1, token log-ratios (0.1, -0.6): PPO's pessimistic clip keeps both (clipping -0.6 to -0.4 would
    # raise the objective), mean -0.25: loss -e^-0.25, each token's gradient -e^-0.25 / 2.
    # Log-ratios (0.6, 0.0): 0.6 is clipped to 0.4 (no gradient), mean 0.2: loss -e^0.2, gradients (0, -e^0.2 / 2).
    for ratios, loss_want, grad_want in (((0.1, -0.6), -math.exp(-0.25), [-math.exp(-0.25) / 2] * 2),
                                         ((0.6, 0.0), -math.exp(0.2), [0.0, -math.exp(0.2) / 2])):
        old = _one([-1.0, -2.0])
        logp = (old + _one(list(ratios))).requires_grad_(True)
        loss, _ = _run("geo_mean", logp, old, _one([1.0])[0], None, GeoMeanArgs(), agg="seq-mean-token-mean")
        grad, = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(loss_want)
        torch.testing.assert_close(grad, _one(grad_want))


def test_dppo_hand_cases():
    old = _one([math.log(0.5)] * 4)
    probs = [0.7, 0.6, 0.3, 0.45]  # moved +0.2, +0.1, -0.2, -0.05 from 0.5
    adv = _one([1.0, 1.0, -1.0, -1.0])
    logp = torch.log(_one(probs)).requires_grad_(True)
    # TV at 0.15: +0.2 with A > 0 and -0.2 with A < 0 are out of the trust region, the others keep the
    # truncated-IS gradient -A * r (r = p / 0.5).
    grad, = torch.autograd.grad(_run("dppo_tv", logp, old, adv, None, DppoTvArgs(), agg="seq-mean-token-sum")[0], logp)
    torch.testing.assert_close(grad, _one([0.0, -1.2, 0.0, 0.9]))
    # Binary KL at 0.05: KL(0.5 || 0.7) = 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3) = 0.0872 > 0.05 (out),
    # KL(0.5 || 0.6) = 0.0204 (in), KL(0.5 || 0.3) = 0.0872 (out), KL(0.5 || 0.45) = 0.0050 (in).
    kl = lambda p: 0.5 * math.log(0.5 / p) + 0.5 * math.log(0.5 / (1 - p))  # noqa: E731
    assert kl(0.7) > 0.05 > kl(0.6) and kl(0.3) > 0.05 > kl(0.45)
    grad, = torch.autograd.grad(_run("dppo_kl", logp, old, adv, None, DppoKlArgs(), agg="seq-mean-token-sum")[0], logp)
    torch.testing.assert_close(grad, _one([0.0, -1.2, 0.0, 0.9]))
    # A token moving against its advantage's push keeps its gradient however far it moved (A > 0, p fell).
    grad, = torch.autograd.grad(_run("dppo_tv", logp, old, -adv, None, DppoTvArgs(), agg="seq-mean-token-sum")[0], logp)
    torch.testing.assert_close(grad, _one([1.4, 1.2, -0.6, -0.9]))


def test_kl_cov_hand_case():
    # Three tokens, A = (1, 0, -1), logp = (-1, -2, -3): mean A 0, mean logp -2, cov = (1, 0, 1). ratio 0.1 of
    # 3 tokens floors to 0 -> 1 token: the first of the two largest (a tie; topk breaks it arbitrarily).
    old = _one([-1.5, -2.0, -2.5])
    logp = _one([-1.0, -2.0, -3.0]).requires_grad_(True)
    adv = _one([1.0, 0.0, -1.0])
    loss, _ = _run("kl_cov", logp, old, adv, None, KlCovArgs(kl_cov_ratio=0.1, ppo_kl_coef=1.0),
                   agg="seq-mean-token-sum")
    r = [math.exp(0.5), 1.0, math.exp(-0.5)]
    assert loss.item() == pytest.approx(-r[0] + 0.5 + r[2])
    grad, = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, _one([-r[0] + 1.0, 0.0, r[2]]))


def test_clip_cov_hand_case():
    # Two tokens, A = (1, -1), logp = (-1, -3), ratio 1: mean A 0, mean logp -2, cov = (1, 1): with bounds
    # (0.5, 2) both are candidates; share 0.5 of 2 -> 1 token dropped, the other keeps -A r's gradient -A.
    logp = _one([-1.0, -3.0]).requires_grad_(True)
    torch.manual_seed(0)
    loss, _ = _run("clip_cov", logp, logp.detach(), _one([1.0, -1.0]), None,
                   ClipCovArgs(clip_cov_ratio=0.5, clip_cov_lb=0.5, clip_cov_ub=2.0), agg="seq-mean-token-sum")
    grad, = torch.autograd.grad(loss, logp)
    assert sorted(grad[0].tolist()) in ([-1.0, 0.0], [0.0, 1.0])


# ---- properties --------------------------------------------------------------------------------------


NAMES_ARGS = [("cispo", CispoArgs(), "token-mean"), ("sapo", SapoArgs(), "seq-mean-token-mean"),
              ("geo_mean", GeoMeanArgs(), "seq-mean-token-mean"), ("dppo_tv", DppoTvArgs(), "token-mean"),
              ("dppo_kl", DppoKlArgs(), "token-mean"), ("kl_cov", KlCovArgs(kl_cov_ratio=0.1), "token-mean"),
              ("clip_cov", ClipCovArgs(clip_cov_ratio=0.1, clip_cov_lb=-1.0, clip_cov_ub=1.0), "token-mean")]


@pytest.mark.parametrize("name,args,agg", NAMES_ARGS)
def test_masked_positions_change_nothing(name, args, agg):
    logp, old, adv, mask, w = _batch(5, n=6, t=8)
    adv_t = adv[:, None].expand_as(logp).clone()
    junk_logp = torch.where(mask, logp.detach(), torch.tensor(-math.inf, dtype=torch.float64)).requires_grad_(True)
    junk_old = torch.where(mask, old, 37.0)
    junk_adv = torch.where(mask, adv_t, 1e6)
    junk_w = torch.where(mask, w, math.nan)
    torch.manual_seed(1)
    clean, _ = _run(name, logp, old, adv_t, mask, args, agg=agg, weights=w)
    torch.manual_seed(1)
    junk, _ = _run(name, junk_logp, junk_old, junk_adv, mask, args, agg=agg, weights=junk_w)
    g_clean, = torch.autograd.grad(clean, logp)
    g_junk, = torch.autograd.grad(junk, junk_logp)
    assert torch.equal(clean, junk)
    assert torch.equal(g_clean, g_junk) and torch.isfinite(g_junk).all() and not g_junk[~mask].any()


TOKEN_LOSSES = [("cispo", CispoArgs()), ("sapo", SapoArgs()), ("dppo_tv", DppoTvArgs()), ("dppo_kl", DppoKlArgs()),
                # the covariance losses choose per micro-batch: with nothing to choose their shares add up too
                ("kl_cov", KlCovArgs(ppo_kl_coef=0.0)), ("clip_cov", ClipCovArgs(clip_cov_lb=1e8, clip_cov_ub=1e9))]


@pytest.mark.parametrize("name,args", TOKEN_LOSSES)
@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_and_column_shares_add_up(name, args, agg):
    """Micro-batches (rows) with the mini-batch's ``denominator``, and column pieces with the whole
    sequences' ``seq_lengths``, add up to the mini-batch's loss and gradient (with weights)."""
    logp, old, adv, mask, w = _batch(7, n=6, t=8)
    mask[4] = False  # an empty row counts in no sequence mean
    whole, _ = _run(name, logp, old, adv, mask, args, agg=agg, weights=w)
    denominator = aggregate_denominator(mask, agg)
    rows = sum(_run(name, logp[i], old[i], adv[i], mask[i], args, agg=agg, weights=w[i], denominator=denominator)[0]
               for i in (slice(0, 2), slice(2, 6)))
    _assert_same(rows, whole, logp, rtol=1e-12)
    if POLICY_LOSSES.get(name).whole_sequences:
        return
    lengths = mask.sum(-1)
    adv_t = adv[:, None].expand_as(logp)
    cols = sum(_run(name, logp[:, c], old[:, c], adv_t[:, c], mask[:, c], args, agg=agg, weights=w[:, c],
                    denominator=denominator, seq_lengths=lengths)[0] for c in (slice(0, 3), slice(3, 8)))
    _assert_same(cols, whole, logp, rtol=1e-12)


def test_geo_mean_micro_batch_shares_add_up():
    logp, old, adv, mask, w = _batch(8, n=6, t=8)
    mask[2] = False
    whole, _ = _run("geo_mean", logp, old, adv, mask, GeoMeanArgs(), agg="seq-mean-token-mean", weights=w)
    denominator = aggregate_denominator(mask, "seq-mean-token-mean")
    assert int(denominator) == 5  # the empty row is no sequence (verl's torch.mean would count it)
    rows = sum(_run("geo_mean", logp[i], old[i], adv[i], mask[i], GeoMeanArgs(), agg="seq-mean-token-mean",
                    weights=w[i], denominator=denominator)[0] for i in (slice(0, 1), slice(1, 6)))
    _assert_same(rows, whole, logp, rtol=1e-12)
    with pytest.raises(ValueError, match="geo_mean averages sequences: loss_agg must be 'seq-mean-token-mean'"):
        _run("geo_mean", logp, old, adv, mask, GeoMeanArgs())


@pytest.mark.parametrize("name,args,agg", [n for n in NAMES_ARGS if n[0] not in ("kl_cov", "clip_cov")])
def test_on_policy_gradient_is_the_policy_gradient(name, args, agg):
    """At ratio 1 (the update's first forward) every one of these losses has the vanilla policy gradient
    ``-A grad logp`` aggregated as configured (what makes them drop-in replacements)."""
    logp, _, adv, mask, _ = _batch(3)
    got, _ = _run(name, logp, logp.detach(), adv, mask, args, agg=agg)
    adv_t = adv[:, None].expand_as(logp)
    if name == "geo_mean":  # the gradient of -A_i exp(mean_t log r_t) at r = 1: -A_i / |y_i| per token
        want = (-(adv_t * logp * mask).sum(-1) / mask.sum(-1)).mean()
    else:
        want = ref_agg(-adv_t * logp, mask, agg)
    g_got, = torch.autograd.grad(got, logp)
    g_want, = torch.autograd.grad(want, logp)
    torch.testing.assert_close(g_got, g_want)


# ---- settings and config -----------------------------------------------------------------------------


@pytest.mark.parametrize("cls,field,bad", [(CispoArgs, "is_high", -0.1), (CispoArgs, "is_low", "x"),
                                           (SapoArgs, "tau_neg", 0.0), (GeoMeanArgs, "log_clip_low", -1.0),
                                           (DppoTvArgs, "tv_low", 0.0), (DppoKlArgs, "ratio_cap", -1.0),
                                           (ClipCovArgs, "clip_cov_ratio", 1.5), (KlCovArgs, "ppo_kl_coef", -0.1)])
def test_bad_settings_are_one_line(cls, field, bad):
    with pytest.raises(ValueError, match=rf"^{field} must be a number"):
        cls(**{field: bad})


def test_each_loss_is_selected_by_name_in_a_config():
    from unirl.config import load_config
    from unirl.diffusion.config import DiffusionConfig
    from unirl.text.config import TextConfig

    for name, args, agg in NAMES_ARGS:
        cfg = load_config(TextConfig, None, [f"algo.policy_loss={name}", f"algo.loss_agg={agg}"])
        assert cfg.algo.policy_loss == name and POLICY_LOSSES.get(name).settings == type(args)
    with pytest.raises(ValueError, match=r"algo.policy_loss=sapo aggregates with loss_agg=seq-mean-token-mean, as "
                                         r"verl does; got loss_agg=token-mean \(set algo.loss_agg=seq-mean-token-mean\)"):
        load_config(TextConfig, None, ["algo.policy_loss=sapo"])
    with pytest.raises(ValueError, match="algo.policy_loss=gspo aggregates with loss_agg=seq-mean-token-mean"):
        load_config(TextConfig, None, ["algo.policy_loss=gspo"])
    with pytest.raises(ValueError, match=r"algo.loss_args.tau: not a setting of the policy loss 'sapo'; its settings: "
                                         r"tau_neg, tau_pos"):
        load_config(TextConfig, None, ["algo.policy_loss=sapo", "algo.loss_agg=seq-mean-token-mean",
                                       "algo.loss_args.tau=2"])
    assert load_config(TextConfig, None, ["algo.policy_loss=cispo", "algo.loss_args.is_high=4"]).algo.loss_args == {
        "is_high": 4}
    # DPPO reads exp(logp) as a probability: a diffusion step's log-prob is a density.
    with pytest.raises(ValueError, match="algo.policy_loss=dppo_tv reads exp\\(logp\\) as a token's probability"):
        load_config(DiffusionConfig, None, ["algo.policy_loss=dppo_tv"])
    assert load_config(DiffusionConfig, None, ["algo.policy_loss=cispo"]).algo.policy_loss == "cispo"
