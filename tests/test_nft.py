"""DiffusionNFT (``algorithm: nft``): the loss against the paper's equations, its no-preference fixed
point, the old policy's schedule, the rollout and update on the toy SD3, exact resume, and the shipped
config kept equal to the benchmark's overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_stopped_after
from unirl.config import config_to_dict, load_config
from unirl.core.nft import nft_loss, optimality_probability, velocity_kl
from unirl.diffusion.config import DiffusionConfig

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.name_or_path=tiny", "sampling.resolution=32", "sampling.max_sequence_length=16",
        "sampling.guidance_scale=1.0", "sampling.train_cfg=false", "trainer.prompts_per_step=2",
        "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "sampling.chunk_size=8",
        "sampling.num_steps=4", "sampling.eval_num_steps=4", "algorithm=nft", "ema.enabled=false"]


# ------------------------------------------------------------------------------------------ the loss
def paper_loss(v, v_old, x0, eps, t, adv, beta, a_max):
    """The paper's objective re-typed in velocity form, sample by sample: u = eps - x0,
    v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v, r = 1/2 + 1/2 clip(A / A_max, -1, 1);
    NVlabs' x0-space error x0_pred - x0 = -t (v - u) with the adaptive weight mean|x0_pred - x0|, so each
    branch is t^2 mean((v - u)^2) / (t mean|v - u|); scaled by A_max / beta."""
    out = []
    for i in range(v.shape[0]):
        u = eps[i] - x0[i]
        pos = (1 - beta) * v_old[i] + beta * v[i]
        neg = (1 + beta) * v_old[i] - beta * v[i]
        r = 0.5 + 0.5 * max(-1.0, min(1.0, float(adv[i]) / a_max))
        branch = [t[i] ** 2 * ((w - u) ** 2).mean() / max(float(t[i] * (w - u).abs().mean()), 1e-5) for w in (pos, neg)]
        out.append(a_max / beta * (r * branch[0] + (1 - r) * branch[1]))
    return torch.stack(out)


def inputs(seed: int, n: int = 5, shape=(4, 3, 3)):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)
    t = torch.rand(n, generator=g) * 0.9 + 0.05
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    v_old = torch.randn(n, *shape, generator=g)
    v = v_old + 0.3 * torch.randn(n, *shape, generator=g)
    adv = torch.randn(n, generator=g) * 4  # some beyond A_max = 5 after scaling
    adv[0] = 9.0
    return v, v_old, x0, eps, xt, t, adv


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_is_the_papers_objective(seed, beta):
    v, v_old, x0, eps, xt, t, adv = inputs(seed)
    loss, figures = nft_loss(v, v_old, x0, xt, t, adv, beta=beta, adv_clip=5.0)
    torch.testing.assert_close(loss, paper_loss(v, v_old, x0, eps, t, adv, beta, 5.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(figures["old_deviation"], ((v - v_old) ** 2).mean(dim=(1, 2, 3)))
    # Gradients: autograd of the re-typed objective, with its weights detached as the code detaches them.
    v1, v2 = v.clone().requires_grad_(), v.clone().requires_grad_()
    nft_loss(v1, v_old, x0, xt, t, adv, beta=beta, adv_clip=5.0)[0].sum().backward()
    u = eps - x0
    pos, neg = beta * v2 + (1 - beta) * v_old, (1 + beta) * v_old - beta * v2
    r = optimality_probability(adv, 5.0).view(-1, 1, 1, 1)
    tt = t.view(-1, 1, 1, 1)
    w = [(tt * (b - u)).abs().mean(dim=(1, 2, 3), keepdim=True).detach() for b in (pos, neg)]
    ((5.0 / beta) * (r * tt**2 * (pos - u) ** 2 / w[0] + (1 - r) * tt**2 * (neg - u) ** 2 / w[1])
     .mean(dim=(1, 2, 3), keepdim=True)).sum().backward()
    torch.testing.assert_close(v1.grad, v2.grad, rtol=1e-5, atol=1e-7)


def test_optimality_probability_by_hand():
    # A / A_max = -2 (clipped), -0.5, 0, 0.4, 1 (at the clip): r = 0, 0.25, 0.5, 0.7, 1.
    r = optimality_probability(torch.tensor([-10.0, -2.5, 0.0, 2.0, 5.0]), 5.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.25, 0.5, 0.7, 1.0]))


@pytest.mark.parametrize("seed", range(3))
def test_no_reward_signal_leaves_the_old_policy_a_fixed_point(seed):
    """Every advantage 0 (a group of equal rewards): r = 1/2, no preference. At v = v_old the gradient
    vanishes (the update leaves the policy where it is) and the loss is the old policy's own
    flow-matching loss in NVlabs' weighting; away from it, unweighted, the loss is
    ||v_old - u||^2 + beta^2 ||v - v_old||^2 (the parallelogram law), so descent returns to v_old."""
    v, v_old, x0, eps, xt, t, _ = inputs(seed)
    zero = torch.zeros(v.shape[0])
    at_old = v_old.clone().requires_grad_()
    loss, _ = nft_loss(at_old, v_old, x0, xt, t, zero, beta=1.0, adv_clip=5.0)
    loss.sum().backward()
    assert at_old.grad.abs().max() < 1e-6
    u, tt = eps - x0, t.view(-1, 1, 1, 1)
    fm = 5.0 * tt.flatten() * ((v_old - u) ** 2).mean(dim=(1, 2, 3)) / (v_old - u).abs().mean(dim=(1, 2, 3))
    torch.testing.assert_close(loss.detach(), fm, rtol=1e-5, atol=1e-6)
    # A signal breaks the fixed point: positive advantages pull v+ (here v) towards u.
    moved = v_old.clone().requires_grad_()
    nft_loss(moved, v_old, x0, xt, t, torch.full_like(zero, 2.0), beta=1.0, adv_clip=5.0)[0].sum().backward()
    assert moved.grad.abs().max() > 1e-3
    # Unweighted identity (the paper's loss with r = 1/2), the reason the fixed point is v_old:
    beta = 0.3
    pos, neg = (1 - beta) * v_old + beta * v, (1 + beta) * v_old - beta * v
    half = 0.5 * ((pos - u) ** 2).sum() + 0.5 * ((neg - u) ** 2).sum()
    torch.testing.assert_close(half, ((v_old - u) ** 2).sum() + beta**2 * ((v - v_old) ** 2).sum())


def test_velocity_kl_and_bad_arguments():
    v, v_old, *_ = inputs(0)
    torch.testing.assert_close(velocity_kl(v, v_old), ((v - v_old) ** 2).mean(dim=(1, 2, 3)))
    from unirl.core.policy_losses import NftArgs

    with pytest.raises(ValueError, match="beta"):  # checked once, where the config loads (algo.loss_args)
        NftArgs(beta=0.0)


# ------------------------------------------------------------------------------------- old policy
def test_old_policy_decay_schedule_and_catch_up_by_hand():
    from unirl.diffusion.nft import OldPolicy

    p = torch.nn.Parameter(torch.zeros(2))
    old = OldPolicy([p], flat=2, rate=0.25, ceiling=0.6)
    # d = 0 before `flat` optimizer steps, then min(0.25 (k - 2), 0.6): NVlabs' return_decay.
    assert [old.decay_at(k) for k in (0, 1, 2, 3, 4, 5, 9)] == [0.0, 0.0, 0.0, 0.25, 0.5, 0.6, 0.6]
    with torch.no_grad():
        p.fill_(1.0)
    old.catch_up()  # no optimizer step seen: no move
    assert old.shadow[0].tolist() == [0.0, 0.0]
    old.saw(1), old.saw(3)  # two optimizer steps in a training step: one move, with the decay at k = 3
    old.catch_up()
    assert old.shadow[0].tolist() == [0.75, 0.75]  # 0.25 * 0 + 0.75 * 1
    old.catch_up()  # nothing new: no second move
    assert old.shadow[0].tolist() == [0.75, 0.75]
    state = old.state_dict()
    fresh = OldPolicy([p], flat=2, rate=0.25, ceiling=0.6)
    fresh.load_state_dict(state)
    assert (fresh.seen, fresh.moved, fresh.shadow[0].tolist()) == (3, 3, [0.75, 0.75])


# ------------------------------------------------------------------------------------------ config
def _benchmark():
    """``benchmarks/time_to_reward.py`` as a module (its method table and per-colour evaluation)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import time_to_reward
    finally:
        sys.path.pop(0)
    return time_to_reward


def test_shipped_nft_config_is_the_benchmarks_overrides_of_flowgrpos():
    config, overrides = _benchmark().METHODS["nft"]
    mine = config_to_dict(load_config(DiffusionConfig, REPO / "configs/diffusion/tiny_colour_nft.yaml"))
    theirs = config_to_dict(load_config(DiffusionConfig, REPO / "configs/diffusion" / config.format(task="tiny_colour"),
                                        overrides))
    mine.pop("output_dir"), theirs.pop("output_dir")
    assert mine == theirs


@pytest.mark.parametrize("override, match", [
    ("sampling.train_cfg=true", "CFG-free"),
    ("algo.kl_coef=0.04", "algo.loss_args.kl_coef"),
    ("sampling.sde_window.size=2", "sde_window"),
    ("algo.loss_args.beta=0", "beta"),
    ("nft.beta=0.1", "moved to algo.loss_args.beta"),
    ("algo.loss_args.betta=0.1", "algo.loss_args.betta: not a setting of the policy loss 'nft'; its settings: adv_clip, beta, kl_coef"),
    ("nft.old_decay_max=1.0", "old_decay_max"),
])
def test_bad_nft_settings_fail_with_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(DiffusionConfig, None, [*TINY, override])


# ----------------------------------------------------------------------------- environment and loop
def make_trainer(tmp_path, *overrides: str):
    from unirl.diffusion import build_environment
    from unirl.trainer.loop import Trainer

    cfg = load_config(DiffusionConfig, None, [*TINY, "trainer.eval_every=0", "trainer.progress=false",
                                              "trainer.reward_workers=0", *overrides])
    trainer = Trainer(build_environment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer,
                      run_dir=tmp_path, config_dict=config_to_dict(cfg))
    trainer.setup()
    return trainer


def test_rollout_keeps_clean_latents_and_the_first_update_starts_at_the_old_policy(tmp_path):
    trainer = make_trainer(tmp_path, "sampling.timestep_fraction=0.5", "algo.loss_args.kl_coef=0.01")
    env = trainer.env
    rollout = env.sampler.rollout(env.prompts.next(0), 4)
    N, T = 8, 2  # int(4 * 0.5) noise levels per sample, drawn from the 4-step schedule
    assert rollout.tensors["clean"].shape == (N, *env.latent_shape)
    assert rollout.tensors["noise"].shape == (N, T, *env.latent_shape)
    assert not {"latents", "next_latents"} & set(rollout.tensors)  # no trajectory
    assert rollout.old_logp is None and rollout.engine_logp is None  # no log-probs
    sigmas = env.train_sigmas[:-1].float()
    assert all(float(s) in sigmas.tolist() for s in rollout.tensors["sigma"].flatten())
    assert all(len(set(row.tolist())) == T for row in rollout.tensors["sigma"])  # distinct levels per sample
    # The rollout is the ODE sample of the old policy: the evaluation sampler's at the training steps.
    metrics = trainer.learn(rollout, env.scorer.score(rollout)[0])[1]
    assert metrics["loss/old_deviation"] == 0.0  # first update: the current policy is the old one
    assert metrics["loss/kl"] < 1e-12 and metrics["actor/grad_norm"] > 0
    assert not any(k.startswith("actor/ratio") for k in metrics)  # no ratio: NFT has no log-probs
    # The old policy moves only at the next rollout, with decay 0 on the first step (decay_type 1).
    moved = [p.detach().clone() for p in env.mode.old.params]
    env.sampler.rollout(env.prompts.next(1), 4)
    assert all(torch.allclose(s, p) for s, p in zip(env.mode.old.shadow, moved))
    env.close()


def _cli(run: Path, *overrides: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "diffusion", "--config",
                           str(REPO / "configs/diffusion/tiny_colour_nft.yaml"), "--output-dir", str(run),
                           "trainer.progress=false", *overrides], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_nft_resumes_exactly(tmp_path):
    """Four steps in one go against the same run stopped after its step-2 checkpoint and resumed for two
    more: the same figures, step by step (the old policy, its counters and the EMA are in the checkpoint)."""
    common = ["trainer.eval_every=0", "trainer.save_every=2", "trainer.prompts_per_step=2", "trainer.group_size=4",
              "trainer.mini_batch_size=4", "trainer.micro_batch_size=4", "nft.old_decay_rate=0.2"]
    whole = _cli(tmp_path / "whole", "trainer.total_steps=4", *common)
    split = _cli(run_stopped_after(tmp_path / "whole", 2, tmp_path / "split"), "trainer.total_steps=4",
                 "trainer.resume=true", *common)
    assert [r["step"] for r in split if "reward/mean" in r] == [1, 2, 3, 4]  # steps 3 and 4 logged once, resumed
    keys = ("reward/mean", "loss/policy", "loss/old_deviation", "actor/grad_norm")
    assert [[r[k] for k in keys] for r in whole if "reward/mean" in r][2:] == \
           [[r[k] for k in keys] for r in split if "reward/mean" in r][2:]
    assert whole[-1]["loss/old_deviation"] > 0  # the old policy lags: the check covers its state


@pytest.mark.slow
def test_tiny_colour_nft_learns_each_colour(tmp_path):
    """The shipped config for 30 steps: the held-out reward of the "red" prompts and of the "blue" ones
    both rise (one colour for every prompt would lower the other)."""
    from unirl.diffusion import build_environment
    from unirl.trainer.loop import Trainer

    benchmark = _benchmark()
    cfg = load_config(DiffusionConfig, REPO / "configs/diffusion/tiny_colour_nft.yaml",
                      ["trainer.eval_every=0", "trainer.progress=false", f"output_dir={tmp_path}"])
    trainer = Trainer(build_environment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=tmp_path,
                      config_dict=config_to_dict(cfg))
    trainer.setup()
    before = benchmark.per_colour(trainer.env)
    for _ in range(30):
        trainer.train_step()
    after = benchmark.per_colour(trainer.env)
    trainer.env.close()
    assert set(before) == {"red", "blue"}
    for colour in before:
        assert after[colour] > before[colour] + 0.1, (before, after)
