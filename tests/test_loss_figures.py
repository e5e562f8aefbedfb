"""Each registered policy loss's own figures (``PolicyLoss.figures``, logged ``actor/<name>``): PPO's clip
figures at ``algo.clip_low/high`` say nothing true of CISPO (which bounds an IS weight at its own
bounds), DPPO (a divergence mask), GMPO (a clip of the log-ratio), SAPO (no clip) or KL-Cov (no clip),
so each of those reports what it does. Values derived by hand on one sequence; the clipped loss's
figures stay ``policy_loss_metrics``'s (pinned); the update logs the configured loss's figures.
"""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core import POLICY_LOSSES, LossInputs, LossSettings, policy_loss_metrics
from unirl.core.covariance_losses import KlCovArgs
from unirl.core.is_weighted_losses import CispoArgs, DppoKlArgs, DppoTvArgs
from unirl.core.smooth_ratio_losses import GeoMeanArgs, SapoArgs

F64 = torch.float64
RATIO_FIGURES = {"approx_kl", "ratio_mean", "ratio_max", "ratio_min"}


def _figures(name: str, logp: list[float], old: list[float], adv: list[float], args, mask: list[bool] | None = None,
             **settings):
    inputs = LossInputs({"logp": torch.tensor([logp], dtype=F64),
                         "mask": None if mask is None else torch.tensor([mask])},
                        torch.tensor([adv], dtype=F64), old_logp=torch.tensor([old], dtype=F64))
    figures = POLICY_LOSSES.get(name).ratio_figures(inputs, LossSettings(args=args, **settings))
    return {k: float(v) for k, v in figures.items()}


def _log(ratios: list[float]) -> list[float]:
    return [math.log(r) for r in ratios]


def test_cispo_counts_the_weights_at_its_own_bounds_whatever_the_sign():
    # Ratios 2, 0.5, 1.1, 0.1 (old log-probs 0): is_high 0.2 bounds 2 (A < 0 too: CISPO bounds the weight, where
    # PPO's clip_frac would count only A > 0), is_low 0.2 bounds 0.5 and 0.1; 1.1 is inside. The fourth is masked.
    fig = _figures("cispo", _log([2.0, 0.5, 1.1, 0.1]), [0.0] * 4, [-1.0, 1.0, 1.0, 1.0], CispoArgs(is_low=0.2),
                   mask=[True, True, True, False])
    assert fig["is_clip_frac"] == pytest.approx(2 / 3)
    assert fig["is_clip_frac_high"] == pytest.approx(1 / 3) and fig["is_clip_frac_low"] == pytest.approx(1 / 3)
    assert "clip_frac" not in fig
    # The ratio figures over the three trained tokens: mean (2 + 0.5 + 1.1) / 3, k3 = (r - 1) - log r.
    assert fig["ratio_mean"] == pytest.approx(3.6 / 3) and fig["ratio_max"] == 2.0 and fig["ratio_min"] == 0.5
    k3 = sum((r - 1) - math.log(r) for r in (2.0, 0.5, 1.1)) / 3
    assert fig["approx_kl"] == pytest.approx(k3)
    # No lower bound by default (MiniMax-M1): 0.5 is not at a bound.
    assert _figures("cispo", _log([0.5]), [0.0], [1.0], CispoArgs())["is_clip_frac"] == 0.0


def test_dppo_counts_the_tokens_its_trust_region_dropped():
    # Probabilities old -> new: 0.2 -> 0.5 (moved +0.3 > 0.15, A > 0: dropped), 0.5 -> 0.3 (-0.2 < -0.15, A < 0:
    # dropped), 0.5 -> 0.6 (+0.1, A > 0: kept), 0.6 -> 0.3 (A > 0 and it fell: kept).
    new, old = _log([0.5, 0.3, 0.6, 0.3]), _log([0.2, 0.5, 0.5, 0.6])
    fig = _figures("dppo_tv", new, old, [1.0, -1.0, 1.0, 1.0], DppoTvArgs())
    assert fig["trust_mask_frac"] == 0.5 and fig["trust_mask_frac_high"] == 0.25 and fig["trust_mask_frac_low"] == 0.25
    assert fig["ratio_cap_frac"] == 0.0 and "clip_frac" not in fig
    assert _figures("dppo_tv", new, old, [1.0] * 4, DppoTvArgs(ratio_cap=2.0))["ratio_cap_frac"] == 0.25  # 0.5 / 0.2
    # Binary KL of 0.2 -> 0.5: 0.2 log(0.2/0.5) + 0.8 log(0.8/0.5) = 0.193 > 0.05 (rose, A > 0: dropped); 0.5 -> 0.6:
    # 0.5 log(5/6) + 0.5 log(5/4) = 0.020 (kept).
    fig = _figures("dppo_kl", _log([0.5, 0.6]), _log([0.2, 0.5]), [1.0, 1.0], DppoKlArgs())
    assert fig["trust_mask_frac"] == 0.5 and fig["trust_mask_frac_high"] == 0.5 and fig["trust_mask_frac_low"] == 0.0


def test_geo_mean_counts_where_its_log_ratio_clip_bites():
    # log r = 0.6 with A > 0 (past 0.4: bites), -0.6 with A > 0 (the min keeps -0.6: no bite, verl would count it),
    # -0.6 with A < 0 (bites), 0.1 (inside).
    fig = _figures("geo_mean", [0.6, -0.6, -0.6, 0.1], [0.0] * 4, [1.0, 1.0, -1.0, 1.0], GeoMeanArgs(),
                   loss_agg="seq-mean-token-mean")
    assert fig["log_clip_frac"] == 0.5 and fig["log_clip_frac_high"] == 0.25 and fig["log_clip_frac_low"] == 0.25
    assert "clip_frac" not in fig


def test_sapo_reports_its_gate_slope():
    # f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1)): 1 on policy; at r = 2 with A > 0 (tau 1) 4 s (1 - s), s = sigmoid(1).
    s = 1 / (1 + math.exp(-1.0))
    fig = _figures("sapo", _log([1.0, 2.0]), [0.0, 0.0], [1.0, 1.0], SapoArgs(), loss_agg="seq-mean-token-mean")
    assert fig["gate_slope_mean"] == pytest.approx((1.0 + 4 * s * (1 - s)) / 2)
    assert fig.keys() == RATIO_FIGURES | {"gate_slope_mean"}


def test_kl_cov_reports_the_share_it_penalised():
    # One token in 4 at ratio 0.25 (floor(0.25 * 4) = 1): the largest covariance.
    fig = _figures("kl_cov", [-1.0, -2.0, -0.5, -3.0], [-1.0] * 4, [1.0, -1.0, 2.0, 0.0], KlCovArgs(kl_cov_ratio=0.25))
    assert fig["kl_cov_frac"] == 0.25 and fig.keys() == RATIO_FIGURES | {"kl_cov_frac"}


@pytest.mark.parametrize("name, level", [("clipped", "token"), ("gspo", "sequence"), ("clip_cov", "token")])
def test_the_clipping_losses_keep_ppos_clip_figures(name, level):
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 5, generator=g, dtype=F64) - 1, torch.randn(3, 5, generator=g, dtype=F64) - 1
    adv, mask = torch.randn(3, 5, generator=g, dtype=F64), torch.rand(3, 5, generator=g) > 0.2
    settings = LossSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    got = POLICY_LOSSES.get(name).ratio_figures(LossInputs({"logp": logp, "mask": mask}, adv, old_logp=old), settings)
    want = policy_loss_metrics(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, level=level)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_update_logs_the_configured_losss_figures(tmp_path, tiny_lm_dir):
    """Two mini-batches a step (the second off policy): CISPO's run logs its own figures, no PPO clip_frac."""
    import unirl

    result = unirl.train("text", "tiny", {"rollout.engine": "hf", "trainer.total_steps": 1, "trainer.eval_every": 0,
                                          "trainer.save_every": 0, "algo.policy_loss": "cispo",
                                          "trainer.mini_batch_size": 64, "trainer.micro_batch_size": 64},
                         output_dir=tmp_path / "run", progress=False)
    row = next(m for m in result.metrics if "loss/policy" in m)
    assert {"actor/is_clip_frac", "actor/is_clip_frac_low", "actor/is_clip_frac_high", "actor/approx_kl"} <= row.keys()
    assert not any(k.startswith("actor/clip_frac") for k in row)
    assert row["actor/ratio_max"] > 1.0 or row["actor/ratio_min"] < 1.0  # the second mini-batch moved off policy
