"""Where unirl says it follows verl, FlowGRPO or TRL, the reference's formula computed here, independently.

Each test writes the reference's documented formula from scratch (never importing the project's
function for the expected value) and compares on random tensors over several seeds, on a case list,
or through the real loop on the tiny text model. The references:

* FlowGRPO ``scripts/train_sd3.py`` and ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``: the KL
  ``((mean - ref_mean)**2).mean(dims) / (2 * std_dev_t**2)``, the first ``int(K * fraction)`` steps
  trained, samples with zero advantage dropped, the EMA stepped per optimizer step;
  ``flow_grpo/stat_tracking.py``: ``(r - mean_prompt) / (np.std(all rewards) + 1e-4)``.
* verl ``core_algos.py``: REINFORCE++-baseline whitened over tokens, ``low_var_kl`` clamped to
  [-10, 10], GSPO aggregated with ``seq-mean-token-mean``.
* TRL ``dr_grpo``: token sums / (number of sequences x ``max_completion_length``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unirl.cli import load_run_config
from unirl.config import ConfigError, load_config
from unirl.core import aggregate, clipped_policy_loss, compute_advantages, group_advantages
from unirl.trainer.update import mini_denominator
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.ema import ParamEMA
from unirl.diffusion.sampling import trained_steps
from unirl.diffusion.sde import sde_step_with_logprob, step_kl
from unirl.trainer.loop import Trainer
from unirl.trainer.context import RunState
from unirl.trainer.zero_advantage import drop_zero_advantage
from unirl.config.schema import AlgoConfig, TrainerConfig
from unirl.text.config import TextConfig
from stage_helpers import stage_context  # tests/stage_helpers.py
from unirl.text.env import TextEnvironment

SEEDS = [0, 1, 2, 3, 4]


def _sd3_sigmas(num_steps: int = 10) -> list[float]:
    """SD3's schedule: FlowMatchEulerDiscreteScheduler with shift 3, as the SD3.5 checkpoints set it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.double().tolist()


# ------------------------------------------------------------------------------ 1. diffusion KL
def _flowgrpo_kl(mean, ref_mean, sigmas, i, noise_level):
    """train_sd3.py's kl_loss for step i, with sd3_sde_with_logprob's std_dev_t (sigma_max = sigmas[1])."""
    sigma, sigma_max = sigmas[i], sigmas[1]
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
    return ((mean.double() - ref_mean.double()) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)


@pytest.mark.parametrize("seed", SEEDS)
def test_step_kl_is_flowgrpos_at_every_step_of_the_sd3_schedule(seed):
    sigmas = _sd3_sigmas(10)
    g = torch.Generator().manual_seed(seed)
    ratios = []
    for i in range(10):
        mean = torch.randn(3, 16, 8, 8, generator=g)
        ref_mean = mean + 0.05 * torch.randn(3, 16, 8, 8, generator=g)
        sigma, sigma_next = torch.full((3,), sigmas[i]), torch.full((3,), sigmas[i + 1])
        got = step_kl(mean, ref_mean, sigma, sigma_next, noise_level=0.7)  # form="flowgrpo" by default
        torch.testing.assert_close(got.double(), _flowgrpo_kl(mean, ref_mean, sigmas, i, 0.7), rtol=1e-5, atol=0)
        # The exact Gaussian KL of the step divides by the step variance std_dev_t^2 |dt| instead.
        exact = step_kl(mean, ref_mean, sigma, sigma_next, noise_level=0.7, form="exact")
        _, _, _, step_std = sde_step_with_logprob(mean, mean, sigma, sigma_next, noise_level=0.7)
        expected_exact = ((mean.double() - ref_mean.double()) ** 2).mean(dim=(1, 2, 3)) / (2 * step_std.flatten().double() ** 2)
        torch.testing.assert_close(exact.double(), expected_exact, rtol=1e-5, atol=0)
        ratios.append(float(exact[0] / got[0]))
    # The exact form is 1/|dt| times FlowGRPO's: 3.7x at the first step, 112x at the last (issue 8).
    assert ratios == pytest.approx([1 / (sigmas[i] - sigmas[i + 1]) for i in range(10)], rel=1e-5)
    assert 3.6 < min(ratios) < 3.8 and 100 < max(ratios) < 120


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_step_kl_cps_uses_the_step_std_so_both_forms_agree(seed):
    sigmas = _sd3_sigmas(10)
    g = torch.Generator().manual_seed(seed)
    for i in range(10):
        mean = torch.randn(2, 4, 8, 8, generator=g)
        ref_mean = mean + 0.1 * torch.randn(2, 4, 8, 8, generator=g)
        std = sigmas[i + 1] * math.sin(0.5 * math.pi / 2)  # FlowGRPO's CPS std_dev_t
        if std == 0:
            continue  # the last step (sigma_next 0) has no noise: nothing to compare
        expected = ((mean.double() - ref_mean.double()) ** 2).mean(dim=(1, 2, 3)) / (2 * std**2)
        for form in ("flowgrpo", "exact"):
            got = step_kl(mean, ref_mean, sigmas[i], sigmas[i + 1], noise_level=0.5, sde_type="cps", form=form)
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)


def test_shipped_flowgrpo_configs_use_flowgrpos_choices():
    default = DiffusionConfig()
    assert default.kl_form == "flowgrpo" and default.sampling.timestep_selection == "first"
    from unirl.config import resolve_config_path

    cfg = load_config(DiffusionConfig, resolve_config_path("diffusion", "sd3_ocr"))
    assert cfg.kl_form == "flowgrpo"
    assert cfg.sampling.timestep_selection == "first" and cfg.sampling.timestep_fraction == 0.99
    assert cfg.algo.drop_zero_adv and cfg.algo.adv_scale == "batch"
    assert (cfg.algo.adv_std, cfg.algo.adv_eps, cfg.algo.adv_clip) == ("biased", 1e-4, 5.0)
    assert (cfg.ema.decay, cfg.ema.update_every) == (0.9, 8)


# ---------------------------------------------------------------------- 2. timestep_fraction
@pytest.mark.parametrize("num_steps,fraction", [(10, 0.99), (10, 0.5), (8, 0.7), (40, 0.6), (6, 1.0)])
def test_timestep_fraction_trains_flowgrpos_first_steps(num_steps, fraction):
    # train_sd3.py: for j in range(int(num_steps * timestep_fraction)) over the stored steps, in order.
    expected = list(range(int(num_steps * fraction)))
    got = trained_steps(12, torch.ones(num_steps, dtype=torch.bool), fraction, torch.Generator().manual_seed(0))
    assert got.tolist() == [expected] * 12
    if fraction == 0.99:
        assert num_steps - 1 not in got  # the last, sharpest step is never trained


# ------------------------------------------------------------- 3, 4, 8. through the real loop
@pytest.fixture(scope="module")
def text_trainer(tmp_path_factory, tiny_lm_dir):
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "rollout.max_new_tokens=24", "trainer.prompts_per_step=4", "trainer.group_size=4",
        "trainer.mini_batch_size=4", "trainer.micro_batch_size=2", "trainer.eval_every=0", "trainer.progress=false",
        "optim.lr=1e-4",
    ], output_dir=str(tmp_path_factory.mktemp("parity") / "run"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), 4)
    rewards, _ = trainer.env.scorer.score(rollout)
    yield trainer, rollout, rewards
    trainer.env.close()


def test_dr_grpo_normaliser_is_sequences_times_max_new_tokens(text_trainer):
    # TRL dr_grpo: (per_token_loss * mask).sum() / (batch size * max_completion_length).
    trainer, rollout, _ = text_trainer
    mask = rollout.tensors["response_mask"]
    assert mask.sum(-1).max() < 24 or mask.shape[1] <= 24
    trainer.algo.loss_agg = "seq-mean-token-sum-norm"
    try:
        denominator = mini_denominator(trainer.ctx, rollout)
    finally:
        trainer.algo.loss_agg = "token-mean"
    assert int(denominator) == len(rollout) * 24
    g = torch.Generator().manual_seed(0)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    trl = (values * mask).sum() / (mask.shape[0] * 24)
    # The denominator lives on the trainer's device (a GPU's on CUDA); the comparison is on the CPU.
    torch.testing.assert_close(aggregate(values, mask, "seq-mean-token-sum-norm", denominator=denominator.cpu()), trl)
    torch.testing.assert_close(aggregate(values, mask, "seq-mean-token-sum-norm", norm_length=24), trl)


def _verl_rf_pp_baseline(rewards: np.ndarray, index: list, mask: np.ndarray) -> np.ndarray:
    """verl: scores - group mean (0 for a lone sample), tiled over tokens, masked_whiten * mask."""
    scores = rewards.astype(np.float64).copy()
    groups: dict = {}
    for i, k in enumerate(index):
        groups.setdefault(k, []).append(rewards[i])
    for i, k in enumerate(index):
        scores[i] -= np.mean(groups[k]) if len(groups[k]) > 1 else 0.0
    values = np.tile(scores[:, None], (1, mask.shape[1]))
    m = mask.astype(bool)
    mean = values[m].mean()
    var = ((values[m] - mean) ** 2).mean() * m.sum() / (m.sum() - 1)  # masked_var(unbiased=True)
    return np.where(m, (values - mean) / np.sqrt(var + 1e-8), 0.0)


def test_reinforce_pp_baseline_is_verls_on_the_issue_case():
    mask = torch.zeros(4, 10, dtype=torch.bool)
    for i, length in enumerate([1, 10, 1, 10]):
        mask[i, :length] = True
    adv = compute_advantages("reinforce++-baseline", torch.tensor([1.0, 0, 1, 0]), torch.zeros(4, dtype=torch.long), mask=mask)
    assert adv[0, 0].item() == pytest.approx(3.0896, abs=1e-4) and adv[1, 0].item() == pytest.approx(-0.3090, abs=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_matches_verl_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    n, t = 12, 9
    rewards = rng.normal(size=n)
    index = list(rng.integers(0, 4, size=n))
    mask = np.zeros((n, t), dtype=bool)
    for i in range(n):
        mask[i, : rng.integers(1, t + 1)] = True
    got = compute_advantages("reinforce++-baseline", torch.tensor(rewards), torch.tensor(index), mask=torch.tensor(mask))
    np.testing.assert_allclose(got.numpy(), _verl_rf_pp_baseline(rewards, index, mask), rtol=0, atol=1e-9)


def test_loop_gives_reinforce_pp_baseline_the_response_mask(text_trainer):
    trainer, rollout, rewards = text_trainer
    trainer.algo.adv_estimator = "reinforce++-baseline"
    try:
        trainer.advantages(rollout, rewards)
    finally:
        trainer.algo.adv_estimator = "grpo"
    mask = rollout.tensors["response_mask"].numpy()
    expected = _verl_rf_pp_baseline(rewards.double().numpy(), rollout.group_ids.tolist(), mask)
    np.testing.assert_allclose(rollout.advantages.double().numpy(), expected, rtol=0, atol=1e-5)


def _flowgrpo_ema(params_per_step: list[float], decay: float, interval: int) -> float:
    """EMAModuleWrapper.step(parameters, global_step) after each optimizer step (global_step = 1, 2, ...)."""
    ema = 0.0
    for k, p in enumerate(params_per_step, start=1):
        if (k + 1) % interval == 0:
            ema += (1 - min((1 + k) / (10 + k), decay)) * (p - ema)
    return ema


@pytest.mark.parametrize("interval", [1, 3, 8])
def test_ema_follows_flowgrpos_optimizer_step_schedule(interval):
    values = [float(v) for v in torch.randn(40, generator=torch.Generator().manual_seed(interval)).tolist()]
    p = torch.nn.Parameter(torch.zeros(1))
    ema = ParamEMA([p], decay=0.9, update_every=interval)
    for k, v in enumerate(values, start=1):
        with torch.no_grad():
            p.fill_(v)
        ema.step(k)
    assert float(ema.shadow[0]) == pytest.approx(_flowgrpo_ema(values, 0.9, interval), rel=1e-6, abs=1e-7)
    # With interval 8 the decay reaches 0.9 at k = 81, FlowGRPO's tenth update (not the 80th).
    assert ParamEMA([p], 0.9, 8).decay_at(7) == pytest.approx(8 / 17)


def test_loop_calls_the_optimizer_step_hook_after_every_optimizer_step(text_trainer):
    trainer, rollout, rewards = text_trainer
    seen = []
    trainer.env.after_optimizer_step = seen.append
    try:
        start = trainer.optimizer_steps
        trainer.advantages(rollout, rewards)
        trainer.old_and_reference(rollout)
        trainer.update(rollout)  # 16 samples, mini-batches of 4: four optimizer steps
    finally:
        del trainer.env.after_optimizer_step
    assert seen == [start + 1, start + 2, start + 3, start + 4]


# ----------------------------------------------------------------------------------- 5. GSPO
def test_gspo_refuses_another_aggregation_with_the_key_named():
    with pytest.raises(ConfigError, match="algo.*loss_agg=seq-mean-token-mean"):
        load_config(TextConfig, {"algo": {"level": "sequence"}})
    cfg = load_config(TextConfig, {"algo": {"level": "sequence", "loss_agg": "seq-mean-token-mean"}})
    assert cfg.algo.level == "sequence"


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_gspo_loss_is_verls_seq_mean_token_mean(seed):
    # verl GSPO: s_i = exp(mean_t log r_it); per token max(-A s_i, -A clip(s_i)); agg seq-mean-token-mean.
    g = torch.Generator().manual_seed(seed)
    n, t = 6, 7
    mask = torch.rand(n, t, generator=g) < 0.7
    mask[:, 0] = True
    old = torch.randn(n, t, generator=g, dtype=torch.float64)
    logp = old + 0.05 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / lengths)
    per_seq = torch.maximum(-adv * s, -adv * s.clamp(1 - 3e-2, 1 + 4e-2))
    expected = per_seq.mean()  # every token of a sequence carries the same value: its token mean
    loss, _ = clipped_policy_loss(logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean",
                                  clip_low=3e-2, clip_high=4e-2)
    torch.testing.assert_close(loss, expected)


# ------------------------------------------------------------------------- 6. zero advantages
@pytest.mark.parametrize("seed", SEEDS)
def test_drop_zero_adv_keeps_what_flowgrpo_keeps(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    n, num_batches = 32, 4
    adv = torch.randn(n, 5, generator=g, dtype=torch.float64)
    adv[torch.rand(n, generator=g) < 0.4] = 0.0
    # FlowGRPO: mask = adv.abs().sum(1) != 0, topped up with random zero rows to a multiple of num_batches.
    flow_mask = adv.abs().sum(dim=1) != 0
    flow_count = int(flow_mask.sum()) + (-int(flow_mask.sum())) % num_batches
    ctx = stage_context(AlgoConfig(drop_zero_adv=True),
                        TrainerConfig(prompts_per_step=8, group_size=4, mini_batch_size=8, micro_batch_size=8))
    from unirl.env import Rollout

    rollout = Rollout(tensors={"row": torch.arange(n)}, advantages=adv, group_ids=torch.arange(n) // 4,
                      prompts=[str(i) for i in range(n)], samples=list(range(n)))
    kept, metrics = drop_zero_advantage(ctx, RunState(), rollout)
    assert len(kept) == flow_count and len(kept) % num_batches == 0
    assert set(torch.nonzero(flow_mask).flatten().tolist()) <= set(kept.tensors["row"].tolist())
    assert metrics["adv/dropped_frac"] == pytest.approx(1 - flow_count / n)
    # Under token-mean the policy term is then the mean over the kept samples only, as FlowGRPO's.
    logp = torch.zeros(len(kept), 5, dtype=torch.float64)
    loss, _ = clipped_policy_loss(logp, logp, kept.advantages, torch.ones(len(kept), 5, dtype=torch.bool))
    torch.testing.assert_close(loss, -adv[kept.tensors["row"]].mean())


# ----------------------------------------------------------------------------------- 9. k3 clamp
@pytest.mark.parametrize("seed", SEEDS[:3])
def test_text_kl_clamps_k3_like_verls_low_var_kl_by_default(seed):
    assert AlgoConfig().kl_clamp == 10.0
    g = torch.Generator().manual_seed(seed)
    logp = -5 * torch.rand(64, generator=g, dtype=torch.float64)
    ref_logp = logp + 12 * torch.randn(64, generator=g, dtype=torch.float64)  # log-ratios up to ~+-30
    # verl low_var_kl: kl = ref - logp, clamped to [-20, 20]; exp(kl) - kl - 1, clamped to [-10, 10].
    d = (ref_logp - logp).clamp(-20, 20)
    expected = (torch.exp(d) - d - 1).clamp(-10, 10)
    env = TextEnvironment(load_config(TextConfig, {"algo": {"kl_estimator": "k3"}}))
    torch.testing.assert_close(env.actions.kl({"logp": logp}, {"logp": ref_logp}), expected)
    unclamped = TextEnvironment(load_config(TextConfig, {"algo": {"kl_clamp": None}})).actions.kl({"logp": logp}, {"logp": ref_logp})
    assert unclamped.max() > 1e3  # the exact value (3.3e6 at a log-ratio of -15) stays an option


# ------------------------------------------------------------------------ FlowGRPO's advantages
@pytest.mark.parametrize("seed", SEEDS)
def test_biased_batch_std_is_flowgrpos_global_std(seed):
    rng = np.random.default_rng(seed)
    rewards = rng.random(24)
    prompts = np.repeat(np.arange(6), 4)
    # PerPromptStatTracker(global_std=True): (r - mean of its prompt) / (np.std(all rewards) + 1e-4).
    expected = np.array([(r - rewards[prompts == p].mean()) / (np.std(rewards) + 1e-4) for r, p in zip(rewards, prompts)])
    got = group_advantages(torch.tensor(rewards), torch.tensor(prompts), scale="batch", eps=1e-4, unbiased=False)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
