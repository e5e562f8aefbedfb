"""Qwen-Image in the diffusion environment, on the toy Qwen-Image (real diffusers classes, ``tiny/qwenimage.py``).

Each test compares with an independent reference: the stock ``QwenImagePipeline`` (its prompt encoding,
noise, schedule, Euler steps, true CFG and decoding), or the schedule derived by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import unirl
from unirl.config import load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.families.flux import calculate_shift, unpack_latents
from unirl.diffusion.families.qwenimage import QwenImageFamily
from unirl.diffusion.sampling import sample_with_logprob
from unirl.diffusion.tiny.qwenimage import build_tiny_qwenimage

import diffusion_helpers  # tests/diffusion_helpers.py
from diffusion_helpers import perturb_lora

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.family=qwenimage", "model.name_or_path=tiny", "sampling.resolution=32", "sampling.max_sequence_length=16",
        "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8",
        "sampling.chunk_size=8", "sampling.num_steps=6", "sampling.eval_num_steps=6"]
PROMPTS = ["a red cat", "a blue house beside a tree"]


@pytest.fixture(scope="session")
def tiny_dir():
    return build_tiny_qwenimage()


@pytest.fixture(scope="session")
def pipe(tiny_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_env(*overrides: str):
    return diffusion_helpers.make_env(*TINY, *overrides)


def test_the_toy_tokenizer_spells_the_template_as_the_pipeline_drops_it(pipe):
    prefix = pipe.prompt_template_encode.split("{}")[0]
    ids = pipe.tokenizer(prefix).input_ids
    assert len(ids) == pipe.prompt_template_encode_start_idx == 34
    # What follows the dropped part is the prompt itself, then the template's closing tokens.
    full = pipe.tokenizer(pipe.prompt_template_encode.format("a red cat")).input_ids
    assert pipe.tokenizer.decode(full[34:]).startswith("a red cat<|im_end|>")


@pytest.mark.parametrize("max_sequence_length", [4, 16])
def test_prompt_encoding_is_the_pipelines_padded_to_a_fixed_length(pipe, max_sequence_length):
    with torch.no_grad():
        got = QwenImageFamily().encode(pipe, PROMPTS, max_sequence_length=max_sequence_length, device="cpu")
        embeds, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=max_sequence_length)
    if mask is None:  # the pipeline drops an all-ones mask
        mask = torch.ones(embeds.shape[:2], dtype=torch.long)
    n, t = mask.shape
    assert got["prompt_embeds"].shape == (2, max_sequence_length, 32) and got["prompt_mask"].dtype == torch.bool
    assert torch.equal(got["prompt_embeds"][:, :t], embeds)  # bit for bit where the pipeline has tokens
    assert torch.equal(got["prompt_mask"][:, :t], mask.bool())
    assert not got["prompt_mask"][:, t:].any() and not got["prompt_embeds"][:, t:].any()  # the rest is padding
    # The two prompts differ in length (12 and 29 characters + 5 closing tokens, cut at max_sequence_length).
    assert got["prompt_mask"].sum(1).tolist() == [min(max_sequence_length, 11), min(max_sequence_length, 28)]


def test_noise_and_unpacking_are_the_pipelines(pipe):
    family = QwenImageFamily()
    shape = family.latent_shape(pipe, 32)
    assert shape == (64, 16)
    noise = family.noise(3, shape, torch.Generator().manual_seed(5))
    stock = pipe.prepare_latents(3, 4, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(5))
    assert torch.equal(noise, stock)
    # The VAE's one-frame latent [n, C, 1, h, w], as the pipeline unpacks before decoding.
    assert torch.equal(unpack_latents(noise, 16, 16).unsqueeze(2), pipe._unpack_latents(noise, 32, 32, pipe.vae_scale_factor))


@pytest.mark.parametrize("steps", [4, 7])
def test_sigmas_are_the_pipelines_and_derived_by_hand(pipe, steps):
    family = QwenImageFamily()
    shape = family.latent_shape(pipe, 32)
    sigmas, timesteps = family.schedule(pipe.scheduler, steps, shape)
    # By hand: t = linspace(1, 1/S, S) shifted by exp(mu) / (exp(mu) + 1/t - 1) with mu on Qwen-Image's line
    # (256 -> 0.5, 8192 -> 0.9) at 64 tokens, then stretched so that the last sigma is shift_terminal 0.02.
    mu = 0.5 + (64 - 256) * (0.9 - 0.5) / (8192 - 256)
    assert calculate_shift(64, 256, 8192, 0.5, 0.9) == pytest.approx(mu, abs=1e-12)
    shifted = [math.exp(mu) / (math.exp(mu) + 1 / t - 1) for t in np.linspace(1.0, 1 / steps, steps)]
    stretch = (1 - shifted[-1]) / (1 - 0.02)
    expected = [1 - (1 - s) / stretch for s in shifted] + [0.0]
    torch.testing.assert_close(sigmas.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    assert sigmas[-2].item() == pytest.approx(0.02, abs=1e-6)
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000)
    pipe(PROMPTS[0], num_inference_steps=steps, height=32, width=32, max_sequence_length=16, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    assert torch.equal(pipe.scheduler.sigmas.float(), sigmas)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_noise_level_zero_is_the_pipelines_euler_sampler(pipe, guidance):
    """With guidance, the pipeline's true CFG: a negative prompt (" ", the family's) and the combination
    rescaled to the conditional velocity's norm; the pipeline runs the two branches apart, we batch them."""
    family, steps = QwenImageFamily(), 4
    shape = family.latent_shape(pipe, 32)
    with torch.no_grad():
        cond = family.encode(pipe, PROMPTS, max_sequence_length=16, device="cpu")
        negative = family.encode(pipe, [family.negative_prompt], max_sequence_length=16, device="cpu")
    if guidance > 1:
        cond.update({"neg_" + k: v.expand(2, *v.shape[1:]) for k, v in negative.items()})
    noise = family.noise(2, shape, torch.Generator().manual_seed(7))
    sigmas, timesteps = family.schedule(pipe.scheduler, steps, shape)
    ours = sample_with_logprob(family, pipe.transformer, noise, sigmas, timesteps, cond, guidance_scale=guidance,
                               noise_level=0.0, stochastic=torch.zeros(steps, dtype=torch.bool))
    kwargs = dict(prompt=PROMPTS, num_inference_steps=steps, height=32, width=32, max_sequence_length=16,
                  true_cfg_scale=guidance, negative_prompt=[" ", " "] if guidance > 1 else None)
    stock = pipe(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(7)).images
    torch.testing.assert_close(ours.final, stock, rtol=0, atol=1e-5)
    images = pipe(**kwargs, output_type="pt", generator=torch.Generator().manual_seed(7)).images
    torch.testing.assert_close(family.decode(pipe, ours.final), images, rtol=0, atol=1e-5)
    if guidance > 1:  # the rescaled combination is not plain CFG: plain CFG gives other latents
        plain = QwenImageFamily()
        plain.combine_guidance = lambda u, c, g: u + g * (c - u)
        other = sample_with_logprob(plain, pipe.transformer, noise, sigmas, timesteps, cond, guidance_scale=guidance,
                                    noise_level=0.0, stochastic=torch.zeros(steps, dtype=torch.bool))
        assert (other.final - stock).abs().max() > 1e-3


@pytest.mark.parametrize("overrides", [
    ("sampling.guidance_scale=1.0",),  # every step stochastic and trained
    ("sampling.guidance_scale=4.0", "sampling.train_cfg=true", "sampling.sde_window.size=2",
     "sampling.sde_window.range=[1,5]"),
])
def test_first_update_is_exactly_on_policy(tiny_dir, overrides):
    env = make_env(*overrides)
    perturb_lora(env)
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    old = rollout.old_logp  # [N, T]
    assert rollout.tensors["latents"].shape[2:] == (64, 16)  # packed tokens
    assert rollout.tensors["prompt_mask"].dtype == torch.bool
    with torch.no_grad():
        cur = env.actions.score_actions(env.model, rollout)
    assert torch.equal(cur["logp"], old)  # ratio exactly 1
    with torch.no_grad():
        pieces = [env.actions.score_actions(env.model, rollout, cols)["logp"] for cols in env.actions.column_slices(rollout)]
    torch.testing.assert_close(torch.cat(pieces, 1), old, rtol=0, atol=1e-6)
    env.actions.score_actions(env.model, rollout, slice(0, 1))["logp"].sum().backward()
    grads = {n: p.grad for n, p in env.model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert sum(float(g.abs().sum()) for g in grads.values() if g is not None) > 0
    env.close()


def test_saved_lora_loads_into_a_stock_qwenimage_pipeline(tiny_dir, tmp_path):
    from diffusers import QwenImagePipeline

    env = make_env("sampling.guidance_scale=1.0", "ema.enabled=false")
    perturb_lora(env, scale=0.5)
    env.save_pretrained(tmp_path / "ckpt")
    pipe = QwenImagePipeline.from_pretrained(tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a red cat", num_inference_steps=4, height=32, width=32, max_sequence_length=16,
                  output_type="latent")
    before = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(tmp_path / "ckpt")
    after = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert (after - before).abs().max() > 1e-3
    family = QwenImageFamily()
    x, t = torch.randn(2, 64, 16), torch.tensor([700.0, 300.0])
    cond = {"prompt_embeds": torch.randn(2, 16, 32), "prompt_mask": torch.arange(16).expand(2, 16) < torch.tensor([[9], [16]])}
    with torch.no_grad():
        torch.testing.assert_close(family.velocity(pipe.transformer, x, t, cond), family.velocity(env.model, x, t, cond),
                                   rtol=1e-4, atol=1e-5)
    env.close()


def test_the_config_takes_the_family_and_its_toy(tiny_dir):
    cfg = load_config(DiffusionConfig, REPO / "configs" / "diffusion" / "tiny_qwenimage.yaml")
    assert cfg.model.family == "qwenimage" and cfg.model.name_or_path == "tiny"


@pytest.mark.slow
def test_tiny_qwenimage_run_learns(tmp_path):
    run = tmp_path / "run"
    unirl.train("diffusion", "tiny_qwenimage", output_dir=run, progress=False)  # in this process: the CLI's own path (unirl.train), without a second Python and torch start-up
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 40
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.04, rewards  # measured: 0.511 -> 0.582
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 20, 40] and evals[-1]["eval/reward"] > evals[0]["eval/reward"] + 0.03
