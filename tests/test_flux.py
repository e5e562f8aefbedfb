"""FLUX.1 in the diffusion environment, on the toy FLUX (real diffusers classes, ``tiny_flux.py``).

Each test compares with an independent reference: the stock ``FluxPipeline`` (its own noise, Euler
steps, shift and decoding), diffusers' static packing helpers, or ``mu`` derived by hand.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import unirl
from unirl.config import ConfigError, load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.env import DiffusionEnvironment
from unirl.diffusion.families import FluxFamily
from unirl.diffusion.families.flux import calculate_shift, latent_image_ids, pack_latents, unpack_latents
from unirl.diffusion.sampling import sample_with_logprob
from unirl.diffusion.tiny.flux import build_tiny_flux

TINY = ["model.family=flux", "model.name_or_path=tiny", "sampling.guidance_scale=1.0", "sampling.resolution=32",
        "sampling.max_sequence_length=16", "trainer.prompts_per_step=2", "trainer.group_size=4",
        "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "sampling.chunk_size=8", "sampling.num_steps=6",
        "sampling.eval_num_steps=6"]


@pytest.fixture(scope="session")
def tiny_flux_dir():
    return build_tiny_flux()


@pytest.fixture(scope="session")
def pipe(tiny_flux_dir):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
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


def test_packing_and_image_ids_equal_the_pipelines(pipe):
    x = torch.randn(3, 4, 16, 12)  # [n, C, h, w], a non-square latent
    packed = pack_latents(x)
    assert packed.shape == (3, 8 * 6, 16)
    assert torch.equal(packed, pipe._pack_latents(x, 3, 4, 16, 12))
    assert torch.equal(unpack_latents(packed, 16, 12), x)
    # The pipeline's unpack takes the image size in pixels (vae_scale_factor 2 here).
    assert torch.equal(pipe._unpack_latents(packed, 32, 24, pipe.vae_scale_factor), x)
    assert torch.equal(latent_image_ids(16, 12), pipe._prepare_latent_image_ids(3, 8, 6, "cpu", torch.float32))
    # A token's id is (0, row, column) of its 2x2 patch: token 7 of a 6-wide grid is row 1, column 1.
    assert latent_image_ids(16, 12)[7].tolist() == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("resolution, tokens, mu", [
    (32, 64, 0.5 + (64 - 256) * (1.15 - 0.5) / (4096 - 256)),  # 0.4675: below FLUX's base sequence length
    (64, 256, 0.5),  # exactly the base sequence length: the base shift
])
def test_mu_and_sigmas_equal_the_pipelines(pipe, resolution, tokens, mu):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_shift

    family = FluxFamily()
    shape = family.latent_shape(pipe, resolution)
    assert shape == (tokens, 16)
    assert calculate_shift(tokens) == pytest.approx(mu, abs=1e-12)
    assert calculate_shift(tokens) == pytest.approx(diffusers_shift(tokens), abs=1e-12)
    steps = 5
    sigmas, timesteps = family.schedule(pipe.scheduler, steps, shape)
    # By hand: t = linspace(1, 1/S, S) shifted by exp(mu) / (exp(mu) + 1/t - 1), then a final 0.
    t = np.linspace(1.0, 1 / steps, steps)
    expected = [math.exp(mu) / (math.exp(mu) + 1 / ti - 1) for ti in t] + [0.0]
    torch.testing.assert_close(sigmas.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000)
    # The pipeline leaves its scheduler set to the schedule it sampled with.
    pipe("a red cat", num_inference_steps=steps, height=resolution, width=resolution, max_sequence_length=16,
         output_type="latent", generator=torch.Generator().manual_seed(0))
    assert torch.equal(pipe.scheduler.sigmas.float(), sigmas)


@pytest.mark.parametrize("guidance", [3.5, 1.5])
def test_noise_level_zero_is_the_pipelines_euler_sampler(pipe, guidance):
    family, prompts, steps = FluxFamily(guidance=guidance), ["a red cat", "a blue house"], 4
    shape = family.latent_shape(pipe, 32)
    cond = family.encode(pipe, prompts, max_sequence_length=16, device="cpu")
    noise = family.noise(2, shape, torch.Generator().manual_seed(7))
    sigmas, timesteps = family.schedule(pipe.scheduler, steps, shape)
    ours = sample_with_logprob(family, pipe.transformer, noise, sigmas, timesteps, cond, guidance_scale=1.0,
                               noise_level=0.0, stochastic=torch.zeros(steps, dtype=torch.bool))
    kwargs = dict(prompt=prompts, num_inference_steps=steps, height=32, width=32, guidance_scale=guidance,
                  max_sequence_length=16)
    # Same seed -> same initial noise (drawn unpacked, then packed) and the same Euler steps.
    stock = pipe(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(7)).images
    torch.testing.assert_close(ours.final, stock, rtol=0, atol=1e-6)
    images = pipe(**kwargs, output_type="pt", generator=torch.Generator().manual_seed(7)).images
    torch.testing.assert_close(family.decode(pipe, ours.final), images, rtol=0, atol=1e-5)
    # The guidance embedding matters: another value gives other images.
    other = sample_with_logprob(FluxFamily(guidance=guidance + 2), pipe.transformer, noise, sigmas, timesteps, cond,
                                guidance_scale=1.0, noise_level=0.0, stochastic=torch.zeros(steps, dtype=torch.bool))
    assert (other.final - ours.final).abs().max() > 1e-4


@pytest.mark.parametrize("overrides", [
    (),  # every step stochastic and trained
    ("sampling.sde_window.size=2", "sampling.sde_window.range=[1,5]", "sampling.timestep_fraction=0.5",
     "sampling.same_noise_per_group=true"),
    ("sampling.sde_type=cps", "sampling.noise_level=0.5"),
    # MixGRPO-Flash on packed latents: a window at [2, 4) after a branched prefix, compressed DPM-Solver++(2M) tail.
    ("sampling.sde_window.size=2", "sampling.sde_window.range=[2,5]", "sampling.sde_window.schedule=progressive",
     "sampling.same_noise_per_group=true", "sampling.branch_prefix=true", "sampling.ode_solver=dpm2m",
     "sampling.tail_step_ratio=0.5"),
])
def test_first_update_is_exactly_on_policy(tiny_flux_dir, overrides):
    env = make_env(*overrides)
    perturb_lora(env)
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    old = rollout.old_logp  # [N, T]
    assert rollout.tensors["latents"].shape[2:] == (64, 16)  # packed tokens
    with torch.no_grad():
        cur = env.actions.score_actions(env.model, rollout)
    assert torch.equal(cur["logp"], old)  # ratio exactly 1
    # One trained step at a time (the loop's column slices) gives the same log-probs.
    with torch.no_grad():
        pieces = [env.actions.score_actions(env.model, rollout, cols)["logp"] for cols in env.actions.column_slices(rollout)]
    torch.testing.assert_close(torch.cat(pieces, 1), old, rtol=0, atol=1e-6)
    # The gradient reaches only the LoRA weights, and some of them.
    env.actions.score_actions(env.model, rollout, slice(0, 1))["logp"].sum().backward()
    grads = {n: p.grad for n, p in env.model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert sum(float(g.abs().sum()) for g in grads.values() if g is not None) > 0
    env.close()


def test_reference_is_the_adapter_disabled_and_kl_is_zero_before_training(tiny_flux_dir):
    env = make_env("algo.kl_coef=0.04")
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    with torch.no_grad():
        with env.models.reference() as ref:
            ref_out = env.actions.score_actions(ref, rollout)
        assert torch.equal(env.actions.kl(env.actions.score_actions(env.model, rollout), ref_out), torch.zeros_like(ref_out["logp"]))
        perturb_lora(env)
        assert bool((env.actions.kl(env.actions.score_actions(env.model, rollout), ref_out) > 0).all())
    env.close()


def test_saved_lora_loads_into_a_stock_flux_pipeline(tiny_flux_dir, tmp_path):
    from diffusers import FluxPipeline

    env = make_env("ema.enabled=false")
    perturb_lora(env, scale=0.5)
    env.save_pretrained(tmp_path / "ckpt")
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    kwargs = dict(prompt="a red cat", num_inference_steps=4, height=32, width=32, max_sequence_length=16,
                  output_type="latent")
    before = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(tmp_path / "ckpt")
    after = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert (after - before).abs().max() > 1e-3
    # The loaded transformer is our policy: the same velocity (alpha / r scaling included).
    family = FluxFamily()
    x, t = torch.randn(2, 64, 16), torch.tensor([700.0, 300.0])
    cond = {"prompt_embeds": torch.randn(2, 16, 32), "pooled": torch.randn(2, 16)}
    with torch.no_grad():
        torch.testing.assert_close(family.velocity(pipe.transformer, x, t, cond),
                                   family.velocity(env.model, x, t, cond), rtol=1e-4, atol=1e-5)
    env.close()


def test_evaluation_with_the_ema_is_reproducible(tiny_flux_dir, tmp_path):
    env = make_env("data.eval_size=4", "data.grid_size=4")
    first, second = env.evaluation(0, tmp_path)[0], env.evaluation(0, tmp_path)[0]
    assert first == second and 0 < first["eval/reward"] < 1
    assert (tmp_path / "eval" / "step_000000.png").exists()
    env.close()


@pytest.mark.parametrize("overrides, match", [
    (["model.family=flux"], r"sampling.guidance_scale=4.5: FLUX.1 is guidance-distilled"),
    (["model.family=flax"], "model.family"),
])
def test_bad_flux_configs_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DiffusionConfig, None, overrides)


def test_a_checkpoint_of_another_family_is_named(tiny_flux_dir):
    from accelerate import Accelerator

    cfg = load_config(DiffusionConfig, None, [f"model.name_or_path={tiny_flux_dir}", "sampling.resolution=32"])
    with pytest.raises(ValueError, match="model.family='sd3' expects a StableDiffusion3Pipeline.*FluxPipeline"):
        DiffusionEnvironment(cfg).setup(Accelerator(cpu=True))


@pytest.mark.slow
def test_tiny_flux_run_learns_and_saves(tmp_path):
    run = tmp_path / "run"
    unirl.train("diffusion", "tiny_flux", output_dir=run, progress=False)  # in this process: the CLI's own path (unirl.train), without a second Python and torch start-up
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in train]
    assert len(train) == 60
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.1, rewards
    for r in train:  # one mini-batch per rollout: every ratio is 1
        assert abs(r["actor/ratio_max"] - 1) < 1e-4 and abs(r["actor/ratio_min"] - 1) < 1e-4
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 30, 60] and evals[-1]["eval/reward"] > evals[0]["eval/reward"]
    from safetensors.torch import load_file

    lora = load_file(run / "checkpoints" / "step_000060" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") for k in lora)
    assert sum(float(v.abs().sum()) for k, v in lora.items() if "lora_B" in k) > 0


@pytest.mark.parametrize("max_sequence_length", [4, 16])
def test_prompt_encoding_equals_the_pipelines(pipe, max_sequence_length, monkeypatch):
    """The family tokenizes each prompt once per tokenizer; ``FluxPipeline.encode_prompt`` (which
    tokenizes twice) gives the same pooled CLIP output and T5 states bit for bit, prompts cut or not."""
    from unirl.diffusion.families import base

    monkeypatch.setattr(base, "_warned", set())  # a fresh run's warnings
    prompts = ["a red cat", "", "a very long prompt about a blue house beside a green tree " * 6]
    with pytest.warns(UserWarning, match="may have been truncated"), torch.no_grad():
        got = FluxFamily().encode(pipe, prompts, max_sequence_length=max_sequence_length, device="cpu")
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device="cpu",
                                               max_sequence_length=max_sequence_length)
    assert got["prompt_embeds"].shape == embeds.shape == (3, max_sequence_length, embeds.shape[-1])
    assert torch.equal(got["prompt_embeds"], embeds) and torch.equal(got["pooled"], pooled)


def test_multi_vector_textual_inversion_tokens_are_expanded_as_the_pipeline_does(pipe):
    import copy

    from unirl.diffusion.families.flux import _textual_inversion

    prompts = ["a <cat> on a mat", "a dog"]
    assert _textual_inversion(pipe, prompts, pipe.tokenizer) is prompts  # no such tokens: not re-tokenized
    tokenizer = copy.deepcopy(pipe.tokenizer)
    tokenizer.add_tokens(["<cat>", "<cat>_1", "<cat>_2"])
    expanded = _textual_inversion(pipe, prompts, tokenizer)
    assert expanded == pipe.maybe_convert_prompt(prompts, tokenizer) == ["a <cat> <cat>_1 <cat>_2 on a mat", "a dog"]
