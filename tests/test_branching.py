"""Flow-GRPO-Fast branching (``sampling.branch_prefix``) on the toy SD3 (real diffusers classes, no mocks).

With the SDE window starting at step k, the k deterministic steps run once per prompt and the group
branches from that latent: the transformer sees B*k + B*G*(S - k) rows a rollout instead of B*G*S (twice
that with classifier-free guidance, whose one batched forward holds the negative and positive halves).

"The same noise": the unbranched sampler with ``same_noise_per_group`` draws one initial noise per
prompt (B draws from the rollout's generator, repeated to the G members) and then, chunk by chunk in
sample order, the SDE noise of the window's steps from the same generator. The prefix draws nothing
(its steps are ODE steps), so the branched sampler, given the same seed, starts from the same per-prompt
noises and draws the same SDE noise for the same samples and steps: its latents, log-probs and images
equal the unbranched sampler's (up to the float rounding of a transformer batch of B rows instead of N).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_diffusion_env import make_env, perturb_lora, tiny_sd3_dir  # noqa: F401  (the fixture)

S, B, G = 6, 2, 4  # make_env's tiny settings: 6 steps, 2 prompts x 4


class RowCount:
    """The test's own count of the rows through the real transformer (a forward pre-hook)."""

    def __init__(self, module):
        self.rows, self.calls = 0, 0
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.rows += kwargs["hidden_states"].shape[0]
        self.calls += 1


def _rollout(tiny_sd3_dir, k: int, branch: bool, *extra: str):
    torch.manual_seed(0)  # the LoRA's A matrices are drawn from the global generator: the same policy in both envs
    env = make_env(tiny_sd3_dir, "sampling.sde_window.size=2", f"sampling.sde_window.range=[{k},{k + 2}]",
                   "sampling.same_noise_per_group=true", f"sampling.branch_prefix={str(branch).lower()}",
                   "sampling.chunk_size=3", "sampling.guidance_scale=1.0", *extra)  # chunks of 3: groups split
    perturb_lora(env, seed=k)
    count = RowCount(env.pipe.transformer)
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=G)
    rows = count.rows
    _, metrics = env.scorer.score(rollout)
    count.handle.remove()
    return env, rollout, rows, metrics


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_branching_runs_the_prefix_once_per_prompt_and_gives_the_unbranched_samples(tiny_sd3_dir, k, seed):
    env_b, branched, rows_b, metrics_b = _rollout(tiny_sd3_dir, k, True, f"trainer.seed={seed}")
    env_u, unbranched, rows_u, metrics_u = _rollout(tiny_sd3_dir, k, False, f"trainer.seed={seed}")
    assert rows_b == B * k + B * G * (S - k)
    assert rows_u == B * G * S
    assert metrics_b["rollout/transformer_calls"] == rows_b and metrics_u["rollout/transformer_calls"] == rows_u
    assert metrics_b["rollout/window_start"] == k and metrics_b["rollout/window_size"] == 2
    for key in ("latents", "next_latents"):
        torch.testing.assert_close(branched.tensors[key], unbranched.tensors[key], rtol=0, atol=1e-5, msg=key)
    torch.testing.assert_close(branched.old_logp, unbranched.old_logp, rtol=0, atol=1e-5, msg="old_logp")
    assert torch.equal(branched.tensors["step_index"], unbranched.tensors["step_index"])
    assert torch.equal(branched.tensors["step_index"][0], torch.tensor([k, k + 1]))
    # The group's members branch: they share the window's input latent, then differ.
    first = branched.tensors["latents"][:, 0]  # [N, *latent], the latent entering the window
    assert torch.equal(first[0], first[G - 1]) and not torch.equal(first[0], first[G])
    nxt = branched.tensors["next_latents"][:, 0]
    assert not torch.equal(nxt[0], nxt[1])
    # The decoded images: the same pixels (8-bit) but for rounding at a pixel boundary.
    for a, b in zip(branched.samples, unbranched.samples):
        assert np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max() <= 1
    env_b.close(), env_u.close()


def test_guidance_doubles_the_rows_and_the_first_update_has_ratio_one(tiny_sd3_dir):
    k = 3
    env, rollout, rows, metrics = _rollout(tiny_sd3_dir, k, True, "sampling.guidance_scale=3.0",
                                           "sampling.train_cfg=true")
    assert rows == 2 * (B * k + B * G * (S - k))  # one batched forward of 2n rows a guided step
    assert metrics["rollout/transformer_calls"] == rows
    # The update's ratio is exactly 1 for a batch shaped as the rollout's chunks (3 samples here); other
    # batch shapes re-score to float precision only (a multi-threaded matmul rounds by its shape), as
    # tests/test_diffusion_env.py's shuffled sub-batch shows.
    n = len(rollout)
    with torch.no_grad():
        for lo in range(0, n, 3):
            chunk = torch.arange(lo, min(lo + 3, n))
            cur = env.actions.score_actions(env.model, rollout.select(chunk))
            assert torch.equal(cur["logp"], rollout.old_logp[chunk])
        whole = env.actions.score_actions(env.model, rollout)
    torch.testing.assert_close(whole["logp"], rollout.old_logp, rtol=0, atol=1e-5)
    env.close()


def test_branching_needs_noise_shared_within_groups(tiny_sd3_dir):
    with pytest.raises(ValueError, match="same_noise_per_group"):
        make_env(tiny_sd3_dir, "sampling.sde_window.size=2", "sampling.branch_prefix=true")
