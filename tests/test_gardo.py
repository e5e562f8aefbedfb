"""GARDO (``algorithm: gardo``, ``unirl/core/gardo.py`` and ``unirl/diffusion/gardo.py``): its gate, gate controller,
diversity advantages and loss against flow_grpo's ``scripts/train_sd3_gardo.py`` and ``stat_tracking.py`` re-typed
here (numpy, as the code), the gate by hand, and on the toy SD3 the reference's reset (equal to the policy right
after a reset step, not before) and the shipped config's reward rising."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from unirl.core.gardo import (GardoArgs, diversity_advantages, diversity_weights, next_gate_fraction, uncertainty,
                              uncertainty_gate)
from unirl.core.policy_losses import POLICY_LOSSES, LossInputs, LossSettings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """The toy runs on one thread, as tests/test_flow_methods.py's (small batches run fastest there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------- the code, re-typed
def code_gate(main, aux1, aux2, kl_perc):
    """train_sd3_gardo.py: ranks by ``torch.sort(descending=True)`` (1 the best) of the main and two auxiliary
    rewards, ``u = rank_main - (rank_1 + rank_2) / 2``, threshold ``np.percentile(u[u >= 0], 100 - kl_perc * 100)``,
    gate ``u > threshold``."""
    ranks = []
    for r in (aux1, aux2, main):
        r = torch.tensor(r)
        _, indices = torch.sort(r, descending=True)
        rank = torch.empty_like(r).long()
        rank[indices] = torch.arange(1, len(r) + 1)
        ranks.append(rank.float())
    u = ranks[-1] - (ranks[0] + ranks[1]) / 2
    threshold = np.percentile(np.array([p for p in u.numpy() if p >= 0]), 100 - kl_perc * 100)
    return u.numpy(), u.numpy() > threshold


class CodeRiskCompensator:
    """train_sd3_gardo.py's ``RiskCompensator``, re-typed."""

    def __init__(self, base=0.1):
        self.buffer, self.base, self.alpha, self.beta = [], base, 0.1, 0.1

    def update(self, scores):
        if len(self.buffer) == 0:
            self.beta = self.base
        elif np.mean(scores) > max(self.buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(scores) < min(self.buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, 0.02, 0.2)
        self.buffer.append(np.mean(scores))
        self.buffer = self.buffer[-20:]


def code_gardo_advantages(prompts, rewards, dists):
    """stat_tracking.py ``PerPromptStatTracker.update(type='gardo')``: features normalised, per prompt each
    sample's smallest ``1 - cos`` to the others, positive centred rewards times ``d / mean(d)``."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    dists = np.array(dists) / np.linalg.norm(dists, ord=2, axis=1, keepdims=True)
    advantages = np.zeros_like(rewards)
    for prompt in np.unique(prompts):
        r = rewards[prompts == prompt]
        mean = np.mean(r, axis=0, keepdims=True)
        f = dists[prompts == prompt]
        distance = 1 - np.dot(f, f.T).clip(-1, 1)
        d = np.array([np.min(distance[i, np.arange(len(f)) != i]) for i in range(len(f))])
        d = np.repeat(d[:, None], r.shape[-1], axis=1)
        factor = np.where((r - mean) < 0, np.ones_like(d), d / np.mean(d))
        advantages[prompts == prompt] = (r - mean) * factor
    return advantages


def code_step_loss(log_prob, old_log_prob, adv, mean, ref_mean, std_dev_t, gate, beta, clip, adv_clip=5.0):
    """train_sd3_gardo.py's loss of one micro-batch at step j: the clamped advantages, the clipped loss weighted
    by ``std_dev_t / mean(std_dev_t)`` (1: one step), plus ``beta`` times the KL's mean over the gated samples."""
    adv = torch.clamp(adv, -adv_clip, adv_clip)
    ratio = torch.exp(log_prob - old_log_prob)
    policy = (std_dev_t / torch.mean(std_dev_t)) * torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip))
    if gate.any():
        kl = torch.mean(torch.square(mean[gate] - ref_mean[gate]) / (2 * std_dev_t[gate].view(-1, 1, 1, 1) ** 2))
        return torch.mean(policy) + beta * kl
    return torch.mean(policy)


# ----------------------------------------------------------------------------- the gate
def test_gate_by_hand():
    # Main rewards rank the samples 1..5 in order; the two aux rewards rank them in reverse, except sample 4.
    main = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    aux = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 5.0, 4.0]])
    u = uncertainty(main, aux)
    # ranks: main [1, 2, 3, 4, 5]; aux1 [5, 4, 3, 2, 1]; aux2 [5, 4, 3, 1, 2] -> u = [-4, -2, 0, 2.5, 3.5]
    torch.testing.assert_close(u, torch.tensor([-4.0, -2.0, 0.0, 2.5, 3.5]))
    # Non-negative u: [0, 2.5, 3.5]; the 90th percentile (linear) is 2.5 + 0.8 * 1 = 3.3: only sample 4.
    assert uncertainty_gate(u, 0.1).tolist() == [False, False, False, False, True]
    # The 50th is 2.5, and the gate is strict: still only sample 4; the 40th is 2.0: samples 3 and 4.
    assert uncertainty_gate(u, 0.5).tolist() == [False, False, False, False, True]
    assert uncertainty_gate(u, 0.6).tolist() == [False, False, False, True, True]


@pytest.mark.parametrize("seed", range(4))
def test_gate_is_the_codes(seed):
    g = torch.Generator().manual_seed(seed)
    main, aux1, aux2 = (torch.rand(24, generator=g, dtype=torch.float64) for _ in range(3))
    for fraction in (0.02, 0.1, 0.2):
        u_code, gate_code = code_gate(main.tolist(), aux1.tolist(), aux2.tolist(), fraction)
        u = uncertainty(main, torch.stack([aux1, aux2]))
        np.testing.assert_allclose(u.numpy(), u_code)
        assert uncertainty_gate(u, fraction).tolist() == gate_code.tolist()


def test_gate_controller_is_the_codes_risk_compensator():
    g = np.random.default_rng(0)
    code, fraction, history = CodeRiskCompensator(), 0.1, []
    for step in range(40):
        scores = g.random(10) * (1 + step % 7)  # rising and falling means
        code.update(scores)
        mean = float(np.mean(scores))
        fraction = next_gate_fraction(fraction, mean, history)
        history = (history + [mean])[-20:]
        assert fraction == pytest.approx(float(code.beta), rel=1e-12), step


# -------------------------------------------------------------------- diversity, loss
@pytest.mark.parametrize("seed", range(3))
def test_diversity_advantages_are_the_codes(seed):
    g = torch.Generator().manual_seed(seed)
    B, G, D = 3, 6, 10
    ids = torch.arange(B).repeat_interleave(G)[torch.randperm(B * G, generator=g)]
    rewards = torch.rand(B * G, generator=g, dtype=torch.float64)
    features = torch.randn(B * G, D, generator=g, dtype=torch.float64)
    means = torch.zeros(B, dtype=torch.float64).index_add(0, ids, rewards) / G
    mine = diversity_advantages(rewards - means[ids], diversity_weights(features, ids))  # grpo, adv_scale: none
    theirs = code_gardo_advantages([f"p{i}" for i in ids.tolist()], rewards.numpy()[:, None], features.numpy())
    np.testing.assert_allclose(mine.numpy(), theirs[:, 0], rtol=1e-10, atol=1e-12)


def test_diversity_weights_by_hand():
    # One group of three: e0 and e1 at 90 degrees, e2 at 45 degrees between them.
    f = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    d = 1 - math.cos(math.pi / 4)  # each one's nearest other is 45 degrees away
    torch.testing.assert_close(diversity_weights(f, torch.tensor([0, 0, 0])), torch.ones(3))
    f = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # two alike: d = [0, 0, 1], mean 1/3
    torch.testing.assert_close(diversity_weights(f, torch.tensor([0, 0, 0])), torch.tensor([0.0, 0.0, 3.0]))
    assert d > 0
    # A positive advantage takes the weight, a negative one keeps its value.
    torch.testing.assert_close(diversity_advantages(torch.tensor([0.5, -0.5, 0.2]), torch.tensor([0.0, 2.0, 3.0])),
                               torch.tensor([0.0, -0.5, 0.6]))


@pytest.mark.parametrize("seed", range(4))
def test_loss_is_the_codes(seed):
    g = torch.Generator().manual_seed(seed)
    n, shape, s, clip, beta = 8, (4, 3, 3), 0.3, 0.2, 0.04
    old_logp = torch.randn(n, generator=g)
    logp = (old_logp + 0.3 * torch.randn(n, generator=g)).requires_grad_(True)
    mean = torch.randn(n, *shape, generator=g, requires_grad=True)
    ref_mean = mean.detach() + 0.1 * torch.randn(n, *shape, generator=g)
    adv = torch.randn(n, generator=g) * 4  # some beyond the clamp
    gate = torch.rand(n, generator=g) < 0.4
    ref_kl = ((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * s ** 2)  # FlowGRPO's step KL, [n]
    forward = {"logp": logp[:, None], "ref_kl": ref_kl[:, None], "kl_gate": gate.float()[:, None],
               "diversity": torch.ones(n, 1)}
    inputs = LossInputs(forward, adv[:, None], old_logp=old_logp[:, None], denominator=n)
    mine, figures = POLICY_LOSSES.get("gardo").fn(inputs, LossSettings(clip_low=clip, clip_high=clip,
                                                                       args=GardoArgs(kl_coef=beta)))
    theirs = code_step_loss(logp, old_logp, adv, mean, ref_mean, torch.full((n,), s), gate, beta, clip)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-5)
    for x in (logp, mean):
        torch.testing.assert_close(torch.autograd.grad(mine, x, retain_graph=True)[0],
                                   torch.autograd.grad(theirs, x, retain_graph=True)[0], rtol=1e-4, atol=1e-8)
    assert figures["loss/gardo_gate_frac"].item() == pytest.approx(gate.float().mean().item())


# ------------------------------------------------------------------------ on the toy SD3
def test_config_refusals():
    from unirl.config import load_config
    from unirl.diffusion.config import DiffusionConfig

    path = REPO / "configs/diffusion/tiny_colour_gardo.yaml"
    with pytest.raises(ValueError, match="its gated KL is in its loss"):
        load_config(DiffusionConfig, path, ["algo.kl_coef=0.1"])
    with pytest.raises(ValueError, match="is not among the rewards"):
        load_config(DiffusionConfig, path, ["mode_args.aux_rewards=[aesthetic]"])


def test_reference_resets_to_the_policy(tmp_path):
    from unirl.config import load_config
    from unirl.diffusion import build_environment
    from unirl.diffusion.config import DiffusionConfig
    from unirl.trainer.loop import Trainer

    # reset_every 2: steps 0, 1, 2 keep the first reference, step 3 (3 - 0 > 2) resets it before its rollout.
    cfg = load_config(DiffusionConfig, REPO / "configs/diffusion/tiny_colour_gardo.yaml",
                      ["trainer.eval_every=0", "trainer.progress=false", f"output_dir={tmp_path}",
                       "mode_args.reset_every=2", "mode_args.reset_kl=1e9", "trainer.prompts_per_step=2",
                       "trainer.mini_batch_size=16", "trainer.micro_batch_size=16", "sampling.num_steps=4"])
    trainer = Trainer.from_config(build_environment(cfg), cfg)
    trainer.setup()
    mode = trainer.env.mode
    policy = mode.reference.params

    def same() -> bool:
        return all(torch.equal(s, p.detach().float()) for s, p in zip(mode.reference.shadow, policy))

    first = [s.clone() for s in mode.reference.shadow]
    assert same()  # the code's "old" adapter starts as a copy of the policy
    resets = []
    for step in range(4):
        metrics = trainer.train_step()
        resets.append(metrics["rollout/gardo_reset"])
        assert not same()  # the update moved the policy after the rollout's reset (if any)
        if step == 2:
            assert all(torch.equal(a, b) for a, b in zip(first, mode.reference.shadow))  # before: not reset
            before_reset = [p.detach().float().clone() for p in policy]
    assert resets == [0.0, 0.0, 0.0, 1.0]
    # The step-3 reset copied the policy as it stood after step 2's update: the reference is those weights.
    assert all(torch.equal(s, b) for s, b in zip(mode.reference.shadow, before_reset))
    # The KL trigger: an optimizer step whose gated KL mean exceeds reset_kl asks for a reset at the next step.
    mode.kl_pieces = [torch.tensor(2e9)]
    mode.after_optimizer_step(99)
    assert mode.needs_reset and mode.maybe_reset(4) and same() and not mode.needs_reset
    trainer.env.close()


def test_tiny_colour_gardo_raises_the_reward(tmp_path):
    """The shipped config for 30 steps (about 15 s): the held-out reward rises. GARDO trains FlowGRPO's steps, and
    FlowGRPO is slow on the toy (docs/diffusion.md: 0.13 after 25 steps, 0.45 after 100), so the bar is lower than
    the forward-process methods' (tests/test_flow_methods.py): the two colours' mean up by 0.01, "red" by 0.02
    (measured: 0.111 -> 0.130, red 0.155 -> 0.193)."""
    from unirl.config import load_config
    from unirl.diffusion import build_environment
    from unirl.diffusion.config import DiffusionConfig
    from unirl.trainer.loop import Trainer

    sys.path.insert(0, str(REPO / "benchmarks"))
    from time_to_reward import per_colour

    cfg = load_config(DiffusionConfig, REPO / "configs/diffusion/tiny_colour_gardo.yaml",
                      ["trainer.eval_every=0", "trainer.progress=false", f"output_dir={tmp_path}"])
    trainer = Trainer.from_config(build_environment(cfg), cfg)
    trainer.setup()
    before = per_colour(trainer.env)
    gated = []
    for _ in range(30):
        gated.append(trainer.train_step()["loss/gardo_gate_frac"])
    after = per_colour(trainer.env)
    trainer.env.close()
    assert 0 < np.mean(gated) < 0.25  # about the gate's fraction of the batch (0.02 to 0.2 of the u >= 0)
    assert np.mean(list(after.values())) > np.mean(list(before.values())) + 0.01, (before, after)
    assert after["red"] > before["red"] + 0.02, (before, after)
