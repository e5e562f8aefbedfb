"""FLUX.1 Kontext in the diffusion environment, on the toy FLUX.1 Kontext (``tiny/flux_kontext.py``).

Each test compares with an independent reference: the stock ``FluxKontextPipeline`` (its input-image
latents and ids, noise, schedule, Euler steps and decoding), or the reward computed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import unirl
from unirl.config import load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.families.flux_kontext import FluxKontextFamily
from unirl.diffusion.sampling import sample_with_logprob
from unirl.diffusion.tiny.flux_kontext import build_tiny_flux_kontext

import diffusion_helpers  # tests/diffusion_helpers.py
from diffusion_helpers import perturb_lora

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "diffusion"
TINY = ["model.family=flux_kontext", "model.name_or_path=tiny", "sampling.guidance_scale=1.0",
        "sampling.resolution=32", "sampling.max_sequence_length=16", "trainer.prompts_per_step=2",
        "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "sampling.chunk_size=8",
        "sampling.num_steps=6", "sampling.eval_num_steps=6", f"data.train={CONFIGS / 'tiny_kontext_train.jsonl'}",
        f"data.test={CONFIGS / 'tiny_kontext_test.jsonl'}", "rewards=[{name: input_similarity}]"]


@pytest.fixture(scope="session")
def tiny_dir():
    return build_tiny_flux_kontext()


@pytest.fixture(scope="session")
def pipe(tiny_dir):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def inputs(tmp_path_factory):
    """Two input images as files (a solid colour, noise) at 40 px, so that they are resized."""
    from PIL import Image

    root = tmp_path_factory.mktemp("inputs")
    Image.new("RGB", (40, 40), (220, 30, 30)).save(root / "red.png")
    Image.effect_noise((40, 40), 60).convert("RGB").save(root / "noise.png")
    return [str(root / "red.png"), str(root / "noise.png")]


def resized(paths, size=32):
    from PIL import Image

    return [Image.open(p).convert("RGB").resize((size, size), Image.BICUBIC) for p in paths]


def make_env(*overrides: str):
    return diffusion_helpers.make_env(*TINY, *overrides)


def test_input_image_latents_and_ids_are_the_pipelines(pipe, inputs):
    family = FluxKontextFamily()
    with torch.no_grad():
        ours = family.encode_images(pipe, inputs, resolution=32, device="cpu")["image_latents"]
        pixels = pipe.image_processor.preprocess(resized(inputs), 32, 32)
        _, image_latents, latent_ids, image_ids = pipe.prepare_latents(pixels, 2, 4, 32, 32, torch.float32, "cpu",
                                                                       torch.Generator().manual_seed(0))
    assert ours.shape == (2, 64, 16) and torch.equal(ours, image_latents)
    tokens, ids = family.image_stream(torch.zeros(2, 64, 16), {"image_latents": ours})
    assert tokens.shape == (2, 128, 16) and torch.equal(tokens[:, 64:], ours)  # the input's tokens after the latents'
    assert torch.equal(ids, torch.cat([latent_ids, image_ids]))
    assert ids[64:, 0].eq(1).all() and ids[:64, 0].eq(0).all() and torch.equal(ids[64:, 1:], ids[:64, 1:])


def test_the_encoder_fit_inverts_the_decoder(pipe, inputs):
    """The toy's VAE encoder is fit to its decoder, so the input's colour reaches the transformer: the
    red input's latents decode to a red picture."""
    from unirl.diffusion.families.flux import unpack_latents

    with torch.no_grad():
        latents = FluxKontextFamily().encode_images(pipe, inputs[:1], resolution=32, device="cpu")["image_latents"]
        picture = FluxKontextFamily().decode(pipe, latents)[0]  # [3, 32, 32]
    r, g, b = picture.mean((1, 2)).tolist()
    assert r > 0.6 and g < 0.25 and b < 0.25, (r, g, b)  # the input is (220, 30, 30) / 255 = (0.86, 0.12, 0.12)
    assert unpack_latents(latents, 16, 16).shape == (1, 4, 16, 16)


@pytest.mark.parametrize("guidance", [2.5, 4.0])
def test_noise_level_zero_is_the_pipelines_euler_sampler(pipe, inputs, guidance):
    family, steps, prompts = FluxKontextFamily(guidance=guidance), 4, ["make it red", "keep it"]
    shape = family.latent_shape(pipe, 32)
    with torch.no_grad():
        cond = family.encode(pipe, prompts, max_sequence_length=16, device="cpu")
        cond.update(family.encode_images(pipe, inputs, resolution=32, device="cpu"))
    noise = family.noise(2, shape, torch.Generator().manual_seed(7))
    sigmas, timesteps = family.schedule(pipe.scheduler, steps, shape)
    none = torch.zeros(steps, dtype=torch.bool)
    ours = sample_with_logprob(family, pipe.transformer, noise, sigmas, timesteps, cond, guidance_scale=1.0,
                               noise_level=0.0, stochastic=none)
    # The pipeline at the sampling size: max_area sets its output size, and the input is already resized.
    kwargs = dict(image=resized(inputs), prompt=prompts, num_inference_steps=steps, height=32, width=32,
                  max_area=32 * 32, _auto_resize=False, max_sequence_length=16, guidance_scale=guidance)
    stock = pipe(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(7)).images
    torch.testing.assert_close(ours.final, stock, rtol=0, atol=1e-6)
    assert torch.equal(pipe.scheduler.sigmas.float(), sigmas)  # mu counts the latents' 64 tokens, not the input's
    images = pipe(**kwargs, output_type="pt", generator=torch.Generator().manual_seed(7)).images
    torch.testing.assert_close(family.decode(pipe, ours.final), images, rtol=0, atol=1e-5)
    # The input image matters: the two inputs swapped give other latents.
    swapped = {**cond, "image_latents": cond["image_latents"].flip(0)}
    other = sample_with_logprob(family, pipe.transformer, noise, sigmas, timesteps, swapped, guidance_scale=1.0,
                                noise_level=0.0, stochastic=none)
    assert (other.final - ours.final).abs().max() > 1e-3


@pytest.mark.parametrize("overrides", [
    (),
    ("sampling.sde_window.size=2", "sampling.sde_window.range=[1,5]", "sampling.same_noise_per_group=true"),
])
def test_first_update_is_exactly_on_policy(tiny_dir, overrides):
    env = make_env(*overrides)
    perturb_lora(env)
    rows = env.prompts.next(0)
    rollout = env.sampler.rollout(rows, group_size=4)
    assert rollout.tensors["image_latents"].shape == (8, 64, 16)  # each row's input, repeated for its group
    assert rollout.columns["image"] == [row["image"] for row in rows for _ in range(4)]  # the reward's input paths
    assert all(Path(p).is_absolute() and Path(p).is_file() for p in rollout.columns["image"])
    old = rollout.old_logp
    with torch.no_grad():
        cur = env.actions.score_actions(env.model, rollout)
    assert torch.equal(cur["logp"], old)  # ratio exactly 1
    env.actions.score_actions(env.model, rollout, slice(0, 1))["logp"].sum().backward()
    grads = {n: p.grad for n, p in env.model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert sum(float(g.abs().sum()) for g in grads.values() if g is not None) > 0
    # The reward saw both images: input_similarity recomputed by hand from the samples and the input files.
    import numpy as np
    from PIL import Image

    scores, _ = env.scorer.score(rollout)
    by_hand = [1 - np.abs(np.asarray(x, dtype=np.float64) - np.asarray(Image.open(p).convert("RGB"), dtype=np.float64)).mean() / 255
               for x, p in zip(rollout.samples, rollout.columns["image"])]  # the inputs are 32 px already
    torch.testing.assert_close(rollout.tensors["score/input_similarity"].double(), torch.tensor(by_hand), rtol=0, atol=1e-6)
    env.close()


def test_saved_lora_loads_into_a_stock_kontext_pipeline(tiny_dir, inputs, tmp_path):
    from diffusers import FluxKontextPipeline

    env = make_env("ema.enabled=false")
    perturb_lora(env, scale=0.5)
    env.save_pretrained(tmp_path / "ckpt")
    pipe = FluxKontextPipeline.from_pretrained(tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(image=resized(inputs[:1]), prompt="keep it", num_inference_steps=4, height=32, width=32,
                  max_area=32 * 32, _auto_resize=False, max_sequence_length=16, output_type="latent")
    before = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(tmp_path / "ckpt")
    after = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert (after - before).abs().max() > 1e-3
    family = FluxKontextFamily()
    x, t = torch.randn(2, 64, 16), torch.tensor([700.0, 300.0])
    cond = {"prompt_embeds": torch.randn(2, 16, 32), "pooled": torch.randn(2, 16), "image_latents": torch.randn(2, 64, 16)}
    with torch.no_grad():
        torch.testing.assert_close(family.velocity(pipe.transformer, x, t, cond), family.velocity(env.model, x, t, cond),
                                   rtol=1e-4, atol=1e-5)
    env.close()


def test_evaluation_samples_each_rows_input(tiny_dir, tmp_path):
    env = make_env("data.eval_size=4", "data.grid_size=4")
    first = env.evaluation(0, tmp_path)[0]
    assert first == env.evaluation(0, tmp_path)[0] and 0 < first["eval/reward"] < 1
    assert (tmp_path / "eval" / "step_000000.png").exists()
    env.close()


def test_the_tiny_config_names_an_image_per_row():
    cfg = load_config(DiffusionConfig, CONFIGS / "tiny_kontext.yaml")
    assert cfg.model.family == "flux_kontext" and cfg.sampling.guidance_scale == 1.0
    from unirl.diffusion.prompts import load_prompt_rows

    rows = load_prompt_rows(str(CONFIGS / "tiny_kontext_test.jsonl"), "test", image=True)
    assert len(rows) == 8 and all(Path(r["image"]).is_file() for r in rows)
    with pytest.raises(ValueError, match="row 1: model.family takes a conditioning image"):
        load_prompt_rows("tiny", "train", image=True)


@pytest.mark.slow
def test_tiny_kontext_run_learns(tmp_path):
    run = tmp_path / "run"
    unirl.train("diffusion", "tiny_kontext", output_dir=run, progress=False)  # in this process: the CLI's own path (unirl.train), without a second Python and torch start-up
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 40
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.025, rewards  # measured: 0.615 -> 0.655
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 20, 40] and evals[-1]["eval/reward"] > evals[0]["eval/reward"] + 0.02
    # Part of the rise reads the input: each test row's image is closer to its own input when sampled from
    # that input than from another row's (the row 4 further on: red <-> white, blue <-> black, ...). The
    # random toy barely does (measured: 0.001 on average); the trained LoRA does (0.025).
    from unirl.rewards.image import input_similarity

    env = diffusion_helpers.make_env(*TINY, "model.lora.enabled=false", "ema.enabled=false", "sampling.eval_num_steps=16",
                                     "data.eval_size=8")
    test = env.test_rows
    other = [{**row, "image": test[(i + 4) % len(test)]["image"]} for i, row in enumerate(test)]
    own_inputs = [row["image"] for row in test]

    def gap() -> float:
        with torch.no_grad():
            own = input_similarity(env.sample_deterministic(test), image=own_inputs)
            swapped = input_similarity(env.sample_deterministic(other), image=own_inputs)
        return (sum(own) - sum(swapped)) / len(test)

    before = gap()
    env.pipe.load_lora_weights(run / "checkpoints" / "step_000040")  # into the transformer env samples with
    assert env.model is env.pipe.transformer
    after = gap()
    assert before < 0.005 and after > 0.015, (before, after)
    env.close()


def test_the_dry_run_checks_every_rows_input_image(tmp_path):
    from PIL import Image

    from unirl.preflight import preflight

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    prompts = tmp_path / "edits.jsonl"
    prompts.write_text(json.dumps({"prompt": "keep it", "image": "a.png"}) + "\n"
                       + json.dumps({"prompt": "keep it", "image": "b.png"}) + "\n")
    cfg = load_config(DiffusionConfig, None, [*TINY, f"data.train={prompts}"])
    problems = preflight(cfg, "diffusion").problems
    assert len(problems) == 1 and "data.train" in problems[0] and "row 2" in problems[0] and "'b.png'" in problems[0]
