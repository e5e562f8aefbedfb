"""The diffusion environment on the toy SD3 (real diffusers classes): on-policy log-probs, KL, EMA,
schedules, and the LoRA saved in diffusers' format loading into a stock pipeline."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.config import load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.ema import ParamEMA
from unirl.diffusion.env import DiffusionEnvironment
from unirl.diffusion.sampling import sigma_schedule, trained_steps
from unirl.diffusion.window import window_bounds, window_mask
from unirl.diffusion.tiny.sd3 import build_tiny_sd3

TINY = ["model.name_or_path=tiny", "sampling.resolution=32", "sampling.max_sequence_length=16",
        "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.mini_batch_size=8",
        "trainer.micro_batch_size=8", "sampling.chunk_size=8", "sampling.num_steps=6", "sampling.eval_num_steps=6"]


@pytest.fixture(scope="session")
def tiny_sd3_dir():
    return build_tiny_sd3()


def make_env(tiny_sd3_dir, *overrides: str) -> DiffusionEnvironment:
    from accelerate import Accelerator

    cfg = load_config(DiffusionConfig, None, [*TINY, *overrides])
    env = DiffusionEnvironment(cfg)
    env.setup(Accelerator(cpu=True))
    return env


def perturb_lora(env, seed: int = 0, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in env.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("overrides", [
    (),  # every step stochastic and trained, no guidance
    ("sampling.guidance_scale=3.0", "sampling.train_cfg=true"),  # CFG in rollouts and training
    ("sampling.guidance_scale=3.0", "sampling.sde_window.size=2", "sampling.sde_window.range=[1,5]",
     "sampling.timestep_fraction=0.5", "sampling.same_noise_per_group=true"),  # Fast window, step subset
    ("sampling.sde_type=cps", "sampling.noise_level=0.5", "sampling.timestep_fraction=0.6"),
    # MixGRPO's sliding window (at [2, 4) on step 0) after a branched prefix, DPM-Solver++(2M) after it.
    ("sampling.guidance_scale=3.0", "sampling.sde_window.size=2", "sampling.sde_window.range=[2,5]",
     "sampling.sde_window.schedule=progressive", "sampling.branch_prefix=true", "sampling.same_noise_per_group=true",
     "sampling.ode_solver=dpm2m"),
])
def test_rescored_log_probs_equal_the_sampled_ones_before_any_update(tiny_sd3_dir, overrides):
    env = make_env(tiny_sd3_dir, *overrides)
    perturb_lora(env)  # a non-trivial policy, as after some training
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    old = rollout.old_logp  # [N, T]
    with torch.no_grad():
        cur = env.actions.score_actions(env.model, rollout)
    assert cur["logp"].shape == old.shape == env.actions.loss_mask(rollout).shape
    assert torch.equal(cur["logp"], old)  # ratio exactly 1 for every trained step
    assert torch.equal(torch.exp(cur["logp"] - old), torch.ones_like(old))
    # The steps' constants are gathered from the schedule by step_index; without it they are computed
    # from the stored sigmas, with the same bits. Sigmas that are not the schedule's at step_index fail.
    whole = torch.arange(len(rollout))
    computed = rollout.select(whole)
    del computed.tensors["step_index"]
    with torch.no_grad():
        assert torch.equal(env.actions.score_actions(env.model, computed)["logp"], old)
    edited = rollout.select(whole)
    edited.tensors["sigma"] = edited.tensors["sigma"] * 0.99
    with pytest.raises(ValueError, match="not the training schedule's sigmas at its step_index"):
        env.actions.score_actions(env.model, edited)
    # A shuffled sub-batch (the loop's micro-batches) re-scores the same steps to float precision.
    idx = torch.tensor([5, 0, 3])
    with torch.no_grad():
        sub = env.actions.score_actions(env.model, rollout.select(idx))
    torch.testing.assert_close(sub["logp"], old[idx], rtol=0, atol=1e-5)
    env.close()


def test_chunks_are_scored_in_the_pool_but_the_last_on_the_calling_thread(tiny_sd3_dir):
    """With ``reward_workers`` each chunk but the last is scored in the pool while the next samples; the
    last (no sampling left to overlap) is scored by ``score`` on the calling thread. The scores equal
    inline scoring's (``reward_workers=0``), chunk order kept."""
    import threading

    scored: list[tuple[str, int]] = []
    env = make_env(tiny_sd3_dir, "sampling.chunk_size=3", "trainer.reward_workers=1")  # 8 samples: chunks 3, 3, 2
    components = env.rewards.components

    def recording(samples, **kwargs):
        scored.append((threading.current_thread().name, len(samples)))
        return components(samples, **kwargs)

    env.rewards.components = recording
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    rewards, _ = env.scorer.score(rollout)
    assert sorted(n for _, n in scored) == [2, 3, 3]
    assert [name.startswith("unirl-reward") for name, n in scored if n == 3] == [True, True]
    assert [name for name, n in scored if n == 2] == [threading.current_thread().name]
    inline = make_env(tiny_sd3_dir, "sampling.chunk_size=3", "trainer.reward_workers=0")
    expected, _ = inline.scorer.score(inline.sampler.rollout(inline.prompts.next(0), group_size=4))
    assert torch.equal(rewards, expected)
    env.close()
    inline.close()


def test_rollout_records_the_chosen_steps_and_shares_noise_within_groups(tiny_sd3_dir):
    env = make_env(tiny_sd3_dir, "sampling.sde_window.size=2", "sampling.sde_window.range=[1,5]",
                   "sampling.same_noise_per_group=true")
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    steps = rollout.tensors["step_index"]  # [N, 2]
    assert steps.shape == (8, 2) and bool((steps[:, 1] == steps[:, 0] + 1).all())  # one window for the batch
    assert 1 <= int(steps[0, 0]) and int(steps[0, 1]) < 5
    sigmas, _ = sigma_schedule(env.scheduler, 6)
    torch.testing.assert_close(rollout.tensors["sigma"], sigmas[steps], rtol=0, atol=0)
    # Steps before the window are deterministic, so a group that shares the initial noise shares the
    # latent entering the window; the SDE noise then differs within the group.
    if int(steps[0, 0]) > 0:
        lat = rollout.tensors["latents"][:, 0]  # [N, C, h, w]
        assert torch.equal(lat[0], lat[3]) and not torch.equal(lat[0], lat[4])
    assert not torch.equal(rollout.tensors["next_latents"][0, 0], rollout.tensors["next_latents"][1, 0])
    assert rollout.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    env.close()


def test_trained_steps_subset_and_window_bounds():
    stochastic = torch.tensor([False, True, True, True, True, False])
    # FlowGRPO's selection (the default): the first int(4 * 0.5) = 2 stochastic steps in sampling order.
    assert trained_steps(5, stochastic, 0.5, torch.Generator()).tolist() == [[1, 2]] * 5
    assert trained_steps(2, stochastic, 0.99, torch.Generator()).tolist() == [[1, 2, 3]] * 2  # int(3.96) = 3
    steps = trained_steps(50, stochastic, 0.5, torch.Generator().manual_seed(0), "random")  # 2 of 4 at random
    assert steps.shape == (50, 2) and bool((steps[:, 0] < steps[:, 1]).all())
    assert set(steps.flatten().tolist()) == {1, 2, 3, 4}
    for selection in ("first", "random"):
        assert trained_steps(3, stochastic, 1.0, torch.Generator(), selection).tolist() == [[1, 2, 3, 4]] * 3
    starts = {int(window_mask(10, *window_bounds(s, num_steps=10, size=3, window_range=(2, 8))).nonzero()[0])
              for s in range(200)}
    assert starts == {2, 3, 4, 5}
    assert bool(window_mask(4, *window_bounds(0, num_steps=4, size=0)).all())


def test_kl_is_zero_for_the_reference_and_matches_the_closed_form(tiny_sd3_dir):
    env = make_env(tiny_sd3_dir, "algo.kl_coef=0.1")
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    with torch.no_grad():
        with env.models.reference() as ref:
            ref_out = env.actions.score_actions(ref, rollout)
        cur = env.actions.score_actions(env.model, rollout)  # LoRA B starts at 0: the policy is the reference
        assert torch.equal(env.actions.kl(cur, ref_out), torch.zeros_like(cur["logp"]))
        perturb_lora(env)
        cur = env.actions.score_actions(env.model, rollout)
        with env.models.reference() as ref:  # the adapter is disabled inside, so ref is unchanged
            torch.testing.assert_close(env.actions.score_actions(ref, rollout)["mean"], ref_out["mean"], rtol=0, atol=0)
    kl = env.actions.kl(cur, ref_out)  # [N, T], kl_form flowgrpo (the default)
    # FlowGRPO: ((mean - ref_mean)^2).mean(dims) / (2 std_dev_t^2), std_dev_t = 0.7 sqrt(sigma / (1 - sigma))
    # (the next sigma in the denominator at sigma 1), one step and one sample at a time.
    n, t = 3, 2
    diff = (cur["mean"][n, t] - ref_out["mean"][n, t]).double()
    sigma, sigma_next = float(rollout.tensors["sigma"][n, t]), float(rollout.tensors["sigma_next"][n, t])
    std_dev_t = 0.7 * math.sqrt(sigma / (1 - (sigma_next if sigma == 1 else sigma)))
    assert float(kl[n, t]) == pytest.approx(float(diff.square().mean() / (2 * std_dev_t**2)), rel=1e-5)
    assert bool((kl > 0).all())
    # The exact KL divides by the step's variance std_dev_t^2 |dt|.
    env.cfg.kl_form = "exact"
    exact = env.actions.kl(cur, ref_out)
    assert float(exact[n, t]) == pytest.approx(float(diff.square().mean() / (2 * cur["std"][n, t].double() ** 2)), rel=1e-5)
    torch.testing.assert_close(kl, exact * (rollout.tensors["sigma"] - rollout.tensors["sigma_next"]))
    env.close()


def test_gradient_of_the_rescored_log_prob_reaches_only_the_lora_weights(tiny_sd3_dir):
    env = make_env(tiny_sd3_dir)
    perturb_lora(env)
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    env.actions.score_actions(env.model, rollout)["logp"].sum().backward()
    grads = {n: p.grad for n, p in env.model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    # The last block is context_pre_only (SD3): its text-stream output is discarded, so the text
    # query projection gets no gradient there; every other adapter does.
    silent = {n for n, g in grads.items() if g is None or g.abs().sum() == 0}
    assert all("transformer_blocks.1.attn.add_q_proj" in n for n in silent), silent
    assert len(silent) <= 2 < len(grads)
    env.close()


def test_param_ema_by_hand():
    p = torch.nn.Parameter(torch.zeros(2))
    ema = ParamEMA([p], decay=0.9, update_every=1)
    with torch.no_grad():
        p.fill_(1.0)
    ema.step(1)  # after optimizer step 1: decay min(2/11, 0.9): 0 + (9/11) * (1 - 0)
    torch.testing.assert_close(ema.shadow[0], torch.full((2,), 9 / 11))
    ema.step(2)  # decay min(3/12, 0.9): 9/11 + (3/4) * (2/11)
    expected = 9 / 11 + 0.75 * 2 / 11
    torch.testing.assert_close(ema.shadow[0], torch.full((2,), expected))
    with ema.swapped():
        torch.testing.assert_close(p.detach(), torch.full((2,), expected))
    torch.testing.assert_close(p.detach(), torch.ones(2))
    state = ema.state_dict()
    other = ParamEMA([torch.nn.Parameter(torch.zeros(2))], decay=0.9)
    other.load_state_dict(state)
    assert torch.equal(other.shadow[0], ema.shadow[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_param_ema_equals_flowgrpos_update_per_tensor(seed):
    """The fused update (one operation over all tensors) gives FlowGRPO's per-parameter
    ``ema.add_((1 - d) * (param - ema))`` bit for bit, over several steps and mixed shapes."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(3, 4), (7,), (2, 2, 5)]]
    ema = ParamEMA(params, decay=0.95, update_every=2)
    expected = [p.detach().clone() for p in params]
    for k in range(1, 9):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=g))
        ema.step(k)
        if (k + 1) % 2 == 0:
            d = min((1 + k) / (10 + k), 0.95)
            for e, p in zip(expected, params):
                e.add_((1 - d) * (p.detach() - e))
        for e, s in zip(expected, ema.shadow, strict=True):
            assert torch.equal(e, s), k
    ParamEMA([], decay=0.9).step(1)  # nothing to average (no trainable parameter): a no-op, not an error


def test_saved_lora_loads_into_a_stock_pipeline_and_changes_its_output(tiny_sd3_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    env = make_env(tiny_sd3_dir, "ema.enabled=false")
    perturb_lora(env, scale=0.5)
    env.save_pretrained(tmp_path / "ckpt")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir)
    kwargs = dict(prompt="a red cat", num_inference_steps=4, height=32, width=32, guidance_scale=1.0,
                  max_sequence_length=16, output_type="latent")
    before = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(tmp_path / "ckpt")
    after = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert (after - before).abs().max() > 1e-3
    # The loaded transformer is our policy: same velocity (alpha / r scaling included).
    x, t = torch.randn(2, 4, 16, 16), torch.tensor([700.0, 300.0])
    emb, pooled = torch.randn(2, 32, 32), torch.randn(2, 32)
    with torch.no_grad():
        ours = env.model(hidden_states=x, timestep=t, encoder_hidden_states=emb, pooled_projections=pooled, return_dict=False)[0]
        stock = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=emb, pooled_projections=pooled, return_dict=False)[0]
    torch.testing.assert_close(stock, ours, rtol=1e-4, atol=1e-5)
    env.close()


def test_full_finetune_trains_every_weight_and_keeps_a_frozen_reference(tiny_sd3_dir, tmp_path):
    from diffusers import SD3Transformer2DModel

    env = make_env(tiny_sd3_dir, "model.lora.enabled=false", "algo.kl_coef=0.04", "ema.enabled=false")
    assert all(p.requires_grad for p in env.model.parameters())
    with env.models.reference() as ref:
        assert ref is not env.model and not any(p.requires_grad for p in ref.parameters())
    env.save_pretrained(tmp_path / "ckpt")
    loaded = SD3Transformer2DModel.from_pretrained(tmp_path / "ckpt" / "transformer")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), env.model.state_dict().values()))
    env.close()


def test_deterministic_evaluation_writes_a_grid_and_is_reproducible(tiny_sd3_dir, tmp_path):
    env = make_env(tiny_sd3_dir, "data.eval_size=4", "data.grid_size=4")
    first, media = env.evaluation(0, tmp_path)
    second = env.evaluation(0, tmp_path)[0]
    assert set(media) == {"images"} and "eval/grid" in media["images"]
    assert first == second and {k for k in first if k.startswith("eval/")} == {"eval/reward", "eval/reward/brightness"}
    # The off-target figures of the same images, logged by default (unirl/diffusion/offtarget.py).
    assert set(first) - {"eval/reward", "eval/reward/brightness"} == {
        f"offtarget/eval/{k}" for k in ("reward", "brightness", "dark_frac", "blown_frac", "diversity")}
    assert 0 < first["eval/reward"] < 1
    from PIL import Image

    grid = Image.open(tmp_path / "eval" / "step_000000.png")
    assert grid.size[0] == 4 * 160
    env.close()


def test_shipped_configs_load():
    from pathlib import Path

    for path in sorted((Path(__file__).parents[1] / "configs" / "diffusion").glob("*.yaml")):
        cfg = load_config(DiffusionConfig, path)
        assert cfg.rewards, path


@pytest.mark.parametrize("override, match", [
    ("sampling.noise_level=0", "noise_level"),
    ("sampling.sde_window.size=4", "sde_window"),  # 4 steps do not fit in range [0, 3)
    ("sampling.timestep_fraction=0", "timestep_fraction"),
    ("ema.decay=1.0", "decay"),
])
def test_bad_configs_fail_with_the_key(override, match):
    from unirl.config import ConfigError

    extra = ["sampling.sde_window.range=[0,3]"] if "sde_window" in override else []
    with pytest.raises(ConfigError, match=match):
        load_config(DiffusionConfig, None, [override, *extra])


def test_a_run_that_builds_the_toy_pipeline_starts_from_the_same_lora(tiny_sd3_dir, tmp_path, monkeypatch):
    # Building seeds torch's global generator; the LoRA's initialisation must not depend on whether
    # the toy pipeline was already in the cache.
    def lora_after_setup():
        torch.manual_seed(0)
        env = make_env(tiny_sd3_dir)
        return {name: p.detach().clone() for name, p in env.model.named_parameters() if "lora_" in name}

    cached = lora_after_setup()
    monkeypatch.setenv("UNIRL_CACHE", str(tmp_path))  # an empty cache: this setup builds the pipeline
    built = lora_after_setup()
    assert (tmp_path / "tiny-sd3-seed0").is_dir()
    assert cached.keys() == built.keys() and len(cached) > 0
    assert all(torch.equal(cached[k], built[k]) for k in cached)
    assert any(cached[k].abs().sum() > 0 for k in cached)  # the gaussian-initialised A matrices, not only zeros
