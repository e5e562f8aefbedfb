"""The training loop's update on a real environment (tiny text model, transformers engine).

Gradient accumulation must not change the update: one mini-batch cut into micro-batches gives the
same parameters as the whole mini-batch at once, for every loss aggregation mode.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from unirl.cli import load_run_config
from unirl.trainer.loop import Trainer
from unirl.text.env import TextEnvironment


def _record_grads(trainer: Trainer) -> list[list[torch.Tensor]]:
    """Keep a copy of the accumulated gradients at every optimizer step (Adam's update would hide
    a wrong overall scale, the gradient does not)."""
    grads: list[list[torch.Tensor]] = []
    step = trainer.backend.clip_and_step  # the optimizer step every update takes

    def recording_step(*args, **kwargs):
        grads.append([p.grad.detach().clone() for p in trainer.env.model.parameters() if p.requires_grad])
        return step(*args, **kwargs)

    trainer.backend.clip_and_step = recording_step
    return grads


def _trainer(tmp_path, micro: int, agg: str, kl: float, share_prompt: bool = True) -> Trainer:
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=16",
        f"trainer.micro_batch_size={micro}", "trainer.eval_every=0", "trainer.progress=false",
        f"algo.loss_agg={agg}", f"algo.kl_coef={kl}", "optim.max_grad_norm=null", "optim.lr=1e-3",
        f"model.share_prompt={str(share_prompt).lower()}",
    ], output_dir=str(tmp_path / f"run-{micro}-{agg}-{kl}-{share_prompt}"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    return trainer


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_same_update(tmp_path, tiny_lm_dir, agg, share_prompt):
    kl = 0.1 if agg == "token-mean" else 0.0
    whole, split = _trainer(tmp_path, 16, agg, kl, share_prompt), _trainer(tmp_path, 4, agg, kl, share_prompt)
    try:
        rollout = whole.env.sampler.rollout(whole.env.prompts.next(0), 4)
        rewards, _ = whole.env.scorer.score(rollout)
        assert rewards.std() > 0, "need a non-zero advantage somewhere"
        whole.advantages(rollout, rewards)
        whole.old_and_reference(rollout)
        # The same data for the second trainer, whose model starts from the same weights.
        split_rollout = copy.deepcopy(rollout)
        before = [p.detach().clone() for p in whole.env.model.parameters()]
        for p, q in zip(whole.env.model.parameters(), split.env.model.parameters()):
            assert torch.equal(p, q)
        g_whole, g_split = _record_grads(whole), _record_grads(split)
        m_whole, m_split = whole.update(rollout), split.update(split_rollout)
        moved = max((p - b).abs().max().item() for p, b in zip(whole.env.model.parameters(), before))
        assert moved > 1e-5
        assert len(g_whole) == len(g_split) == 1  # one mini-batch: one optimizer step each
        assert max(g.abs().max().item() for g in g_whole[0]) > 1e-4
        for a, b in zip(g_whole[0], g_split[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
        # Adam's first step moves each weight by ~lr * g / (|g| + eps): where |g| is near eps (1e-8) a
        # float32 summation difference (another micro-batch shape, packed rows of another width, CUDA's
        # reduction order) turns into a move of up to ~lr, while the gradients above agree. So the
        # weights are compared where |g| > 1e-6, where Adam's step no longer depends on such rounding:
        # on both layouts and every device.
        for p, q, g in zip(whole.env.model.parameters(), split.env.model.parameters(), g_whole[0]):
            conditioned = g.abs() > 1e-6
            torch.testing.assert_close(p[conditioned], q[conditioned], rtol=1e-4, atol=1e-5)
        # Logged loss/* are the whole mini-batch's: the micro-batches' shares add up (unirl/metrics.py). The
        # old "* 4" held on the CPU only because there every response had one length and the loss was ~0.
        assert m_whole["loss/policy"] == pytest.approx(m_split["loss/policy"], rel=1e-4, abs=1e-7)
    finally:
        whole.env.close()
        split.env.close()


def test_on_policy_first_mini_batch_has_ratio_one(tmp_path, tiny_lm_dir):
    trainer = _trainer(tmp_path, 16, "token-mean", 0.0)
    try:
        rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), 4)
        rewards, _ = trainer.env.scorer.score(rollout)
        trainer.advantages(rollout, rewards)
        trainer.old_and_reference(rollout)
        metrics = trainer.update(rollout)  # one mini-batch: the whole step is on-policy
        assert metrics["actor/ratio_min"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["actor/clip_frac"] == 0.0
    finally:
        trainer.env.close()


def test_update_trains_in_training_mode_and_sampling_restores_it(tmp_path, tiny_lm_dir):
    """The update sets training mode only when the model is not in it (a walk over every submodule
    otherwise paid at every step): a model left in eval mode is switched, every submodule with it, and
    the HF engine's eval-mode sampling hands training mode back for the next update."""
    trainer = _trainer(tmp_path, 16, "token-mean", 0.0)
    model = trainer.env.model
    modes = []  # (gradients on, every submodule in training mode) at each forward
    model.register_forward_pre_hook(
        lambda module, args: modes.append((torch.is_grad_enabled(), all(m.training for m in module.modules()))))
    try:
        model.eval()
        for _ in range(2):
            rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), 4)
            rewards, _ = trainer.env.scorer.score(rollout)
            trainer.advantages(rollout, rewards)
            trainer.old_and_reference(rollout)
            trainer.update(rollout)
            assert all(m.training for m in model.modules())
        update_modes = [training for grad, training in modes if grad]
        assert len(update_modes) >= 2 and all(update_modes)  # both updates' forwards ran in training mode
    finally:
        trainer.env.close()


@pytest.mark.parametrize("on_policy", [True, False])
def test_old_logprobs_keep_the_rollout_width_when_the_widest_response_ends_masked(tmp_path, tiny_lm_dir, on_policy):
    """Issue 37 item 0 (smollm2_math died at step 26): micro-batches are trimmed to their longest *real*
    response, so when every sample's tail columns are padding (here: two extra masked columns, as a
    truncated response with ``overlong.mask_truncated`` or a vLLM batch padded past its longest leaves)
    the old log-probs put back from the micro-batches were narrower than ``engine_logp`` [N, R] and
    ``rollout_metrics`` failed. They must come back [N, R] on both paths: the update's first forward
    (on-policy) and the recomputation (two mini-batches)."""
    trainer = _trainer(tmp_path, 4, "token-mean", 0.0)
    if not on_policy:
        trainer.cfg.mini_batch_size = 8  # two mini-batches: old log-probs recomputed before the update
    try:
        rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), 4)
        t = rollout.tensors
        width = t["response_mask"].shape[1]
        for name, value in list(t.items()):  # two masked columns past every response: R grows, nothing real does
            if value.ndim == 2 and value.shape[1] == width:
                t[name] = torch.nn.functional.pad(value, (0, 2))
        rollout.engine_logp = torch.nn.functional.pad(rollout.engine_logp, (0, 2))  # the sampler's, a typed field
        rewards, _ = trainer.env.scorer.score(rollout)
        metrics = {}
        trainer.advantages(rollout, rewards)
        metrics.update(trainer.old_and_reference(rollout))
        metrics.update(trainer.update(rollout))
        assert rollout.old_logp.shape == rollout.engine_logp.shape == (len(rollout), width + 2)
        assert metrics["rollout/logprob_diff_max"] < 1e-3  # the figures the crash was in, computed
        assert rollout.old_logp[:, width:].abs().sum() == 0
    finally:
        trainer.env.close()


def test_policy_version_is_kept_by_select_and_concat():
    from unirl.env import Rollout, concat_rollouts

    def part(versions: list[int], tag: str) -> Rollout:
        n = len(versions)
        return Rollout(tensors={"x": torch.arange(n)}, group_ids=torch.zeros(n, dtype=torch.long), prompts=[tag] * n,
                       samples=[tag] * n, policy_version=torch.tensor(versions))

    a, b = part([3, 3, 3], "a"), part([5, 5], "b")
    assert a.select([2, 0]).policy_version.tolist() == [3, 3]
    assert a.select([0, 1, 2]).policy_version is a.policy_version  # the whole batch in order: no copy
    joined = concat_rollouts([a, b])
    assert joined.policy_version.tolist() == [3, 3, 3, 5, 5] and joined.policy_version.dtype == torch.long
    assert concat_rollouts([a, b]).select([4, 0]).policy_version.tolist() == [5, 3]


def test_each_sample_carries_the_optimizer_steps_of_the_weights_that_sampled_it(tmp_path, tiny_lm_dir):
    """Two mini-batches a step (two optimizer steps): step 1's rollout was sampled by the initial weights
    (version 0), step 2's by those after two optimizer steps; the update sees it on every sample."""
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=8",
        "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.progress=false", "optim.lr=1e-3",
    ], output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    seen = []
    i = trainer.plan.names.index("update")  # the plan's update stage, wrapped to see what it is given
    update = trainer.plan.stages[i]

    def recording_update(ctx, state, rollout):
        seen.append((rollout.policy_version.clone(), state.optimizer_steps))
        return update.run(ctx, state, rollout)

    trainer.plan.stages[i] = dataclasses.replace(update, run=recording_update)
    for _ in range(2):
        trainer.train_step()
    trainer.env.close()
    assert [(v.dtype, v.shape, set(v.tolist()), steps) for v, steps in seen] == [
        (torch.long, (16,), {0}, 0), (torch.long, (16,), {2}, 2)]
