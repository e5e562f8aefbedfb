"""Rollout correction (unirl/core/rollout_correction.py) against TRL's ``vllm_importance_sampling_mode``
and verl's ``rollout_corr_helper`` formulas, re-typed here from their sources, over several seeds, and
by hand; the mismatch figures against verl's ``compute_offpolicy_metrics``."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core import clipped_policy_loss, rollout_is_weights, rollout_mismatch_metrics, truncated_importance_weights
from unirl.config.schema import AlgoConfig

SEEDS = [0, 1, 2, 3, 4]
F64 = torch.float64


def _trl(old, sampling, mask, mode, clip_max, clip_min):
    """TRL ``_generate_and_score_completions``: the vLLM importance-sampling ratio [N, T] or [N, 1]."""
    diff = (old - sampling) * mask
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def _inputs(seed, n=6, t=9, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(n, t, generator=g, dtype=F64)
    rollout = old + spread * torch.randn(n, t, generator=g, dtype=F64)
    mask = torch.rand(n, t, generator=g) < 0.8
    mask[:, 0] = True
    return old, rollout, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("low", [None, 0.5])
def test_weights_are_trls(seed, mode, low):
    old, rollout, mask = _inputs(seed)
    ours = rollout_is_weights(old, rollout, mask, mode=mode, high=1.5, low=low)
    expected = _trl(old, rollout, mask.double(), mode, 1.5, low).expand_as(old)
    torch.testing.assert_close(ours, expected)
    if mode.endswith("mask"):  # the check can fail: something was rejected and something kept
        assert (ours[mask] == 0).any() and (ours[mask] != 0).any()


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_truncate_is_verls_seq_tis(seed):
    """verl ``compute_rollout_correction_weights(rollout_is="sequence")``: exp of the masked sum of
    log-ratios (kept within +-20), times the mask, truncated above at the threshold."""
    old, rollout, mask = _inputs(seed, spread=0.5)
    m = mask.double()
    log_sum = ((old - rollout) * m).sum(-1, keepdim=True).clamp(-20, 20)
    expected = (torch.exp(log_sum).expand_as(old) * m).clamp(max=2.0)
    ours = rollout_is_weights(old, rollout, mask, mode="sequence_truncate", high=2.0)
    torch.testing.assert_close(ours * m, expected)


def _verl_seq_sum_k1_keeps(old, rollout, mask, spec):
    """verl ``compute_rollout_rejection_mask(rollout_rs="seq_sum_k1", rollout_rs_threshold=spec)``, re-typed
    (``verl/trainer/ppo/rollout_corr_helper.py`` at verl-project/verl 1dda039b): ``log_ratio = old - rollout``
    clamped to +-20, ``token_k1 = -log_ratio``, the sequence's masked sum kept within ``[log a, log b]`` for
    ``spec = "a_b"``. [N] bool."""
    lower, upper = (float(x) for x in spec.split("_"))
    token_k1 = -torch.clamp(old - rollout, min=-20.0, max=20.0)
    seq = (token_k1 * mask).sum(-1)
    return (seq >= math.log(lower)) & (seq <= math.log(upper))


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_mask_bounds_the_ratio_where_verls_seq_sum_k1_bounds_its_inverse(seed):
    """The convention, pinned: ``sequence_mask`` keeps a sequence when ``low <= prod rho <= high`` (TRL's,
    and verl's sequence IcePop); verl's ``seq_sum_k1`` rejection with ``"a_b"`` keeps ``a <= 1/prod rho <= b``,
    so it is ``low = 1/b, high = 1/a`` here; with asymmetric bounds the same numbers keep other sequences."""
    old, rollout, mask = _inputs(seed, n=40, spread=0.15)
    kept = rollout_is_weights(old, rollout, mask, mode="sequence_mask", high=2.0, low=0.8)[:, 0] > 0  # [N]
    assert torch.equal(kept, _verl_seq_sum_k1_keeps(old, rollout, mask.double(), "0.5_1.25"))  # 1/2, 1/0.8
    assert not torch.equal(kept, _verl_seq_sum_k1_keeps(old, rollout, mask.double(), "0.8_2.0"))
    # verl's symmetric default "0.5_2.0" is the same set either way.
    sym = rollout_is_weights(old, rollout, mask, mode="sequence_mask", high=2.0, low=0.5)[:, 0] > 0
    assert torch.equal(sym, _verl_seq_sum_k1_keeps(old, rollout, mask.double(), "0.5_2.0"))
    assert kept.any() and not kept.all()


def test_by_hand():
    # log-ratios [ln 1.5, ln 3, -ln 2]; bounds [0.6, 2].
    old = torch.tensor([[math.log(1.5), math.log(3.0), -math.log(2.0)]], dtype=F64)
    zero = torch.zeros_like(old)
    w = lambda mode: rollout_is_weights(old, zero, None, mode=mode, high=2.0, low=0.6)  # noqa: E731
    torch.testing.assert_close(w("token_truncate"), torch.tensor([[1.5, 2.0, 0.6]], dtype=F64))
    torch.testing.assert_close(w("token_mask"), torch.tensor([[1.5, 0.0, 0.0]], dtype=F64))
    # The product 1.5 * 3 * 0.5 = 2.25: truncated to 2 at every token, or the whole sequence rejected.
    torch.testing.assert_close(w("sequence_truncate"), torch.full((1, 3), 2.0, dtype=F64))
    torch.testing.assert_close(w("sequence_mask"), torch.zeros(1, 3, dtype=F64))
    # A masked-out token adds nothing to the product: 1.5 * 0.5 = 0.75 without the second, kept.
    assert rollout_is_weights(old, zero, torch.tensor([[True, False, True]]), mode="sequence_mask",
                              high=2.0)[0, 0] == pytest.approx(0.75)
    # No overflow: a log-ratio of 1000 truncates to the cap, and the mask rejects it.
    huge = torch.tensor([[1000.0]], dtype=F64)
    assert rollout_is_weights(huge, torch.zeros(1, 1, dtype=F64), None, mode="sequence_truncate", high=3.0).item() == 3.0
    assert rollout_is_weights(huge, torch.zeros(1, 1, dtype=F64), None, mode="token_mask", high=3.0).item() == 0.0
    # The token_truncate mode is the former TIS weights.
    torch.testing.assert_close(truncated_importance_weights(old, zero, cap=2.0),
                               rollout_is_weights(old, zero, None, mode="token_truncate", high=2.0))


def test_a_rejected_sequence_gets_no_gradient():
    old, rollout, mask = _inputs(3, n=4, t=5, spread=0.0)
    rollout[1] += 2.0  # sequence 1's product is e^-10 (far below C_min) with every token off the engine
    weights = rollout_is_weights(old, rollout, mask, mode="sequence_mask", high=3.0, low=0.5)
    assert (weights[1] == 0).all() and (weights[[0, 2, 3]] == 1).all()
    logp = old.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(logp, old, torch.ones(4, dtype=F64), mask, weights=weights)
    loss.backward()
    assert (logp.grad[1] == 0).all() and (logp.grad[0][mask[0]] != 0).all()


def _verl_offpolicy(old, rollout, mask):
    """verl ``compute_offpolicy_metrics`` (the figures unirl logs)."""
    m = mask.double()

    def masked_mean(x, axis=None):
        return (x * m).sum() / m.sum() if axis is None else (x * m).sum(axis) / m.sum(axis)

    mean_train, mean_rollout = masked_mean(old, -1), masked_mean(rollout, -1)
    log_ratio = old - rollout
    return {
        "mismatch_kl": masked_mean(rollout - old),
        "mismatch_k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1),
        "training_ppl": torch.exp(-mean_train).mean(),
        "rollout_ppl": torch.exp(-mean_rollout).mean(),
        "ppl_ratio": torch.exp(mean_rollout - mean_train).mean(),
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_figures_are_verls(seed):
    old, rollout, mask = _inputs(seed)
    ours = rollout_mismatch_metrics(old, rollout, mask)
    for name, value in _verl_offpolicy(old, rollout, mask).items():
        torch.testing.assert_close(ours[name], value, msg=name)
    assert ours["mismatch_k3_kl"] > 0 and ours["ppl_ratio"] != 1
    weights = rollout_is_weights(old, rollout, mask, mode="token_mask", high=1.2, low=0.8)
    more = rollout_mismatch_metrics(old, rollout, mask, weights)
    torch.testing.assert_close(more["is_mean"], weights[mask].mean())
    torch.testing.assert_close(more["is_zero_frac"], (weights[mask] == 0).double().mean().to(more["is_zero_frac"].dtype))


def test_config_checks_the_lower_bound():
    assert AlgoConfig().rollout_is == "token_truncate"
    with pytest.raises(ValueError, match="rollout_is_min must be in"):
        AlgoConfig(tis_cap=2.0, rollout_is_min=3.0)
    with pytest.raises(ValueError, match="rollout_is_min must be in"):
        AlgoConfig(tis_cap=2.0, rollout_is_min=0.0)


# ------------------------------------------------ bypass mode: the ratio against the behaviour policy
def _async_grpo_loss(logp, engine_logp, advantages, mask, clip_low, clip_high):
    """TRL ``AsyncGRPOTrainer.compute_loss`` (verl's bypass ``ppo_clip``), re-typed: the ratio is taken
    against the sampler's log-probs, ``-min(r A, clamp(r, 1 - eps_low, 1 + eps_high) A)``, token-mean."""
    coef_1 = torch.exp(logp - engine_logp)
    coef_2 = torch.clamp(coef_1, 1 - clip_low, 1 + clip_high)
    per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return (per_token * mask).sum() / mask.sum()


def test_bypass_mode_resolves_from_the_staleness():
    from unirl.config import load_config
    from unirl.config.schema import SourceConfig
    from unirl.diffusion.config import DiffusionConfig
    from unirl.diffusion.env import DiffusionEnvironment
    from unirl.rollout.sources import resolve_bypass_mode

    assert resolve_bypass_mode(SourceConfig(), None) is False  # the synchronous loop: verl's decoupled default
    assert resolve_bypass_mode(SourceConfig(max_staleness=1), None) is True  # sampled ahead: TRL's AsyncGRPO anchor
    assert resolve_bypass_mode(SourceConfig(max_staleness=2, bypass_mode=False), None) is False
    assert resolve_bypass_mode(SourceConfig(bypass_mode=True), None) is True
    with pytest.raises(ValueError, match="source.bypass_mode=true: DiffusionEnvironment samples with the policy itself"):
        resolve_bypass_mode(SourceConfig(bypass_mode=True), DiffusionEnvironment(load_config(DiffusionConfig, None, [])))


def test_bypass_mode_loss_and_gradient_are_trls_async_grpo(tmp_path, tiny_lm_dir):
    """A batch sampled by older weights: in bypass mode the trainer's loss and gradient are TRL AsyncGRPO's
    (the ratio against the engine's log-probs, clipped), not the decoupled loss (ratio 1 against the
    trainer's own first forward, times the TIS weight), which is checked to differ."""
    from unirl.cli import load_run_config
    from unirl.text.env import TextEnvironment
    from unirl.trainer.loop import Trainer
    from unirl.trainer.update import micro_loss, mini_denominator

    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=16",
        "trainer.micro_batch_size=16", "trainer.eval_every=0", "trainer.progress=false", "algo.loss_agg=token-mean",
        "source.bypass_mode=true", "algo.tis_cap=2.0", "algo.clip_high=0.28", "model.share_prompt=false",
    ], output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    try:
        env, model = trainer.env, trainer.env.model
        rollout = env.sampler.rollout(env.prompts.next(0), 4)  # engine_logp: the weights before the move below
        rewards, _ = env.scorer.score(rollout)
        trainer.advantages(rollout, rewards + torch.linspace(0, 1, len(rollout)))  # groups that vary
        with torch.no_grad():  # the trainer's weights move on, as one update would: the batch is now stale
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.device))
        micro = env.actions.trim_padding(rollout)
        assert micro.old_logp is None  # on-policy layout: the trainer's own log-probs come from this forward

        def loss_and_grads(bypass: bool):
            trainer.bypass_mode = bypass
            loss, _, figures = micro_loss(trainer, model, micro, mini_denominator(trainer, micro))
            loss.backward()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return loss.detach(), grads, figures

        loss, grads, figures = loss_and_grads(True)
        out = env.actions.score_actions(model, micro)
        device = out["logp"].device
        mask = out["mask"].to(out["logp"].dtype)
        engine_logp = micro.engine_logp.to(device)
        ratio = torch.exp(out["logp"].detach() - engine_logp)[out["mask"].bool()]
        assert ((ratio < 0.8) | (ratio > 1.28)).any()  # some tokens are outside the clip: it acts
        expected = _async_grpo_loss(out["logp"], engine_logp, micro.advantages.to(device).unsqueeze(-1), mask,
                                    trainer.algo.clip_low, trainer.algo.clip_high)
        expected.backward()
        expected_grads = [p.grad.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(figures["old_logp"], engine_logp[:, : figures["old_logp"].shape[1]])

        decoupled, _, _ = loss_and_grads(False)
        assert abs(decoupled.item() - loss.item()) > 1e-4
    finally:
        trainer.env.close()
