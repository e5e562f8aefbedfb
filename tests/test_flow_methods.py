"""The faster diffusion methods (``algorithm: awm | dgpo | tempflow``): each loss against its reference
re-typed here on the same tensors (loss and gradient), AWM's ratio loss against the paper's
advantage-weighted matching, DGPO's group weight by hand, TempFlow's branching rollout on the toy SD3,
and each shipped tiny config raising both colours' held-out rewards on ``tiny_colour``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from unirl.core.flow_methods import DgpoArgs, TempflowArgs, dgpo_group_weights, matching_log_prob
from unirl.core.policy_losses import POLICY_LOSSES, LossInputs, LossSettings

from stage_helpers import diffusion_trainer  # tests/stage_helpers.py

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """The toy runs on one thread, as tests/test_distill.py's teacher: small batches run fastest there, and with
    torch's default threads a busy 2-core machine made the 30-step runs 20-30x slower (tiny_colour_awm: 2.4 s
    on one thread, 76 s on two beside another job)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def forward_inputs(seed: int, n: int = 8, shape=(4, 3, 3)):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)
    sigma = torch.rand(n, generator=g) * 0.9 + 0.05
    v = (eps - x0 + 0.5 * torch.randn(n, *shape, generator=g)).requires_grad_(True)
    adv = torch.randn(n, generator=g)
    return x0, eps, sigma, v, adv


# ------------------------------------------------------------------------------------------- AWM
def flow_factory_weighted_log_prob(model_output, target, timestep, weighting="Uniform", ghuber_power=0.25):
    """Flow-Factory ``AWMTrainer.compute_weighted_log_prob`` (src/flow_factory/trainers/awm.py, commit a0b2bc5),
    re-typed; ``timestep`` in scheduler scale [0, 1000], ``t = timestep / 1000`` (its ``flow_match_sigma``)."""
    model_output, target = model_output.double(), target.double()
    log_prob = -(model_output - target) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = timestep.view(-1) / 1000
    if weighting == "t":
        log_prob = log_prob * t
    elif weighting == "t**2":
        log_prob = log_prob * t ** 2
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        eps = torch.tensor(1e-10, dtype=log_prob.dtype)
        log_prob = -(torch.pow(-log_prob + eps, ghuber_power) - torch.pow(eps, ghuber_power)) * t / ghuber_power
    return log_prob.float()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weighting", ["uniform", "t", "t**2", "huber", "ghuber"])
def test_awm_log_prob_is_flow_factorys(seed, weighting):
    x0, eps, sigma, v, _ = forward_inputs(seed)
    mine = matching_log_prob(v, eps - x0, sigma, weighting=weighting)
    theirs = flow_factory_weighted_log_prob(v, eps - x0, sigma * 1000, "Uniform" if weighting == "uniform" else weighting)
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(mine.sum(), v)[0], torch.autograd.grad(theirs.sum(), v)[0],
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", range(3))
def test_awm_ratio_loss_is_flow_factorys_and_at_ratio_one_the_papers_weighted_matching(seed):
    x0, eps, sigma, v, adv = forward_inputs(seed)
    clip = 1e-4
    logp = matching_log_prob(v, eps - x0, sigma)  # [n]
    old = logp.detach() + 0.01 * torch.randn(len(logp), generator=torch.Generator().manual_seed(seed))
    inputs = LossInputs({"logp": logp[:, None], "mask": None}, adv[:, None], old_logp=old[:, None], denominator=len(logp))
    mine, _ = POLICY_LOSSES.get("clipped").fn(inputs, LossSettings(clip_low=clip, clip_high=clip))
    # Flow-Factory's optimize: ratio = exp(log_prob - old), max(-A r, -A clamp(r, 1 - 1e-4, 1 + 1e-4)), mean.
    ratio = torch.exp(logp - old)
    theirs = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)))
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(mine, v, retain_graph=True)[0],
                               torch.autograd.grad(theirs, v, retain_graph=True)[0], rtol=1e-5, atol=1e-9)
    # On-policy (old = this forward's): the gradient of the paper's loss, mean(A ||v - (eps - x0)||^2) / n.
    at_one = LossInputs({"logp": logp[:, None], "mask": None}, adv[:, None], old_logp=logp.detach()[:, None],
                        denominator=len(logp))
    loss, _ = POLICY_LOSSES.get("clipped").fn(at_one, LossSettings(clip_low=clip, clip_high=clip))
    paper = (adv * (v - (eps - x0)).square().flatten(1).mean(1)).mean()
    torch.testing.assert_close(torch.autograd.grad(loss, v, retain_graph=True)[0], torch.autograd.grad(paper, v)[0],
                               rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------------------------------------ DGPO
def flow_factory_dgpo(model_v, old_v, ref_v, target_v, adv, group_index, num_groups, dpo_beta, group_size, clip_range):
    """Flow-Factory ``DGPOTrainer`` (src/flow_factory/trainers/dgpo.py, commit a0b2bc5) at one timestep,
    re-typed: ``_compute_dsm_loss``, ``_maybe_clip_dsm`` (clip_dsm), ``_compute_group_dgpo_loss``."""
    b = target_v.shape[0]
    dsm_loss = (target_v - model_v).square().reshape(b, -1).mean(dim=1)
    old_dsm = (target_v - old_v).square().reshape(b, -1).mean(dim=1)
    ratio = torch.exp(-dsm_loss.detach() + old_dsm)
    should_clip = torch.where(adv > 0, ratio > 1.0 + clip_range[1], ratio < 1.0 + clip_range[0])
    dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    with torch.no_grad():
        ref_dsm = (target_v - ref_v).square().reshape(b, -1).mean(dim=1)
    per_sample = adv * dpo_beta * (dsm_loss.detach() - ref_dsm) / group_size
    sums = torch.zeros(num_groups, dtype=per_sample.dtype).scatter_add_(0, group_index, per_sample)
    weights = torch.sigmoid(sums)[group_index].detach()
    return (weights * adv * dsm_loss).mean(), should_clip


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", [0.05, 10.0])  # some DSM errors clipped / none
def test_dgpo_loss_is_flow_factorys(seed, clip):
    x0, eps, sigma, v, adv = forward_inputs(seed, n=8)
    g = torch.Generator().manual_seed(50 + seed)
    old_v, ref_v = v.detach() + 0.5 * torch.randn(v.shape, generator=g), v.detach() + 0.3 * torch.randn(v.shape, generator=g)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    target = eps - x0
    forward = {"velocity": v[:, None], "old_velocity": old_v[:, None], "ref_velocity": ref_v[:, None],
               "target": target[:, None], "group": groups, "mask": None}
    args = DgpoArgs(beta=10.0)
    mine, figures = POLICY_LOSSES.get("dgpo").fn(LossInputs(forward, adv, denominator=8),
                                                  LossSettings(clip_low=clip, clip_high=clip, args=args))
    theirs, clipped = flow_factory_dgpo(v, old_v, ref_v, target, adv, groups, 2, 10.0, 4, (-clip, clip))
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-9)
    torch.testing.assert_close(torch.autograd.grad(mine, v, retain_graph=True)[0],
                               torch.autograd.grad(theirs, v)[0], rtol=1e-5, atol=1e-9)
    assert figures["loss/dsm_clip_frac"].item() == pytest.approx(clipped.float().mean().item())
    assert (clipped.any().item()) == (clip == 0.05)


def test_dgpo_group_weight_by_hand():
    # Group 0: A = (1, -1), dsm - ref = (-0.1, +0.1) -> sum = beta (1 * -0.1 + -1 * 0.1) / 2 = -0.1 beta.
    # Group 1: one sample, A = 2, dsm - ref = 0.05 -> 2 * 0.05 beta.
    dsm, ref = torch.tensor([0.4, 0.6, 0.55]), torch.tensor([0.5, 0.5, 0.5])
    w = dgpo_group_weights(dsm, ref, torch.tensor([1.0, -1.0, 2.0]), torch.tensor([0, 0, 5]), beta=10.0)
    s0, s1 = 1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(w, torch.tensor([s0, s0, s1]))


# -------------------------------------------------------------------------------------- TempFlow
@pytest.mark.parametrize("seed", range(3))
def test_tempflow_loss_is_its_codes(seed):
    g = torch.Generator().manual_seed(seed)
    n, clip = 8, 0.05
    logp = torch.randn(n, generator=g).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(n, generator=g)
    adv, std = torch.randn(n, generator=g), torch.rand(n, generator=g) * 0.3 + 0.01
    inputs = LossInputs({"logp": logp[:, None], "std": std[:, None], "mask": None}, adv[:, None],
                        old_logp=old[:, None], denominator=n)
    mine, _ = POLICY_LOSSES.get("tempflow").fn(inputs, LossSettings(clip_low=clip, clip_high=clip, args=TempflowArgs()))
    # TempFlow-GRPO's scripts/train_sd3_pr.py (commit e66824e): std_dev_t is the step's std (its
    # sde_step_with_logprob returns std_dev_t * sqrt(-dt)); Tencent UniRL's weight is the same.
    ratio = torch.exp(logp - old)
    unclipped = -2.25 * std * adv * ratio
    clipped = -2.25 * std * adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    theirs = torch.mean(torch.maximum(unclipped, clipped))
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(mine, logp, retain_graph=True)[0],
                               torch.autograd.grad(theirs, logp)[0], rtol=1e-5, atol=1e-9)


make_trainer = diffusion_trainer  # tests/stage_helpers.py: the toy SD3 at its smallest


def test_tempflow_branches_each_prompt_at_one_step_and_rescores_its_log_probs(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm=tempflow", "trainer.seed=3")
    env = trainer.env
    rollout = env.sampler.rollout(env.prompts.next(0), 4)
    steps, latents, nxt = rollout.tensors["step_index"], rollout.tensors["latents"], rollout.tensors["next_latents"]
    assert steps.shape == (12, 1) and rollout.old_logp.shape == (12, 1)
    assert len(set(steps.flatten().tolist())) > 1  # the prompts branch at different steps (this seed)
    for g in range(3):  # a group: one step, one latent there (the ODE prefix), G different next latents
        members = torch.arange(4 * g, 4 * g + 4)
        assert len(set(steps[members, 0].tolist())) == 1
        assert all(torch.equal(latents[members[0]], latents[m]) for m in members)
        assert not torch.equal(nxt[members[0]], nxt[members[1]])
    assert rollout.prompts[::4] == [rollout.prompts[4 * g] for g in range(3)]
    with torch.no_grad():  # the stored steps re-scored under the sampling weights: the sampler's log-probs
        torch.testing.assert_close(env.actions.score_actions(env.model, rollout)["logp"], rollout.old_logp, rtol=0, atol=1e-5)
    metrics = trainer.learn(rollout, env.scorer.score(rollout)[0])[1]
    assert metrics["loss/tempflow_weight"] > 0 and metrics["actor/grad_norm"] > 0
    env.close()


@pytest.mark.parametrize("algorithm", ["awm", "dgpo"])
def test_forward_process_methods_train_a_step_on_the_toy(tmp_path, algorithm):
    trainer = make_trainer(tmp_path, f"algorithm={algorithm}", "sampling.timestep_fraction=0.34")
    env = trainer.env
    rollout = env.sampler.rollout(env.prompts.next(0), 4)
    assert rollout.tensors["clean"].shape[0] == 12 and rollout.tensors["sigma"].shape == (12, 2)
    if algorithm == "dgpo":  # levels shared by the batch, noise by the group (and by its levels)
        assert (rollout.tensors["sigma"] == rollout.tensors["sigma"][:1]).all()
        noise = rollout.tensors["noise"]
        assert torch.equal(noise[0, 0], noise[3, 1]) and not torch.equal(noise[0, 0], noise[4, 0])
    before = [p.detach().clone() for p in env.model.parameters() if p.requires_grad]
    metrics = trainer.learn(rollout, env.scorer.score(rollout)[0])[1]
    assert metrics["actor/grad_norm"] > 0
    if algorithm == "awm":  # the old log-probs are the update's first forward: ratio 1
        assert metrics["actor/clip_frac"] == 0.0
    else:
        assert metrics["loss/dgpo_weight"] == pytest.approx(0.5)  # the policy is the reference: no preference yet
    assert any(not torch.equal(p.detach(), b) for p, b in zip(
        [p for p in env.model.parameters() if p.requires_grad], before))
    env.close()


def _per_colour():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from time_to_reward import per_colour

    return per_colour


@pytest.mark.parametrize("method", ["awm", "dgpo", "tempflow"])
def test_tiny_colour_config_learns_each_colour(tmp_path, method):
    """The shipped config for 30 steps: the held-out reward of the "red" prompts and of the "blue" ones
    both rise (one colour for every prompt would lower the other)."""
    from unirl.config import load_config
    from unirl.diffusion import build_environment
    from unirl.diffusion.config import DiffusionConfig
    from unirl.trainer.loop import Trainer

    per_colour = _per_colour()
    cfg = load_config(DiffusionConfig, REPO / f"configs/diffusion/tiny_colour_{method}.yaml",
                      ["trainer.eval_every=0", "trainer.progress=false", f"output_dir={tmp_path}"])
    trainer = Trainer.from_config(build_environment(cfg), cfg)
    trainer.setup()
    before = per_colour(trainer.env)
    for _ in range(30):
        trainer.train_step()
    after = per_colour(trainer.env)
    trainer.env.close()
    assert set(before) == {"red", "blue"}
    for colour in before:
        assert after[colour] > before[colour] + 0.1, (before, after)
