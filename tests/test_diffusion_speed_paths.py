"""The sampler's and the re-scoring's fast paths give exactly what the per-step checked code gives.

``sample_with_logprob`` and ``rescore_steps`` check their sigmas once and call the unchecked
``sde_step``; the sampler gathers the recorded steps at the end instead of writing them step by step.
Each test compares bit for bit with a reference written here the slow way (``sde_step_with_logprob``
at every step, index assignment), on the toy SD3 where a model is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from unirl.config import load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.env import DiffusionEnvironment
from unirl.diffusion.sampling import (forward_module, guided_velocity, rescore_steps, sample_with_logprob, schedule_coefficients,
                                     to_pil, trained_steps)
from unirl.diffusion.sde import sde_step, sde_step_with_logprob, step_coefficients
from unirl.diffusion.tiny.sd3 import build_tiny_sd3
from unirl.diffusion.window import window_bounds, window_mask

SEEDS = [0, 1, 2]


@pytest.fixture(scope="module")
def env():
    from accelerate import Accelerator

    build_tiny_sd3()
    cfg = load_config(DiffusionConfig, None, [
        "model.name_or_path=tiny", "sampling.resolution=32", "sampling.max_sequence_length=16",
        "sampling.num_steps=6", "trainer.prompts_per_step=2", "trainer.group_size=3",
        "trainer.mini_batch_size=6", "trainer.micro_batch_size=6"])
    environment = DiffusionEnvironment(cfg)
    environment.setup(Accelerator(cpu=True))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a non-trivial LoRA, as after some training
        for name, p in environment.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    yield environment
    environment.close()


def _cond(env, n):
    encoded = env.family.encode(env.pipe, ["a red cat", "a blue dog"], max_sequence_length=16, device="cpu")
    return {k: v.repeat_interleave(n // 2, 0) for k, v in encoded.items()}  # each [n, ...]


def _reference_sampler(env, noise, cond, stochastic, record, sde_type, generator):
    """The sampler the slow way: the checked step at every step, recorded steps written in place."""
    sigmas, timesteps = env.train_sigmas, env.train_timesteps
    n = noise.shape[0]
    latents = noise.float()
    kept_in = torch.zeros(n, record.shape[1], *latents.shape[1:])
    kept_out, kept_logp = torch.zeros_like(kept_in), torch.zeros(n, record.shape[1])
    for i in range(len(timesteps)):
        v = guided_velocity(env.family, env.model, latents, timesteps[i].expand(n), cond, 1.0)
        nxt, logp, _, _ = sde_step_with_logprob(v, latents, sigmas[i], sigmas[i + 1],
                                                noise_level=0.7 if stochastic[i] else 0.0,
                                                generator=generator, sde_type=sde_type)
        rows, cols = (record == i).nonzero(as_tuple=True)
        kept_in[rows, cols], kept_out[rows, cols], kept_logp[rows, cols] = latents[rows], nxt[rows], logp[rows]
        latents = nxt
    return latents, kept_in, kept_out, kept_logp


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sde_type", ["flow", "cps"])
@pytest.mark.parametrize("noise_level", [0.0, 0.7])
@pytest.mark.parametrize("given", [False, True])
def test_unchecked_step_equals_the_checked_one(seed, sde_type, noise_level, given):
    """The sampler's path (constants of a whole schedule computed once, step i's taken as 0-d tensors
    shared by the batch) and the re-scoring's (per-sample constants of [n, T] stored steps, column j
    taken) give bit for bit what the checked step gives for that step alone."""
    g = torch.Generator().manual_seed(seed)
    n = 20  # more than one vector of 8 or 16 floats: vectorised and scalar tails both run
    v, x, prev = (torch.randn(n, 4, 3, 3, generator=g) for _ in range(3))
    schedule = torch.cat([torch.ones(1), torch.sort(torch.rand(9, generator=g), descending=True).values, torch.zeros(1)])
    sigma, sigma_next = schedule[:-1], schedule[1:]  # [S] with S = 10, from sigma = 1 down to 0
    whole = step_coefficients(sigma, sigma_next, noise_level=noise_level, sde_type=sde_type).unbind()  # S x 0-d
    kwargs = dict(noise_level=noise_level, sde_type=sde_type, prev_sample=prev if given else None)
    for i in range(len(sigma)):
        checked = sde_step_with_logprob(v, x, sigma[i], sigma_next[i], generator=torch.Generator().manual_seed(9), **kwargs)
        fast = sde_step(v, x, whole[i], prev_sample=kwargs["prev_sample"], generator=torch.Generator().manual_seed(9))
        for a, b in zip(checked[:3], fast[:3], strict=True):
            assert torch.equal(a, b), f"step {i}"
        assert torch.equal(checked[3].flatten(), fast[3].expand(n)), f"step {i}"
    # Per-sample sigmas, stored as [n, T] (the re-scoring's layout), column j against the checked step.
    index = torch.randint(0, len(sigma), (n, 3), generator=g)  # [n, T]
    computed = step_coefficients(sigma[index], sigma_next[index], noise_level=noise_level, sde_type=sde_type,
                                 latent_ndim=3)  # [n, T], latent-facing [n, T, 1, 1, 1]
    # Gathered from the schedule's constants instead (the environment's path): the same bits.
    taken = step_coefficients(sigma, sigma_next, noise_level=noise_level, sde_type=sde_type).take(index, latent_ndim=3)
    for name in ("dt", "std", "sample_weight", "velocity_weight", "neg_inv_two_var", "neg_log_norm"):
        a, b = getattr(computed, name), getattr(taken, name)
        assert (a is None) == (b is None), name
        assert a is None or (a.shape == b.shape and torch.equal(a, b)), name
    assert (taken.sde_type, taken.ode) == (computed.sde_type, computed.ode)
    stored = taken.unbind(1)  # T x [n]
    for j in range(3):
        checked = sde_step_with_logprob(v, x, sigma[index[:, j]], sigma_next[index[:, j]],
                                        generator=torch.Generator().manual_seed(9), **kwargs)
        fast = sde_step(v, x, stored[j], prev_sample=kwargs["prev_sample"],
                        generator=torch.Generator().manual_seed(9))
        for a, b in zip(checked, fast, strict=True):
            assert torch.equal(a, b), f"column {j}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("window,fraction,selection,sde_type", [
    (0, 1.0, "first", "flow"),  # the tiny config: every step stochastic and recorded
    (3, 0.67, "first", "flow"),  # the same steps for every sample, not all of them
    (3, 0.67, "random", "flow"),  # a Fast window, a random subset per sample
    (0, 0.5, "random", "cps"),
])
def test_sampler_keeps_what_a_per_step_loop_keeps(env, seed, window, fraction, selection, sde_type):
    n, steps = 6, len(env.train_timesteps)
    stochastic = window_mask(steps, *window_bounds(seed, num_steps=steps, size=window))
    record = trained_steps(n, stochastic, fraction, torch.Generator().manual_seed(seed), selection)  # [N, T]
    noise = torch.randn(n, *env.latent_shape, generator=torch.Generator().manual_seed(seed))
    cond = _cond(env, n)
    out = sample_with_logprob(env.family, env.model, noise, env.train_sigmas, env.train_timesteps, cond,
                              guidance_scale=1.0, noise_level=0.7, stochastic=stochastic, record=record,
                              sde_type=sde_type, generator=torch.Generator().manual_seed(100 + seed))
    with torch.no_grad():
        final, kept_in, kept_out, kept_logp = _reference_sampler(env, noise, cond, stochastic, record, sde_type,
                                                                 torch.Generator().manual_seed(100 + seed))
    assert torch.equal(out.final, final)
    assert torch.equal(out.latents, kept_in) and torch.equal(out.next_latents, kept_out)
    assert torch.equal(out.logp, kept_logp)
    # The constants computed once (as the environment keeps them for every rollout) change nothing.
    given = sample_with_logprob(env.family, env.model, noise, env.train_sigmas, env.train_timesteps, cond,
                                guidance_scale=1.0, noise_level=0.7, stochastic=stochastic, record=record,
                                sde_type=sde_type, generator=torch.Generator().manual_seed(100 + seed),
                                coefficients=schedule_coefficients(env.train_sigmas, noise_level=0.7, sde_type=sde_type))
    for a, b in zip((out.final, out.latents, out.next_latents, out.logp),
                    (given.final, given.latents, given.next_latents, given.logp), strict=True):
        assert torch.equal(a, b)
    assert kept_in.flatten(2).abs().sum(-1).gt(0).all()  # every recorded slot was written (not zeros compared)


def test_sampler_without_records_keeps_nothing(env):
    noise = torch.randn(2, *env.latent_shape, generator=torch.Generator().manual_seed(0))
    out = sample_with_logprob(env.family, env.model, noise, env.train_sigmas, env.train_timesteps, _cond(env, 2),
                              guidance_scale=1.0, noise_level=0.0, stochastic=torch.zeros(6, dtype=torch.bool))
    assert out.latents.shape == out.next_latents.shape == (2, 0, *env.latent_shape)
    assert out.logp.shape == (2, 0)


def test_rescoring_equals_the_checked_step_per_column(env):
    n, T = 4, 3
    g = torch.Generator().manual_seed(3)
    latents, next_latents = torch.randn(n, T, *env.latent_shape, generator=g), torch.randn(n, T, *env.latent_shape, generator=g)
    index = torch.randint(0, 5, (n, T), generator=g)  # [n, T] any stored steps, per sample
    sigma, sigma_next, timestep = env.train_sigmas[index], env.train_sigmas[index + 1], env.train_timesteps[index]
    cond = _cond(env, n)
    with torch.no_grad():
        out = rescore_steps(env.family, env.model, latents, next_latents, sigma, sigma_next, timestep, cond,
                            guidance_scale=1.0, noise_level=0.7)
        for j in range(T):
            v = guided_velocity(env.family, env.model, latents[:, j], timestep[:, j], cond, 1.0)
            _, logp, mean, std = sde_step_with_logprob(v, latents[:, j], sigma[:, j], sigma_next[:, j], noise_level=0.7,
                                                       prev_sample=next_latents[:, j])
            assert torch.equal(out["logp"][:, j], logp) and torch.equal(out["mean"][:, j], mean)
            assert torch.equal(out["std"][:, j], std.flatten())


def test_rescoring_with_given_constants_equals_computing_them(env):
    n, T = 4, 3
    g = torch.Generator().manual_seed(5)
    latents, next_latents = torch.randn(n, T, *env.latent_shape, generator=g), torch.randn(n, T, *env.latent_shape, generator=g)
    index = torch.randint(0, 5, (n, T), generator=g)
    sigma, sigma_next, timestep = env.train_sigmas[index], env.train_sigmas[index + 1], env.train_timesteps[index]
    coef = step_coefficients(sigma, sigma_next, noise_level=0.7, sde_type="flow", latent_ndim=3).unbind(1)
    cond = _cond(env, n)
    with torch.no_grad():
        computed = rescore_steps(env.family, env.model, latents, next_latents, sigma, sigma_next, timestep, cond,
                                 guidance_scale=1.0, noise_level=0.7)
        given = rescore_steps(env.family, env.model, latents, next_latents, sigma, sigma_next, timestep, cond,
                              guidance_scale=1.0, noise_level=0.7, check=False, coefficients=coef)
    assert computed.keys() == given.keys()
    assert all(torch.equal(computed[k], given[k]) for k in computed)


def test_evaluate_column_by_column_equals_the_whole_and_caches_per_batch(env):
    """The loop scores a micro-batch one trained step at a time; ``score_actions`` moves the batch to the
    device and computes its steps' constants once (in ``batch.cache``), and each column equals what
    scoring all columns at once gives. A selection of the batch starts with an empty cache."""
    env.step = 3
    rows = env.prompts.next(3)[:2]
    rollout = env.sampler.rollout(rows, 3)
    env.scorer.score(rollout)
    algo = env.cfg.algo
    try:
        # Without a KL the pieces compute no mean (nothing reads it); with one they give it.
        for kl_coef, keys in ((0.0, ("logp", "std", "mask", "sigma", "sigma_next")), (0.1, ("mean",))):
            env.cfg.algo = dataclasses.replace(algo, kl_coef=kl_coef)
            micro = rollout.select(torch.tensor([4, 0, 2, 5]))
            assert micro.cache == {}
            with torch.no_grad():
                whole = env.actions.score_actions(env.model, rollout.select(torch.tensor([4, 0, 2, 5])))
                T = whole["logp"].shape[1]
                pieces = [env.actions.score_actions(env.model, micro, slice(j, j + 1)) for j in range(T)]
            assert set(micro.cache) == {"stored_steps"}
            assert all(("mean" in p) == (kl_coef > 0) for p in pieces)
            for key in keys:
                if key == "mask":  # every stored step is trained: no mask, the losses skip the masking
                    assert whole[key] is None and all(p[key] is None for p in pieces)
                    continue
                assert torch.equal(torch.cat([p[key] for p in pieces], dim=1), whole[key]), key
    finally:
        env.cfg.algo = algo
    assert rollout.select(torch.tensor([1, 2])).cache == {}
    assert dataclasses.replace(micro).cache == {}  # a copy (the text env's trim_padding) starts its own


def test_forward_module_skips_only_pefts_plain_wrapper(env):
    """The base model of a LoRA ``PeftModel`` gives the wrapper's velocity bit for bit, with the
    adapter on and off (the reference); other modules are called as they are."""
    from peft import PeftModel

    model = env.model
    assert type(model) is PeftModel and forward_module(model) is model.get_base_model()
    n = 4
    latents = torch.randn(n, *env.latent_shape, generator=torch.Generator().manual_seed(1))
    timestep, cond = torch.full((n,), 700.0), _cond(env, n)
    with torch.no_grad():
        for adapter_on in (True, False):
            with contextlib.nullcontext() if adapter_on else model.disable_adapter():
                wrapped = env.family.velocity(model, latents, timestep, cond)
                direct = guided_velocity(env.family, model, latents, timestep, cond, 1.0)
            assert torch.equal(wrapped, direct)
        assert not torch.equal(env.family.velocity(model, latents, timestep, cond), direct)  # the LoRA acts
    other = torch.nn.Linear(2, 2)
    assert forward_module(other) is other


def test_forward_module_keeps_a_wrapped_or_hooked_peft_model(env):
    """``trainer.mixed_precision`` makes accelerate wrap the prepared model's forward in autocast (on
    the instance); skipping the PeftModel would silently drop it. Hooks on it must run too."""
    model = env.model
    n = 2
    latents = torch.randn(n, *env.latent_shape, generator=torch.Generator().manual_seed(2))
    timestep, cond = torch.full((n,), 500.0), _cond(env, n)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # as accelerate's prepare does
    try:
        assert forward_module(model) is model
        with torch.no_grad():
            autocast = guided_velocity(env.family, model, latents, timestep, cond, 1.0)
            plain = env.family.velocity(model.get_base_model(), latents, timestep, cond)
        assert autocast.dtype == torch.bfloat16 and plain.dtype == torch.float32  # autocast ran
    finally:
        del model.forward
    assert forward_module(model) is model.get_base_model()
    handle = model.register_forward_pre_hook(lambda module, args: None)
    try:
        assert forward_module(model) is model
    finally:
        handle.remove()
    assert forward_module(model) is model.get_base_model()


def test_bad_sigmas_are_still_refused_once_for_all_steps(env):
    noise = torch.randn(2, *env.latent_shape)
    rising = env.train_sigmas.clone()
    rising[3] = rising[2] + 0.01  # step 2 would go towards noise
    with pytest.raises(ValueError, match="sigma_next must be smaller than sigma"):
        sample_with_logprob(env.family, env.model, noise, rising, env.train_timesteps, _cond(env, 2),
                            guidance_scale=1.0, noise_level=0.7, stochastic=torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="only stochastic steps can be recorded"):
        window = torch.tensor([False, True, True, False, False, False])  # step 3 is an ODE step
        sample_with_logprob(env.family, env.model, noise, env.train_sigmas, env.train_timesteps, _cond(env, 2),
                            guidance_scale=1.0, noise_level=0.7, stochastic=window, record=torch.tensor([[1, 2], [2, 3]]))
    with pytest.raises(ValueError, match="constants of the 6 steps, got 5"):
        short = schedule_coefficients(env.train_sigmas[1:], noise_level=0.7)
        sample_with_logprob(env.family, env.model, noise, env.train_sigmas, env.train_timesteps, _cond(env, 2),
                            guidance_scale=1.0, noise_level=0.7, stochastic=torch.ones(6, dtype=torch.bool), coefficients=short)
    latents = torch.randn(2, 2, *env.latent_shape)
    sigma = torch.tensor([[0.9, 0.5], [0.9, 0.5]])
    with pytest.raises(ValueError, match="sigma_next must be smaller than sigma"):
        rescore_steps(env.family, env.model, latents, latents, sigma, sigma.flip(1), sigma * 1000, _cond(env, 2),
                      guidance_scale=1.0, noise_level=0.7)
    with pytest.raises(ValueError, match=r"must be \[n, T\]"):
        rescore_steps(env.family, env.model, latents, latents, sigma[:, :1], sigma[:, :1] / 2, sigma * 1000,
                      _cond(env, 2), guidance_scale=1.0, noise_level=0.7)


def test_to_pil_equals_the_image_by_image_conversion():
    images = torch.rand(5, 3, 7, 9, generator=torch.Generator().manual_seed(0))
    images[0, 0, 0, 0], images[0, 1, 0, 0] = 0.0, 1.0
    for image, pil in zip(images, to_pil(images), strict=True):
        expected = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()  # [H, W, 3]
        assert pil.mode == "RGB" and pil.size == (9, 7)
        assert np.array_equal(np.asarray(pil), expected)


PROMPTS = ["a red cat", "", "  A  Red   CAT, on a mat!  ", "a very long prompt about a blue dog on a green chair " * 6,
           "caf\u00e9 \u00fcber na\u00efve \u65e5\u672c", "<|endoftext|> in the text", "</s> and <pad> too", "x" * 300]


@pytest.mark.parametrize("name,max_length", [("tokenizer", 77), ("tokenizer", 8), ("tokenizer_3", 16), ("tokenizer_3", 4)])
def test_tokenize_gives_the_tokenizers_own_ids(env, name, max_length):
    """``tokenize`` calls the fast tokenizer's backend through a copy set up once; the ids equal the
    tokenizer's own padded, cut call (special tokens, odd spacing, unicode, cut and empty prompts),
    also after a token is added to the tokenizer (the copy is rebuilt)."""
    import copy
    import warnings

    from unirl.diffusion.families.base import tokenize

    tokenizer = copy.deepcopy(getattr(env.pipe, name))  # a token is added below
    assert tokenizer.backend_tokenizer is not None  # the fast path is the one under test

    def reference(prompts):
        return tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt",
                         add_special_tokens=True).input_ids

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-run warning about cut prompts
        assert torch.equal(tokenize(tokenizer, PROMPTS, max_length, "test"), reference(PROMPTS))
        assert tokenize(tokenizer, [], max_length, "test").shape == (0, max_length)
        tokenizer.add_tokens(["<cat-token>"])
        prompts = ["a <cat-token> on a mat", "<cat-token>"]
        got = tokenize(tokenizer, prompts, max_length, "test")
    assert torch.equal(got, reference(prompts)) and int(got.max()) == len(tokenizer) - 1


@pytest.mark.parametrize("max_sequence_length", [4, 16])
def test_sd3_prompt_encoding_equals_the_pipelines(env, max_sequence_length, monkeypatch):
    """The family tokenizes each prompt once per tokenizer; the pipeline's ``encode_prompt`` (which
    tokenizes twice) gives the same embeddings bit for bit, with prompts cut at both lengths, an empty
    one, and without T5 (zeros in its place)."""
    from unirl.diffusion.families import base

    monkeypatch.setattr(base, "_warned", set())  # a fresh run's warnings
    pipe = env.pipe
    prompts = ["a red cat", "", "a very long prompt about a blue dog sitting on a green chair " * 6, "a sign"]
    # The pipeline logs what it cut; the family warns once per run that prompts filled a tokenizer.
    with pytest.warns(UserWarning, match="may have been truncated"), torch.no_grad():  # as the pipeline runs
        got = env.family.encode(pipe, prompts, max_sequence_length=max_sequence_length, device="cpu")
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device="cpu",
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=max_sequence_length)
    assert got["prompt_embeds"].shape == embeds.shape and got["prompt_embeds"].shape[1] > max_sequence_length
    assert torch.equal(got["prompt_embeds"], embeds) and torch.equal(got["pooled"], pooled)
    t5, pipe.text_encoder_3 = pipe.text_encoder_3, None
    try:
        with torch.no_grad():
            got = env.family.encode(pipe, prompts, max_sequence_length=max_sequence_length, device="cpu")
            embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device="cpu",
                                                      do_classifier_free_guidance=False,
                                                      max_sequence_length=max_sequence_length)
    finally:
        pipe.text_encoder_3 = t5
    assert torch.equal(got["prompt_embeds"], embeds) and torch.equal(got["pooled"], pooled)
    assert not got["prompt_embeds"][:, -max_sequence_length:].any()


def test_compute_dtype_follows_the_module_through_to():
    """The families cast inputs to ``compute_dtype(transformer)``, which keeps the module's first
    parameter after the first call: a later ``.to(dtype)`` (in place on the same parameters) must show,
    in either direction, for a plain module and for a LoRA-wrapped one."""
    from peft import LoraConfig, get_peft_model

    from unirl.diffusion.families.base import compute_dtype

    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    wrapped = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(r=2, target_modules=["0"]))
    for module in (plain, wrapped):
        assert compute_dtype(module) == torch.float32
        module.to(torch.bfloat16)
        assert compute_dtype(module) == torch.bfloat16 == next(module.parameters()).dtype
        module.to(torch.float64)
        assert compute_dtype(module) == torch.float64
