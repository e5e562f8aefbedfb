"""What a diffusion step reuses instead of recomputing (issue 49, item 4), each tested exact: prompt
embeddings kept across steps (``sampling.prompt_cache_size``, ``unirl/diffusion/prompt_cache.py``) and the
sampler's own step means for the KL in the reward (``sampling.sampler_old_means``), and the old log-probs the
sampler gives the ratio (FlowGRPO's rollouts: ``recompute_old_logprobs`` false) equal to a recompute.
Speed is measured in ``benchmarks/step_reuse.py``, not here."""

from __future__ import annotations

import pytest
import torch

from unirl.config import load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.prompt_cache import PromptCache

from stage_helpers import TINY_DIFFUSION, diffusion_trainer  # tests/stage_helpers.py

# One sampling chunk and one micro-batch of the whole step's 12 samples: the sampler's forward and the
# trainer's re-scoring then see the same batch, so their numbers are the same bits.
TINY = [*TINY_DIFFUSION, "sampling.chunk_size=12", "sampling.num_steps=4"]


def make_trainer(tmp_path, *overrides: str):
    return diffusion_trainer(tmp_path, *overrides, base=TINY)


def run_steps(trainer, steps: int) -> list[dict[str, float]]:
    try:
        return [{k: v for k, v in trainer.train_step().items() if not k.startswith(("time/", "perf/"))}
                for _ in range(steps)]
    finally:
        trainer.env.close()


# ------------------------------------------------------------------ prompt cache
def test_prompt_cache_returns_each_rows_own_encoding_bit_for_bit_and_stays_bounded(tmp_path):
    env = make_trainer(tmp_path / "run", "sampling.prompt_cache_size=3").env
    rows = [{"prompt": p} for p in ("a red cat", "a blue boat", "a red cat", "a green tree")]
    alone = [env._encode([row]) for row in rows]  # each row encoded by itself: what the cache promises
    first = env.encode(rows)
    assert (env.prompt_cache.misses, env.prompt_cache.hits) == (3, 1)  # the repeated prompt was a hit already
    again = env.encode(rows[::-1])
    assert (env.prompt_cache.misses, env.prompt_cache.hits) == (3, 5)
    for i, one in enumerate(alone):
        for key, value in one.items():
            assert torch.equal(first[key][i], value[0])
            assert torch.equal(again[key][len(rows) - 1 - i], value[0])
    env.encode([{"prompt": "a black bird"}])  # a fourth prompt: the least recently used one leaves
    assert len(env.prompt_cache.entries) == 3 and ("a green tree", None) not in env.prompt_cache.entries
    assert ("a red cat", None) in env.prompt_cache.entries  # used last by ``again``
    env.close()


def test_prompt_cache_off_by_default_and_size_checked():
    assert load_config(DiffusionConfig, None, TINY).sampling.prompt_cache_size == 0
    with pytest.raises(ValueError, match="prompt_cache_size"):
        load_config(DiffusionConfig, None, [*TINY, "sampling.prompt_cache_size=-1"])
    with pytest.raises(ValueError, match=">= 1"):
        PromptCache(0)


def test_a_run_with_the_prompt_cache_trains_as_one_that_encodes_each_prompt_alone(tmp_path):
    """The cache changes no number beyond the encoders' own batch-size rounding: a run whose prompts are each
    encoded alone every step (a cache too small to hit but by chance: size 1, 3 prompts a step) and a run that reuses them
    (size 64) give the same metrics, bit for bit, over three steps (3 train prompts: every step draws them all)."""
    prompts = tmp_path / "train.txt"
    prompts.write_text("a red cat\na blue boat\na green tree\n")
    hitting = make_trainer(tmp_path / "a", "sampling.prompt_cache_size=64", f"data.train={prompts}")
    missing = make_trainer(tmp_path / "b", "sampling.prompt_cache_size=1", f"data.train={prompts}")
    ran_hitting, ran_missing = run_steps(hitting, 3), run_steps(missing, 3)
    hit, miss = hitting.env.prompt_cache, missing.env.prompt_cache
    assert (hit.hits, hit.misses) == (6, 3) and miss.misses >= 8  # (a step may start with the last one's prompt)
    assert ran_hitting == ran_missing


# ------------------------------------------------------------- old outputs from the sampler
@pytest.mark.parametrize("algorithm", ["flowgrpo", "tempflow"])
def test_sampler_means_feed_the_kl_in_the_reward_as_a_recompute_does(tmp_path, algorithm):
    """``sampling.sampler_old_means``: the KL in the reward reads the sampler's step means instead of a
    re-scoring pass, and the run's metrics (rewards, KL, advantages, loss, gradient) are the recomputing run's,
    bit for bit, over two steps (the second after an update: the sampler's weights are the trained ones)."""
    kl = ["algo.use_kl_in_reward=true", "algo.kl_ctrl.kl_coef=0.1", f"algorithm={algorithm}", "optim.lr=3e-2"]
    probe = make_trainer(tmp_path / "probe", *kl, "sampling.sampler_old_means=true")
    rollout = probe.env.sampler.rollout(probe.env.prompts.next(0), 4)
    with torch.no_grad():
        scored = probe.env.actions.score_actions(probe.env.model, rollout)
    kept = probe.env.actions.sampled_outputs(rollout)
    for key in ("logp", "mean", "sigma", "sigma_next"):
        assert torch.equal(kept[key], scored[key].cpu()), key
    probe.env.close()
    reused = make_trainer(tmp_path / "a", *kl, "sampling.sampler_old_means=true")
    recomputed = make_trainer(tmp_path / "b", *kl)
    assert recomputed.env.actions.sampled_outputs(rollout) is None  # off: the loop re-scores
    ran_reused, ran_recomputed = run_steps(reused, 2), run_steps(recomputed, 2)
    assert ran_reused[1]["actor/reward_kl_penalty"] > 0 and ran_reused[1]["actor/grad_norm"] > 0
    assert ran_reused == ran_recomputed


@pytest.mark.parametrize("overrides, match", [
    (["sampling.sampler_old_means=true"], "only the KL in the reward reads"),
    (["sampling.sampler_old_means=true", "algo.use_kl_in_reward=true", "algorithm=nft", "algo.loss_args.kl_coef=0.0",
      "algo.kl_ctrl.kl_coef=0.1"], "no SDE steps|no step KL"),
])
def test_sampler_means_refused_where_nothing_reads_them_or_no_sampler_keeps_them(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(DiffusionConfig, None, [*TINY, *overrides])
