"""Wan 2.1 text-to-video in the diffusion environment, on the toy Wan (real diffusers classes, ``tiny/wan.py``).

Each test compares with an independent reference: the stock ``WanPipeline`` (its prompt encoding,
noise, Euler steps, CFG and decoding), the shifted sigmas derived by hand, or per-frame scores
computed here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unirl.config import ConfigError, load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.env import DiffusionEnvironment
from unirl.diffusion.families import WanFamily
from unirl.diffusion.sampling import sample_with_logprob
from unirl.diffusion.tiny.wan import build_tiny_wan

TINY = ["model.family=wan", "model.name_or_path=tiny", "sampling.guidance_scale=1.0", "sampling.resolution=32",
        "sampling.num_frames=5", "sampling.max_sequence_length=16", "trainer.prompts_per_step=2",
        "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "sampling.chunk_size=8",
        "sampling.num_steps=4", "sampling.eval_num_steps=4",
        "model.lora.target_modules=[to_q,to_k,to_v,to_out.0]"]


@pytest.fixture(scope="module")
def tiny_wan_dir():
    return build_tiny_wan()


@pytest.fixture(scope="module")
def pipe(tiny_wan_dir):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_wan_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_env(*overrides: str) -> DiffusionEnvironment:
    from accelerate import Accelerator

    env = DiffusionEnvironment(load_config(DiffusionConfig, None, [*TINY, *overrides]))
    env.setup(Accelerator(cpu=True))
    return env


def perturb_lora(env, seed: int = 0, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in env.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("max_sequence_length", [4, 16])
def test_prompt_encoding_equals_the_pipelines(pipe, max_sequence_length):
    """Cleaned, masked UMT5 states zeroed past each prompt's last token, as ``encode_prompt``, bit for bit."""
    prompts = ["a red  cat", "", "a very long prompt about a blue house &amp; a tree " * 3]
    with torch.no_grad(), pytest.warns(UserWarning, match="truncated"):
        got = WanFamily().encode(pipe, prompts, max_sequence_length=max_sequence_length, device="cpu")
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                       max_sequence_length=max_sequence_length, device="cpu")
    assert got["prompt_embeds"].shape == embeds.shape == (3, max_sequence_length, 32)
    assert torch.equal(got["prompt_embeds"], embeds)
    assert got["prompt_embeds"][1, 1:].abs().sum() == 0  # "" is one token (</s>); the rest is zeroed


@pytest.mark.parametrize("steps", [3, 10])
def test_sigmas_are_wans_shift_and_the_pipelines(pipe, steps):
    family = WanFamily(num_frames=5)
    shape = family.latent_shape(pipe, 32)
    assert shape == (16, 2, 4, 4)  # 16 channels, 1 + (5 - 1) / 4 latent frames, 32 / 8 px
    sigmas, timesteps = family.schedule(pipe.scheduler, steps, shape)
    # By hand: Wan's shift f(s) = 3 s / (1 + 2 s), applied to s = linspace(1, f(1/1000), S) (from the
    # scheduler's own, already shifted, sigma range down to f(1/1000)), then a final 0.
    def shift(s):
        return 3 * s / (1 + 2 * s)

    expected = [shift(si) for si in np.linspace(1.0, shift(1 / 1000), steps)] + [0.0]
    torch.testing.assert_close(sigmas.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000)
    pipe("a red cat", num_inference_steps=steps, height=32, width=32, num_frames=5, max_sequence_length=16,
         guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert torch.equal(pipe.scheduler.sigmas.float(), sigmas)


def test_sigmas_of_the_released_unipc_scheduler():
    """The Wan 2.1 checkpoints ship UniPC with flow sigmas: the sampler reads its sigmas and timesteps."""
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000, final_sigmas_type="zero")
    steps = 6
    sigmas, timesteps = WanFamily().schedule(scheduler, steps, (16, 2, 4, 4))
    s = np.linspace(1.0, 1 / 1000, steps + 1)[:-1]
    shifted = 3 * s / (1 + 2 * s)
    shifted[0] -= 1e-6  # UniPC keeps the first sigma off 1
    torch.testing.assert_close(sigmas.double(), torch.tensor([*shifted, 0.0], dtype=torch.float64), rtol=0, atol=1e-6)
    assert timesteps.tolist() == [float(int(x * 1000)) for x in shifted.astype(np.float32)]


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_noise_level_zero_is_the_pipelines_euler_sampler(pipe, guidance):
    family, prompts, steps = WanFamily(num_frames=5), ["a red cat", "a blue house"], 4
    shape = family.latent_shape(pipe, 32)
    cond = family.encode(pipe, prompts, max_sequence_length=16, device="cpu")
    if guidance > 1:  # the pipeline's default negative prompt is ""
        negative = family.encode(pipe, [""], max_sequence_length=16, device="cpu")["prompt_embeds"]
        cond["neg_prompt_embeds"] = negative.expand(2, -1, -1)
    noise = family.noise(2, shape, torch.Generator().manual_seed(7))
    sigmas, timesteps = family.schedule(pipe.scheduler, steps, shape)
    with torch.no_grad():
        ours = sample_with_logprob(family, pipe.transformer, noise, sigmas, timesteps, cond, guidance_scale=guidance,
                                   noise_level=0.0, stochastic=torch.zeros(steps, dtype=torch.bool))
    kwargs = dict(prompt=prompts, num_inference_steps=steps, height=32, width=32, num_frames=5,
                  guidance_scale=guidance, max_sequence_length=16)
    stock = pipe(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(7)).frames
    assert stock.shape == (2, *shape)
    # With CFG ours is one batched forward of negative and positive, the pipeline's two forwards: the
    # same values up to float32 rounding (one part in 1e6 after 4 steps).
    torch.testing.assert_close(ours.final, stock, rtol=1e-6, atol=1e-6)
    videos = pipe(**kwargs, output_type="pt", generator=torch.Generator().manual_seed(7)).frames  # [n, F, 3, H, W]
    decoded = family.decode(pipe, ours.final)
    assert decoded.shape == videos.shape == (2, 5, 3, 32, 32)
    torch.testing.assert_close(decoded, videos, rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [
    (),  # every step stochastic and trained
    ("sampling.sde_window.size=2", "sampling.sde_window.range=[1,4]", "sampling.same_noise_per_group=true"),
    ("sampling.guidance_scale=2.0", "sampling.train_cfg=true"),
])
def test_first_update_is_exactly_on_policy(tiny_wan_dir, overrides):
    env = make_env(*overrides)
    perturb_lora(env)
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    old = rollout.old_logp  # [N, T]
    assert rollout.tensors["latents"].shape[2:] == (16, 2, 4, 4)  # a frame axis in the latent
    assert len(rollout.samples[0]) == 5 and rollout.samples[0][0].size == (32, 32)  # 5 frames per video
    with torch.no_grad():
        cur = env.actions.score_actions(env.model, rollout)
    assert torch.equal(cur["logp"], old)  # ratio exactly 1
    env.actions.score_actions(env.model, rollout, slice(0, 1))["logp"].sum().backward()
    grads = {n: p.grad for n, p in env.model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert sum(float(g.abs().sum()) for g in grads.values() if g is not None) > 0
    env.close()


def test_rewards_score_a_video_as_its_frames(tiny_wan_dir):
    """``brightness`` of each video is the mean of its frames' brightness, computed here from the frames."""
    env = make_env()
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    scores, _ = env.scorer.score(rollout)
    by_hand = torch.tensor([np.mean([np.asarray(f, dtype=np.float64).mean() / 255 for f in video])
                            for video in rollout.samples], dtype=torch.float64)
    torch.testing.assert_close(rollout.tensors["score/brightness"], by_hand, rtol=0, atol=1e-6)
    assert scores.shape == (8,)
    env.close()


def test_frame_rewards_stride_reduce_and_none():
    from PIL import Image

    from unirl.diffusion.frames import FrameRewards
    from unirl.config.schema import RewardConfig
    from unirl.reward_set import RewardSet

    def grey(v):
        return Image.new("RGB", (2, 2), (v, v, v))

    videos = [[grey(0), grey(255), grey(51), grey(255)], [grey(102)] * 4]
    for stride, reduce, expected in [(1, "mean", [(0 + 1 + 0.2 + 1) / 4, 0.4]), (2, "mean", [0.1, 0.4]),
                                     (1, "min", [0.0, 0.4]), (3, "max", [1.0, 0.4])]:
        rewards = FrameRewards(RewardSet([RewardConfig(name="brightness")]), stride=stride, reduce=reduce)
        got = rewards.components(videos, prompts=["a", "b"], columns={})["brightness"]
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
        # The pool route gives the same scores.
        torch.testing.assert_close(rewards.submit(videos, prompts=["a", "b"], columns={}).result()["brightness"], got)
    # colour_share applies to no frame of a video whose prompt names no colour: NaN (does not apply).
    rewards = FrameRewards(RewardSet([RewardConfig(name="colour_share")]))
    got = rewards.components(videos, prompts=["a black cat", "a cat"], columns={})["colour_share"]
    # Frames 0 (grey 0) and 2 (grey 51) are nearest to PALETTE's black (15, 15, 15): 2 of 4.
    assert got[0] == pytest.approx(0.5) and math.isnan(got[1])


def test_saved_lora_loads_into_a_stock_wan_pipeline(tiny_wan_dir, tmp_path):
    from diffusers import WanPipeline

    env = make_env("ema.enabled=false")
    perturb_lora(env, scale=0.5)
    env.save_pretrained(tmp_path / "ckpt")
    pipe = WanPipeline.from_pretrained(tiny_wan_dir)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a red cat", num_inference_steps=3, height=32, width=32, num_frames=5,
                  max_sequence_length=16, guidance_scale=1.0, output_type="latent")
    before = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    pipe.load_lora_weights(tmp_path / "ckpt")
    after = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert (after - before).abs().max() > 1e-3
    # The loaded transformer is our policy: the same velocity (alpha / r scaling included).
    family = WanFamily()
    x, t = torch.randn(2, 16, 2, 4, 4), torch.tensor([700.0, 300.0])
    cond = {"prompt_embeds": torch.randn(2, 16, 32)}
    with torch.no_grad():
        torch.testing.assert_close(family.velocity(pipe.transformer, x, t, cond),
                                   family.velocity(env.model, x, t, cond), rtol=1e-4, atol=1e-5)
    env.close()


def test_evaluation_writes_a_grid_and_a_gif(tiny_wan_dir, tmp_path):
    from PIL import Image

    env = make_env("data.eval_size=4", "data.grid_size=4")
    first, second = env.evaluation(0, tmp_path)[0], env.evaluation(0, tmp_path)[0]
    assert first == second and 0 < first["eval/reward"] < 1
    assert (tmp_path / "eval" / "step_000000.png").exists()
    with Image.open(tmp_path / "eval" / "step_000000.gif") as gif:
        assert gif.n_frames == 5
    env.close()


def test_bad_frame_counts_are_named(tiny_wan_dir):
    from accelerate import Accelerator

    with pytest.raises(ConfigError, match="num_frames=5: Stable Diffusion 3 makes images"):
        load_config(DiffusionConfig, None, ["sampling.num_frames=5"])
    cfg = load_config(DiffusionConfig, None, [*TINY, "sampling.num_frames=6"])
    with pytest.raises(ValueError, match=r"num_frames=6: Wan's VAE makes 1 \+ 4k frames"):
        DiffusionEnvironment(cfg).setup(Accelerator(cpu=True))


def test_tiny_wan_run_learns_and_saves(tiny_wan_dir, tmp_path):
    """tiny_wan.yaml, cut to 12 steps: brightness (per frame, averaged) rises and every ratio is 1."""
    import json

    import unirl

    run = tmp_path / "run"
    # In this process: the CLI's own path (unirl.train), without a second Python and torch start-up.
    unirl.train("diffusion", "tiny_wan", ["trainer.total_steps=12", "trainer.eval_every=12"], output_dir=run,
                progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 12
    assert sum(rewards[-4:]) / 4 - sum(rewards[:4]) / 4 >= 0.03, rewards
    for r in rows:  # one mini-batch per rollout: every ratio is 1
        if "actor/ratio_max" in r:
            assert abs(r["actor/ratio_max"] - 1) < 1e-4 and abs(r["actor/ratio_min"] - 1) < 1e-4
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    assert len(evals) == 2 and evals[1] > evals[0], evals
    assert (run / "eval" / "step_000012.gif").exists()
    from safetensors.torch import load_file

    lora = load_file(run / "checkpoints" / "step_000012" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") for k in lora)
