"""Tool observations in a response: conditioned on, never trained.

A multi-turn rollout stores ``response_attention_mask`` (every real token) beside ``response_mask``
(the loss mask, 0 at tool observations). Junk written into the old and reference log-probs at the
holes changes neither the loss nor a gradient, bit for bit, for every ``loss_agg``; the packed and
padded layouts give the same log-probs and gradients (1e-5) on rows with holes; and the tokens in
the holes are attended (changing one changes the log-probs after it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import text_env
from unirl.core import aggregate, aggregate_denominator, clipped_policy_loss, kl_divergence

TOL = dict(rtol=1e-5, atol=1e-5)
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _holed_mask(N: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, loss mask): right-padded rows of random length, each with an observation hole."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, T + 1, (N,), generator=g)
    tokens = torch.arange(T)[None] < lengths[:, None]  # [N, T]
    loss = tokens.clone()
    for i in range(N):
        start = int(torch.randint(1, int(lengths[i]) - 2, (1,), generator=g))
        loss[i, start:start + 3] = False  # the observation: 3 tokens in the middle
    return tokens, loss


def _objective(logp, old, ref, adv, entropy, mask, mode):
    denominator = aggregate_denominator(mask, mode, norm_length=mask.shape[1])
    agg = dict(denominator=denominator, norm_length=mask.shape[1], seq_lengths=mask.sum(-1))
    loss, _ = clipped_policy_loss(logp, old, adv, mask, agg=mode, denominator=denominator,
                                  seq_lengths=mask.sum(-1), with_metrics=False)
    kl = aggregate(kl_divergence(logp, ref, estimator="k3"), mask, mode, **agg)
    ent = aggregate(entropy, mask, mode, **agg)
    return loss + 0.1 * kl - 0.01 * ent


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(3))
def test_junk_at_observations_changes_no_loss_and_no_gradient(mode, seed):
    N, T = 6, 16
    g = torch.Generator().manual_seed(100 + seed)
    _, mask = _holed_mask(N, T, seed)
    base = torch.randn(N, T, generator=g) * 0.3 - 1.0
    old = base + 0.05 * torch.randn(N, T, generator=g)
    ref = base + 0.05 * torch.randn(N, T, generator=g)
    adv = torch.randn(N, 1, generator=g).expand(N, T)
    entropy_w = torch.randn(N, T, generator=g)
    junk = 5.0 * torch.randn(N, T, generator=g)
    results = []
    for dirty in (False, True):
        logp = base.clone().requires_grad_(True)
        o = torch.where(mask, old, old + junk) if dirty else old
        r = torch.where(mask, ref, ref - junk) if dirty else ref
        a = torch.where(mask, adv, adv + junk) if dirty else adv
        loss = _objective(logp, o, r, a, entropy_w * logp, mask, mode)
        loss.backward()
        results.append((loss.detach(), logp.grad))
    (clean_loss, clean_grad), (dirty_loss, dirty_grad) = results
    assert torch.equal(clean_loss, dirty_loss)
    assert torch.equal(clean_grad, dirty_grad)
    assert torch.all(clean_grad[~mask] == 0) and clean_grad[mask].abs().sum() > 0


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _with_holes(rollout, seed: int):
    """The rollout as a multi-turn one: its tokens kept, an observation hole cut into each loss mask."""
    t = dict(rollout.tensors)
    tokens = t["response_mask"].clone()
    loss = tokens.clone()
    g = torch.Generator().manual_seed(seed)
    for i in range(loss.shape[0]):
        n = int(tokens[i].sum())
        if n >= 5:
            start = int(torch.randint(1, n - 3, (1,), generator=g))
            loss[i, start:start + 2] = 0
    t["response_attention_mask"], t["response_mask"] = tokens, loss
    return dataclasses.replace(rollout, tensors=t)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_packed_and_padded_agree_on_rows_with_holes_and_holes_are_attended(tmp_path, tiny_lm_dir):
    env = text_env(tmp_path, "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=16",
                   "trainer.micro_batch_size=16", "rollout.max_new_tokens=10", "algo.entropy_coef=0.01")
    try:
        model = env.model.train()
        rollout = _with_holes(env.sampler.rollout(env.prompts.next(0), 4), seed=0)
        mask = rollout.tensors["response_mask"]
        assert (mask != rollout.tensors["response_attention_mask"]).any()
        # trim_padding keeps the tokens after a hole (the longest row's tokens, not its trained count)
        trimmed = env.actions.trim_padding(rollout)
        assert trimmed.tensors["response_ids"].shape[1] == int(rollout.tensors["response_attention_mask"].sum(-1).max())
        w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
        results = []
        for share in (True, False):
            env.cfg.model.share_prompt = share
            out = env.actions.score_actions(model, rollout)
            ((w * out["logp"] - out["entropy"]) * mask).sum().backward()
            results.append((out, _grads(model)))
        (packed, g_packed), (padded, g_padded) = results
        keep = rollout.tensors["response_attention_mask"].bool()
        for key in ("logp", "entropy"):
            torch.testing.assert_close(packed[key][keep], padded[key][keep], **TOL)
        assert len(g_padded) > 0
        for name in g_padded:
            torch.testing.assert_close(g_packed[name], g_padded[name], **TOL, msg=name)

        # The hole's tokens are context: changing one changes the log-prob of the token after it.
        row = int(((mask == 0) & keep).any(-1).nonzero()[0])
        hole = int(((mask[row] == 0) & keep[row]).nonzero()[0])
        changed = dict(rollout.tensors)
        changed["response_ids"] = rollout.tensors["response_ids"].clone()
        changed["response_ids"][row, hole] = (changed["response_ids"][row, hole] + 1) % 10 + 3
        for share in (True, False):
            env.cfg.model.share_prompt = share
            with torch.no_grad():
                before = env.actions.score_actions(model, rollout)["logp"][row, hole + 1]
                after = env.actions.score_actions(model, dataclasses.replace(rollout, tensors=changed))["logp"][row, hole + 1]
            assert not torch.equal(before, after)
    finally:
        env.close()
