"""The guard losses for FlowGRPO (``algo.policy_loss: grpo_guard | flow_dppo``, ``unirl/core/flow_guards.py``):
each against its reference re-typed here on the same tensors (loss and gradient), RatioNorm's zero-mean
log-ratio by hand, the DPPO mask by hand, and on the toy SD3: the sampler's step means are kept only for
these losses, the first update starts at ratio 1 and KL 0, and the weights move."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.flow_guards import FlowDppoArgs, GrpoGuardArgs, flow_dppo_per_step, guard_log_ratio, step_mean_kl
from unirl.core.policy_losses import POLICY_LOSSES, LossInputs, LossSettings


@pytest.fixture(autouse=True)
def one_thread():
    """The toy steps run on one thread, as tests/test_flow_methods.py's: small batches run fastest there, and
    with torch's default threads a busy 2-core machine made them several times slower (the grpo_guard step:
    2.7 s on one thread, 7.7 s on two beside another job)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def step_tensors(seed: int, n: int = 6, shape=(4, 3, 3), sigma=0.7, sigma_next=0.55, noise_level=0.7, gap=0.05):
    """One FlowGRPO step shared by n samples: the flow SDE's std_dev_t and sqrt(-dt) (FlowGRPO's
    ``sde_step_with_logprob``), old and current means, the sampled next latent and both log-probs (the
    per-element Gaussian log-density, mean over the latent, as FlowGRPO's)."""
    g = torch.Generator().manual_seed(seed)
    std_dev_t = math.sqrt(sigma / (1 - sigma)) * noise_level
    sqrt_dt = math.sqrt(sigma - sigma_next)
    s = std_dev_t * sqrt_dt
    old_mean = torch.randn(n, *shape, generator=g)
    mean = (old_mean + gap * torch.randn(n, *shape, generator=g)).requires_grad_(True)
    x_next = old_mean + s * torch.randn(n, *shape, generator=g)

    def logp(m):
        return (-(x_next - m) ** 2 / (2 * s ** 2) - math.log(s) - math.log(math.sqrt(2 * math.pi))).flatten(1).mean(1)

    adv = torch.randn(n, generator=g) * 2
    return dict(mean=mean, old_mean=old_mean, x_next=x_next, logp_fn=logp, old_logp=logp(old_mean), adv=adv,
                std_dev_t=std_dev_t, sqrt_dt=sqrt_dt, s=s, sigma=sigma, sigma_next=sigma_next)


def unirl_loss(name: str, t: dict, args, clip=1e-4):
    """The registered loss on one column piece [n, 1] of the step, token-mean over the n samples."""
    n = t["mean"].shape[0]
    logp = t["logp_fn"](t["mean"])
    forward = {"logp": logp.unsqueeze(1), "mean": t["mean"].unsqueeze(1), "old_mean": t["old_mean"].unsqueeze(1),
               "std": torch.full((n, 1), t["s"]), "sigma": torch.full((n, 1), t["sigma"]),
               "sigma_next": torch.full((n, 1), t["sigma_next"])}
    inputs = LossInputs(forward, t["adv"].unsqueeze(1), old_logp=t["old_logp"].unsqueeze(1), denominator=n)
    loss, figures = POLICY_LOSSES.get(name).fn(inputs, LossSettings(clip_low=clip, clip_high=clip, args=args))
    return loss, figures


# ------------------------------------------------------------------------------------- GRPO-Guard
def verl_omni_grpo_guard(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                         sqrt_dt, clip_ratio, adv_clip_max=5.0):
    """verl-omni ``GRPOGuardLoss.compute_loss`` (verl_omni/trainer/diffusion/diffusion_algos.py, commit
    a1139ba), re-typed: one std_dev_t and sqrt_dt per step (their batch means), the ratio-mean bias added
    to the log-ratio, scaled by sqrt_dt * std_dev_t, PPO clip, mean over the batch divided by sqrt_dt^2."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    sigma_t = std_dev_t.mean()
    sqrt_dt_mean = sqrt_dt.mean()
    scale = sqrt_dt_mean * sigma_t
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    mean_diff_sq = mean_diff_sq.mean(dim=tuple(range(1, mean_diff_sq.ndim)))
    ratio_mean_bias = mean_diff_sq / (2 * scale ** 2)
    ratio = torch.exp((log_prob - old_log_prob + ratio_mean_bias) * scale)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    return torch.mean(torch.maximum(unclipped, clipped)) / (sqrt_dt_mean ** 2)


def flow_factory_grpo_guard(log_prob, old_log_prob, next_latents_mean, old_next_latents_mean, std_dev_t, dt, adv,
                            clip_range):
    """Flow-Factory ``GRPOGuardTrainer.optimize`` (src/flow_factory/trainers/grpo.py, commit a0b2bc5), re-typed:
    ``ratio = exp((log_prob - old) * scale + mse / (2 scale))``, ``scale = sqrt(-dt) std_dev_t``; no 1/dt."""
    scale_factor = torch.sqrt(-dt) * std_dev_t
    mse = (next_latents_mean - old_next_latents_mean).flatten(1).pow(2).mean(dim=1)
    ratio = torch.exp((log_prob - old_log_prob) * scale_factor + mse / (2 * scale_factor))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 + clip_range[0], 1.0 + clip_range[1])
    return torch.mean(torch.maximum(unclipped, clipped))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", [1e-4, 0.5])  # most ratios clipped / none
def test_grpo_guard_is_verl_omnis_loss_and_gradient(seed, clip):
    t = step_tensors(seed)
    n = t["mean"].shape[0]
    mine, figures = unirl_loss("grpo_guard", t, GrpoGuardArgs(), clip=clip)
    (g_mine,) = torch.autograd.grad(mine, t["mean"])
    theirs = verl_omni_grpo_guard(t["old_logp"], t["logp_fn"](t["mean"]), t["adv"], t["old_mean"], t["mean"],
                                  torch.full((n, 1, 1, 1), t["std_dev_t"]), torch.full((n,), t["sqrt_dt"]), clip)
    (g_theirs,) = torch.autograd.grad(theirs, t["mean"])
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-9)
    torch.testing.assert_close(g_mine, g_theirs, rtol=1e-4, atol=1e-9)
    assert g_theirs.abs().sum() > 0 if clip == 0.5 else True
    assert 0 <= figures["loss/guard_clip_frac"] <= 1


@pytest.mark.parametrize("seed", range(3))
def test_grpo_guard_without_dt_reweight_is_flow_factorys(seed):
    t = step_tensors(seed)
    n = t["mean"].shape[0]
    mine, _ = unirl_loss("grpo_guard", t, GrpoGuardArgs(dt_reweight=False), clip=0.5)
    theirs = flow_factory_grpo_guard(t["logp_fn"](t["mean"]), t["old_logp"], t["mean"], t["old_mean"],
                                     torch.full((n,), t["std_dev_t"]), torch.full((n,), t["sigma_next"] - t["sigma"]),
                                     t["adv"], (-0.5, 0.5))
    g_mine, g_theirs = (torch.autograd.grad(x, t["mean"])[0] for x in (mine, theirs))
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-5)
    torch.testing.assert_close(g_mine, g_theirs, rtol=1e-4, atol=1e-9)


def test_ratio_norm_removes_the_log_ratios_bias_by_hand():
    """With x' = mu_old + s eps and mu = mu_old + delta, FlowGRPO's per-element log-ratio is
    -mean(delta^2) / (2 s^2) + mean(eps delta) / s (expand (s eps - delta)^2); RatioNorm's is
    mean(eps delta): zero mean over the noise, where the plain one is biased below 0."""
    g = torch.Generator().manual_seed(0)
    s, shape, draws = 0.05, (8, 8), 4000
    old_mean = torch.randn(1, *shape, generator=g).expand(draws, *shape)
    delta = 0.02 * torch.randn(1, *shape, generator=g).expand(draws, *shape)
    eps = torch.randn(draws, *shape, generator=g)
    x_next = old_mean + s * eps
    mean = old_mean + delta

    def logp(m):
        return (-(x_next - m) ** 2 / (2 * s ** 2)).flatten(1).mean(1)  # the constants cancel in the ratio

    plain = logp(mean) - logp(old_mean)  # [draws]
    by_hand = -(delta ** 2).flatten(1).mean(1) / (2 * s ** 2) + (eps * delta).flatten(1).mean(1) / s
    torch.testing.assert_close(plain, by_hand, rtol=1e-4, atol=1e-5)
    std = torch.full((draws, 1), s)
    normed = guard_log_ratio(logp(mean)[:, None], logp(old_mean)[:, None], mean[:, None], old_mean[:, None], std)
    torch.testing.assert_close(normed[:, 0], (eps * delta).flatten(1).mean(1), rtol=1e-3, atol=1e-6)
    bias = (delta[0] ** 2).mean() / (2 * s ** 2)  # 0.08: the plain log-ratio's mean is -bias
    assert plain.mean().item() == pytest.approx(-bias.item(), abs=0.01)
    assert abs(normed.mean().item()) < 2e-4  # RatioNorm's: ~0 (its std is ~ |delta| / 8 = 2.5e-3 / sqrt(draws))


# -------------------------------------------------------------------------------------- Flow-DPPO
def tencent_flowdppo(new_logp, old_logp, new_means, old_means, advantages, sigma_t, kl_mask_threshold):
    """Tencent UniRL ``_flowdppo_kl_adv_loss`` (unirl/algorithms/flowdppo.py, commit 1a7b501) re-typed:
    per-element loss [B, S'], the caller takes the mean."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages.detach()
    unclipped = -adv * ratio
    kl_per_elem = (new_means - old_means) ** 2 / (2 * sigma_t ** 2)
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(2, kl_per_elem.ndim)))
    kl_mask = kl_per_sample < kl_mask_threshold
    pos_rm = (~kl_mask) & (ratio > 1.0) & (adv > 0)
    neg_rm = (~kl_mask) & (ratio < 1.0) & (adv < 0)
    keep = (~(pos_rm | neg_rm)).detach()
    return torch.where(keep, unclipped, torch.zeros(())).mean(), (pos_rm | neg_rm).float().mean()


def verl_omni_flow_dppo(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                        sqrt_dt, kl_mask_threshold):
    """verl-omni ``FlowDPPOLoss.compute_loss`` (diffusion_algos.py, commit a1139ba), re-typed
    (``add_kl_coefficient=True``, no rollout-correction weights)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages.detach() * ratio
    sigma_t = std_dev_t * sqrt_dt.reshape(sqrt_dt.shape[0], *([1] * (std_dev_t.ndim - 1)))
    kl = ((prev_sample_mean - old_prev_sample_mean).pow(2) / (2 * sigma_t.pow(2))).mean(dim=(1, 2, 3))
    high = kl >= kl_mask_threshold
    rm = (high & (ratio > 1.0) & (advantages > 0)) | (high & (ratio < 1.0) & (advantages < 0))
    return torch.where(~rm, unclipped, torch.zeros(())).mean()


@pytest.mark.parametrize("seed", range(4))
def test_flow_dppo_is_tencent_unirls_and_verl_omnis_loss_and_gradient(seed):
    # Gaps of 0.001 to 0.1 against s ~ 0.2: KLs from ~1e-5 to ~0.1 straddle a threshold of 1e-3.
    t = step_tensors(seed, n=16, gap=0.0)
    g = torch.Generator().manual_seed(100 + seed)
    gaps = torch.logspace(-3, -1, 16)[torch.randperm(16, generator=g)].view(-1, 1, 1, 1)
    mean = (t["old_mean"] + gaps * torch.randn(t["old_mean"].shape, generator=g)).requires_grad_(True)
    t["mean"] = mean
    args = FlowDppoArgs(kl_threshold=1e-3)
    mine, figures = unirl_loss("flow_dppo", t, args)
    logp = t["logp_fn"](mean)
    tencent, masked = tencent_flowdppo(logp[:, None], t["old_logp"][:, None], mean[:, None], t["old_mean"][:, None],
                                       t["adv"][:, None], torch.tensor(t["s"]).view(1, 1, 1, 1, 1), 1e-3)
    verl = verl_omni_flow_dppo(t["old_logp"], logp, t["adv"], t["old_mean"], mean,
                               torch.full((16, 1, 1, 1), t["std_dev_t"]), torch.full((16,), t["sqrt_dt"]), 1e-3)
    for theirs in (tencent, verl):
        assert mine.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-9)
        torch.testing.assert_close(torch.autograd.grad(mine, mean, retain_graph=True)[0],
                                   torch.autograd.grad(theirs, mean, retain_graph=True)[0], rtol=1e-4, atol=1e-9)
    assert figures["loss/dppo_masked_frac"].item() == pytest.approx(masked.item())


def test_flow_dppo_mask_by_hand():
    # KL high for the first four: drop where the ratio moves with the advantage (r > 1, A > 0; r < 1, A < 0).
    kl = torch.tensor([[2e-5], [2e-5], [2e-5], [2e-5], [0.0]])
    logp = torch.tensor([[0.1], [-0.1], [0.1], [-0.1], [0.1]])
    adv = torch.tensor([[1.0], [1.0], [-1.0], [-1.0], [1.0]])
    loss, keep = flow_dppo_per_step(logp, torch.zeros(5, 1), kl, adv, 1e-5)
    assert keep[:, 0].tolist() == [False, True, True, False, True]
    r = math.exp(0.1)
    torch.testing.assert_close(loss[:, 0], torch.tensor([0.0, -1 / r, r, 0.0, -r]))
    # The exact KL by hand: gap 0.1 everywhere, s = 0.5 -> 0.01 / (2 * 0.25) = 0.02.
    assert step_mean_kl(torch.full((1, 1, 2, 2), 0.1), torch.zeros(1, 1, 2, 2), torch.tensor([[0.5]])).item() == \
        pytest.approx(0.02)


def test_guard_settings_are_checked_where_the_config_loads():
    from unirl.config import load_config
    from unirl.diffusion.config import DiffusionConfig

    with pytest.raises(ValueError, match="kl_threshold must be > 0"):
        load_config(DiffusionConfig, None, ["algo.policy_loss=flow_dppo", "algo.loss_args.kl_threshold=0"])
    with pytest.raises(ValueError, match="algo.policy_loss=grpo_guard with algorithm=nft"):
        load_config(DiffusionConfig, None, ["algorithm=nft", "sampling.train_cfg=false", "algo.policy_loss=grpo_guard"])


# ----------------------------------------------------------------------------- on the toy SD3
TINY = ["model.name_or_path=tiny", "sampling.resolution=32", "sampling.max_sequence_length=16",
        "sampling.guidance_scale=1.0", "sampling.train_cfg=false", "trainer.prompts_per_step=2",
        "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "sampling.chunk_size=8",
        "sampling.num_steps=4", "sampling.eval_num_steps=4", "ema.enabled=false", "trainer.eval_every=0",
        "trainer.progress=false", "trainer.reward_workers=0", "algo.clip_low=0.2", "algo.clip_high=0.2"]


def make_trainer(tmp_path, *overrides: str):
    from unirl.config import load_config
    from unirl.diffusion import build_environment
    from unirl.diffusion.config import DiffusionConfig
    from unirl.trainer.loop import Trainer

    cfg = load_config(DiffusionConfig, None, [*TINY, f"output_dir={tmp_path}", *overrides])
    trainer = Trainer.from_config(build_environment(cfg), cfg)
    trainer.setup()
    return trainer


@pytest.mark.parametrize("loss", ["grpo_guard", "flow_dppo"])
def test_guards_on_the_toy_start_at_ratio_one_and_train(tmp_path, loss):
    trainer = make_trainer(tmp_path, f"algo.policy_loss={loss}")
    env = trainer.env
    rollout = env.sampler.rollout(env.prompts.next(0), 4)
    assert rollout.tensors["old_mean"].shape == rollout.tensors["latents"].shape  # [N, T, *latent]: kept for the loss
    before = [p.detach().clone() for p in env.model.parameters() if p.requires_grad]
    metrics = trainer.learn(rollout, env.scorer.score(rollout)[0])[1]
    # The first update re-scores the stored steps with the sampling weights: the same means, bit for bit.
    if loss == "grpo_guard":
        assert metrics["loss/guard_ratio"] == 1.0 and metrics["loss/guard_clip_frac"] == 0.0
    else:
        assert metrics["loss/dppo_kl"] == 0.0 and metrics["loss/dppo_masked_frac"] == 0.0
    after = [p.detach() for p in env.model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    env.close()


def test_the_clipped_loss_keeps_no_step_means(tmp_path):
    trainer = make_trainer(tmp_path)
    rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), 4)
    assert "old_mean" not in rollout.tensors  # no latent-sized copy where nothing reads it
    trainer.env.close()
