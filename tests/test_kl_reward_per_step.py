"""The KL in the reward per denoising step (``algo.kl_in_reward: per_step``, ``unirl.core.kl_step_rewards`` and
``stepwise_advantages``): by hand, against FlowGRPO's ``kl_reward`` re-typed (its per-prompt stat tracker over
[N, T] rewards), the summed form left as it was, the config's refusals, and on the toy SD3 the advantages per
step of a second step (the first has KL 0: the LoRA starts at the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl.core import estimate_advantages, kl_penalized_rewards, kl_step_rewards, stepwise_advantages, token_scores


def test_per_step_by_hand():
    # Two groups of two, two trained steps, beta 0.2.
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0])
    kl = torch.tensor([[0.0, 0.5], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    ids, mask = torch.tensor([0, 0, 1, 1]), torch.ones(4, 2, dtype=torch.bool)
    R = kl_step_rewards(scores, kl, mask, 0.2)
    # R_t = score - 0.2 kl_t: [[1, 0.9], [0, 0], [1.8, 2], [2, 2]]
    torch.testing.assert_close(R, torch.tensor([[1.0, 0.9], [0.0, 0.0], [1.8, 2.0], [2.0, 2.0]]))
    adv = stepwise_advantages("grpo", R, ids, mask, scale="none")
    # Step 0: group means 0.5 and 1.9; step 1: 0.45 and 2.
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.45], [-0.5, -0.45], [-0.1, 0.0], [0.1, 0.0]]))
    # The summed form: one reward a sample, score - 0.2 * sum_t kl_t = [0.9, 0, 1.8, 2]: the same advantage at
    # every step ([0.45, -0.45, -0.1, 0.1]), so sample 2's KL at step 0 costs it at step 1 too.
    penalised, _ = kl_penalized_rewards(token_scores(scores, mask), kl, mask, 0.2)
    summed, _ = estimate_advantages("grpo", penalised.sum(-1), ids, scale="none")
    torch.testing.assert_close(summed, torch.tensor([0.45, -0.45, -0.1, 0.1]))
    # A masked-out step has no reward and no advantage.
    holes = torch.tensor([[True, False], [True, True], [True, True], [True, True]])
    assert kl_step_rewards(scores, kl, holes, 0.2)[0, 1] == 0
    assert stepwise_advantages("grpo", R, ids, holes, scale="none")[0, 1] == 0


def flow_grpo_kl_reward_advantages(prompts, rewards, kl, kl_reward, global_std):
    """FlowGRPO's ``kl_reward`` (scripts/train_sd3.py and flow_grpo/stat_tracking.py, commit f37646f), re-typed:
    ``avg = rewards[:, None] - kl_reward * kl`` [N, T], then ``PerPromptStatTracker.update``: per prompt, the mean
    over axis 0 (per step), the std of the prompt's rows or of all rows (global_std) plus 1e-4, numpy's biased std."""
    avg = np.asarray(rewards, dtype=np.float64)[:, None] - kl_reward * np.asarray(kl, dtype=np.float64)
    prompts = np.array(prompts)
    advantages = np.zeros_like(avg)
    for prompt in np.unique(prompts):
        rows = avg[prompts == prompt]
        mean = np.mean(rows, axis=0, keepdims=True)
        std = (np.std(avg, axis=0, keepdims=True) if global_std else np.std(rows, axis=0, keepdims=True)) + 1e-4
        advantages[prompts == prompt] = (rows - mean) / std
    return advantages


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("global_std", [True, False])
def test_per_step_is_flow_grpos_kl_reward(seed, global_std):
    g = torch.Generator().manual_seed(seed)
    B, G, T = 3, 4, 5
    scores = torch.rand(B * G, generator=g, dtype=torch.float64)
    kl = torch.rand(B * G, T, generator=g, dtype=torch.float64) * 0.3
    ids = torch.arange(B).repeat_interleave(G)
    ids = ids[torch.randperm(B * G, generator=g)]  # groups need not be contiguous
    mask = torch.ones(B * G, T, dtype=torch.bool)
    mine = stepwise_advantages("grpo", kl_step_rewards(scores, kl, mask, 0.04), ids, mask,
                               scale="batch" if global_std else "group", eps=1e-4, unbiased=False)
    theirs = flow_grpo_kl_reward_advantages([f"p{i}" for i in ids.tolist()], scores.numpy(), kl.numpy(), 0.04, global_std)
    np.testing.assert_allclose(mine.numpy(), theirs, rtol=1e-10, atol=1e-12)


def test_per_step_needs_an_outcome_estimator_and_aligned_steps():
    from unirl.config import load_config
    from unirl.diffusion.config import DiffusionConfig

    base = ["algo.use_kl_in_reward=true", "algo.kl_in_reward=per_step"]
    load_config(DiffusionConfig, None, base)  # grpo, every step: accepted
    with pytest.raises(ValueError, match="set algo.use_kl_in_reward: true"):
        load_config(DiffusionConfig, None, ["algo.kl_in_reward=per_step"])
    with pytest.raises(ValueError, match="outcome estimator per step"):
        load_config(DiffusionConfig, None, [*base, "algo.adv_estimator=reinforce++-baseline"])
    with pytest.raises(ValueError, match="timestep_selection: first"):
        load_config(DiffusionConfig, None, [*base, "sampling.timestep_selection=random", "sampling.timestep_fraction=0.5"])
    with pytest.raises(ValueError, match="needs an outcome estimator"):  # one whose advantages are per token
        stepwise_advantages("reinforce++-baseline", torch.zeros(2, 1), torch.tensor([0, 0]), torch.ones(2, 1))


def test_per_step_on_the_toy_sd3(tmp_path):
    from tests.test_flow_guards import make_trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = make_trainer(tmp_path, "algo.use_kl_in_reward=true", "algo.kl_in_reward=per_step",
                               "algo.kl_ctrl.kl_coef=0.5", "optim.lr=3e-3", "algo.adv_scale=group")
        env = trainer.env
        for step in range(2):  # the first step moves the LoRA off the reference; the second has a KL per step
            rollout = env.sampler.rollout(env.prompts.next(step), 4)
            rewards = env.scorer.score(rollout)[0]
            trained, metrics = trainer.learn(rollout, rewards)
        kl = env.actions.kl(trained.old, trained.ref).float()  # [N, T]
        assert kl.shape == trained.advantages.shape and (kl[:, 1:] > 0).all()
        R = rewards.float()[:, None] - 0.5 * kl
        # FlowGRPO's per-prompt tracker with the run's settings: group std, unbiased, eps 1e-6.
        expected = torch.stack([(R[:, t] - R[:, t].view(2, 4).mean(1).repeat_interleave(4))
                                / (R[:, t].view(2, 4).std(1).repeat_interleave(4) + 1e-6) for t in range(kl.shape[1])], 1)
        torch.testing.assert_close(trained.advantages, expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(trained.advantages[:, 0], trained.advantages[:, -1])  # a step's own KL
        assert metrics["actor/reward_kl_penalty"] > 0
        env.close()
    finally:
        torch.set_num_threads(threads)
