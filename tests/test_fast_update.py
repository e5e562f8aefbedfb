"""The update's shortcuts give the same update as the long way round (tiny text model, HF engine).

1. On-policy (one mini-batch, one epoch) the old log-probs come from the update's first forward
   (detached) instead of a separate pass: same loss, gradients, TIS weights and ``rollout/*``.
2. Micro-batches by token budget, each padded only to its own longest sample: same loss and
   gradients as fixed-size micro-batches padded to the step's longest response.
"""

from __future__ import annotations

import copy

import pytest
import torch

from unirl.cli import load_run_config
from unirl.env import Rollout
from unirl.trainer.logprobs import rollout_metrics, score_all
from unirl.trainer.loop import Trainer
from unirl.text.env import TextEnvironment


def _trainer(tmp_path, name: str, *overrides: str) -> Trainer:
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "rollout.max_new_tokens=12", "trainer.prompts_per_step=4", "trainer.group_size=4",
        "trainer.mini_batch_size=16", "trainer.micro_batch_size=16", "trainer.eval_every=0", "trainer.progress=false",
        "optim.max_grad_norm=null", "optim.lr=1e-3", *overrides,
    ], output_dir=str(tmp_path / name))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    return trainer


def _update_with_grads(trainer: Trainer, rollout: Rollout) -> tuple[dict, list[torch.Tensor]]:
    """``update``, keeping a copy of the accumulated gradient at its (single) optimizer step."""
    grads: list[list[torch.Tensor]] = []
    step = trainer.backend.clip_and_step  # the optimizer step every update takes

    def recording_step(*args, **kwargs):
        grads.append([p.grad.detach().clone() for p in trainer.env.model.parameters() if p.requires_grad])
        return step(*args, **kwargs)

    trainer.backend.clip_and_step = recording_step
    metrics = trainer.update(rollout)
    assert len(grads) == 1
    return metrics, grads[0]


def _scored_rollout(trainer: Trainer) -> Rollout:
    rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), 4)
    rewards, _ = trainer.env.scorer.score(rollout)
    if rewards.std() == 0:  # the group advantages must not all be zero: spread the rewards by hand
        rewards = torch.linspace(0, 1, len(rollout))
    trainer.advantages(rollout, rewards)
    return rollout


def _same_weights(a: Trainer, b: Trainer) -> None:
    for p, q in zip(a.env.model.parameters(), b.env.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_on_policy_update_takes_old_logprobs_from_its_first_forward(tmp_path, tiny_lm_dir, kl):
    overrides = (f"algo.kl_coef={kl}", "algo.tis_cap=1.5", "trainer.micro_batch_size=4")
    skipped, separate = _trainer(tmp_path, "skip", *overrides), _trainer(tmp_path, "separate", *overrides)
    try:
        _same_weights(skipped, separate)
        rollout = _scored_rollout(skipped)
        # An engine that disagrees with the trainer, so the TIS weights min(exp(old - engine), 1.5)
        # vary per token and depend on the old log-probs.
        noise = 0.5 * torch.randn(rollout.engine_logp.shape, generator=torch.Generator().manual_seed(0))
        rollout.engine_logp = (rollout.engine_logp + noise) * rollout.tensors["response_mask"]
        by_hand = copy.deepcopy(rollout)

        # The skipped path: old_and_reference leaves the old log-probs to the update.
        assert skipped.old_and_reference(rollout) == {}
        assert rollout.old_logp is None
        assert ("logp" in rollout.ref) == (kl > 0)  # the reference still has its own pass
        m_skip, g_skip = _update_with_grads(skipped, rollout)

        # The separate pass, by hand, on the same weights and batch.
        with torch.no_grad():
            by_hand.old_logp = score_all(separate.ctx, separate.env.model, by_hand)["logp"]
        m_rollout = rollout_metrics(separate, by_hand)
        if kl > 0:
            with separate.env.models.reference() as ref, torch.no_grad():
                by_hand.ref["logp"] = score_all(separate.ctx, ref, by_hand)["logp"]
        m_sep, g_sep = _update_with_grads(separate, by_hand)

        mask = rollout.tensors["response_mask"].bool()
        torch.testing.assert_close(rollout.old_logp[mask], by_hand.old_logp[mask],
                                   rtol=1e-5, atol=1e-5)
        assert max(g.abs().max().item() for g in g_sep) > 1e-4
        for a, b in zip(g_skip, g_sep):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        for key in ("loss/policy", "loss/total", "actor/ratio_min", "actor/ratio_max") + (("loss/kl",) if kl else ()):
            assert m_skip[key] == pytest.approx(m_sep[key], rel=1e-4, abs=1e-6), key
        assert m_skip["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6)
        for key, value in m_rollout.items():  # logged by update on the skipped path
            assert m_skip[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
        assert m_rollout["rollout/logprob_diff_max"] > 0.5  # the engine noise shows in the figure
    finally:
        skipped.env.close()
        separate.env.close()


def test_off_policy_update_keeps_the_separate_pass(tmp_path, tiny_lm_dir):
    trainer = _trainer(tmp_path, "epochs", "trainer.ppo_epochs=2")
    try:
        rollout = _scored_rollout(trainer)
        metrics = trainer.old_and_reference(rollout)
        assert rollout.old_logp is not None and "rollout/logprob_diff_max" in metrics
        old, rollout.old_logp = rollout.old_logp, None
        with pytest.raises(RuntimeError, match="run the old_logprobs stage first"):
            trainer.update(rollout)  # two epochs: the first forward of the second is not on-policy
        rollout.old_logp = old
        assert "rollout/logprob_diff_max" not in trainer.update(rollout)
    finally:
        trainer.env.close()


@pytest.mark.parametrize("agg,kl", [("token-mean", 0.1), ("seq-mean-token-mean", 0.0), ("seq-mean-token-sum-norm", 0.0)])
def test_token_budget_micro_batches_give_the_padded_update(tmp_path, tiny_lm_dir, agg, kl):
    common = (f"algo.loss_agg={agg}", f"algo.kl_coef={kl}")
    padded = _trainer(tmp_path, "padded", *common, "trainer.micro_batch_size=4")
    packed = _trainer(tmp_path, "packed", *common, "trainer.micro_batch_tokens=40")
    try:
        _same_weights(padded, packed)
        rollout = _scored_rollout(padded)
        lengths = rollout.tensors["response_mask"].sum(-1)
        assert lengths.min() < lengths.max(), "need responses of different lengths"
        chunks = packed.micro_batches(rollout)
        widths = {int(packed.env.actions.trim_padding(rollout.select(c)).tensors["response_ids"].shape[1]) for c in chunks}
        assert len(chunks) > 1 and len(widths) > 1  # several micro-batches, padded to different widths
        tokens = packed.env.actions.sample_tokens(rollout)
        for c in chunks:  # each within the budget unless a single sample is longer
            assert len(c) == 1 or len(c) * int(tokens[c].max()) <= 40
        assert sorted(torch.cat(chunks).tolist()) == list(range(len(rollout)))
        other = copy.deepcopy(rollout)
        padded.old_and_reference(rollout)
        packed.old_and_reference(other)
        if kl:  # the reference pass by token budget too, padded back to the full width
            mask = rollout.tensors["response_mask"].bool()  # (beyond it: zeros here, pad-token values there)
            torch.testing.assert_close(other.ref["logp"][mask], rollout.ref["logp"][mask],
                                       rtol=1e-5, atol=1e-5)
        m_pad, g_pad = _update_with_grads(padded, rollout)
        m_pack, g_pack = _update_with_grads(packed, other)
        assert max(g.abs().max().item() for g in g_pad) > 1e-4
        for a, b in zip(g_pad, g_pack):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        for key in ("loss/policy", "loss/total", "rollout/logprob_diff_mean"):
            assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-4, abs=1e-6), key
    finally:
        padded.env.close()
        packed.env.close()


def test_token_budget_packs_longest_first(tmp_path, tiny_lm_dir):
    trainer = _trainer(tmp_path, "pack", "trainer.micro_batch_tokens=18")
    try:
        # Prompt + response tokens per sample: 5, 9, 3, 9, 2, 4 (prompt 1 each, the rest response).
        total = torch.tensor([5, 9, 3, 9, 2, 4])
        response_mask = (torch.arange(8) < (total - 1).unsqueeze(-1)).float()  # [6, 8]
        batch = Rollout(tensors={"prompt_mask": torch.ones(6, 1, dtype=torch.long), "response_mask": response_mask},
                        group_ids=torch.zeros(6, dtype=torch.long), prompts=[""] * 6, samples=[""] * 6)
        # Sorted: 9 (1), 9 (3), 5 (0), 4 (5), 3 (2), 2 (4). [1, 3]: 2 x 9 = 18; + 0 would be 27.
        # [0, 5, 2]: 3 x 5 = 15; + 4 would be 20. [4] alone.
        assert [c.tolist() for c in trainer.micro_batches(batch)] == [[1, 3], [0, 5, 2], [4]]
    finally:
        trainer.env.close()
