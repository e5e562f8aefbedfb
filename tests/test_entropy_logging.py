"""``actor/entropy`` is logged whatever ``algo.entropy_coef``: the chunked head computes it in the
update's forward, without gradient when it is not trained (the backward pass is the one without it),
and its value is the full-logits entropy."""

from __future__ import annotations

import pytest
import torch

from unirl.cli import load_run_config
from unirl.core import aggregate, entropy_from_logits
from unirl.trainer.loop import Trainer
from unirl.text.env import TextEnvironment
from unirl.text.logprobs import token_logprobs

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logged_entropy_has_no_gradient_and_leaves_the_backward_unchanged(seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    weight = torch.randn(29, 16, generator=g, requires_grad=True)
    targets = torch.randint(29, (3, 7), generator=g)
    from unirl.text.logprobs import _head_computes_logprobs

    head = torch.nn.Linear(16, 29, bias=False)
    head.weight.data.copy_(weight.detach())
    x = torch.cat([torch.zeros(3, 1, 16), hidden], dim=1)  # [n, P+R, H] with P = 1: positions 0..R-1 predict
    x = torch.cat([x, torch.zeros(3, 1, 16)], dim=1)
    grads = []
    for with_entropy in (False, True):
        with _head_computes_logprobs(head, targets, temperature=0.7, chunk_size=4, with_entropy=with_entropy,
                                     entropy_grad=False):
            out = head(x)  # [n, R, 1|2]
        if with_entropy:
            logits = (hidden.detach() @ weight.detach().t()) / 0.7
            torch.testing.assert_close(out[..., 1], entropy_from_logits(logits), **TOL)
        grads.append(torch.autograd.grad(out[..., 0].sum(), (x, head.weight)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)  # bit for bit: the entropy's term never ran
    # Trained (entropy_grad=True, the default) it does carry a gradient.
    _, entropy = token_logprobs(hidden, weight, targets, chunk_size=4, with_entropy=True)
    assert entropy.requires_grad


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_update_logs_entropy_with_entropy_coef_zero(tmp_path, tiny_lm_dir):
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=16",
        "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.progress=false", "algo.entropy_coef=0.0",
        "model.logprob_chunk_size=5",
    ], output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    try:
        env = trainer.env
        rollout = env.sampler.rollout(env.prompts.next(0), 4)
        rewards, _ = env.scorer.score(rollout)
        trainer.advantages(rollout, rewards)
        trainer.old_and_reference(rollout)  # no-grad pass: no entropy computed there
        with torch.no_grad():
            assert "entropy" not in env.actions.score_actions(env.model, rollout)  # no-grad passes and entropy_coef 0: not computed
        # The expected value from the full logits, before the update changes the weights.
        env.cfg.model.logprob_chunk_size, env.cfg.algo.entropy_coef = None, 1.0  # only to have the full path's entropy
        with torch.no_grad():
            full = env.actions.score_actions(env.model, rollout)
        env.cfg.model.logprob_chunk_size, env.cfg.algo.entropy_coef = 5, 0.0
        expected = aggregate(full["entropy"], full["mask"], "token-mean")
        metrics = trainer.update(rollout)
        assert metrics["actor/entropy"] == pytest.approx(expected.item(), rel=1e-5)
        assert metrics["actor/entropy"] > 0.1
    finally:
        trainer.env.close()
