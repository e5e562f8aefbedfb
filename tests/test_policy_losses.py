"""Registered policy losses (``unirl/core/policy_losses.py``): the shipped ones are the formulas they
name, a duplicate name is refused, and a loss added in one function trains a step of the tiny text model
(what ``docs/architecture.md`` tells a reader to do), as does a new advantage estimator."""

from __future__ import annotations

import re

import pytest
import torch

from unirl.core import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, LossInputs, LossSettings, clipped_policy_loss, register_policy_loss


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,level", [("clipped", "token"), ("gspo", "sequence")])
def test_ratio_losses_are_clipped_policy_loss(seed, name, level):
    logp, old, adv, mask = _inputs(seed)
    settings = LossSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0 if level == "token" else None,
                            loss_agg="seq-mean-token-mean")
    got, figures = POLICY_LOSSES.get(name).fn(LossInputs({"logp": logp, "mask": mask}, adv, old_logp=old), settings)
    want, _ = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=settings.dual_clip,
                                  level=level, agg="seq-mean-token-mean")
    assert torch.equal(got, want) and torch.equal(figures["loss/policy"], want.detach())
    assert POLICY_LOSSES.get(name).whole_sequences == (level == "sequence")


def test_a_duplicate_loss_name_is_refused():
    with pytest.raises(ValueError, match="policy loss 'clipped' is already registered"):
        register_policy_loss("clipped")(lambda inputs, settings: None)


def test_a_new_loss_and_a_new_estimator_train_a_step(tmp_path, tiny_lm_dir):
    from unirl.cli import load_run_config
    from unirl.config import config_to_dict
    from unirl.text.env import TextEnvironment
    from unirl.trainer.loop import Trainer

    calls = []

    # A vanilla policy gradient, -A * logp averaged over trained tokens: one function, one decorator.
    @register_policy_loss("test_vanilla_pg")
    def vanilla_pg(inputs: LossInputs, settings: LossSettings):
        calls.append(inputs.forward["logp"].shape)
        mask = inputs.mask.bool()
        loss = torch.where(mask, -inputs.advantages * inputs.forward["logp"], 0.0).sum() / mask.sum().clamp_min(1)
        return loss, {"loss/policy": loss.detach()}

    # Advantages: the reward minus the batch mean (no groups).
    @ADVANTAGE_ESTIMATORS.register("test_batch_mean")
    def batch_mean(rewards, group_ids, **_):
        calls.append("estimator")
        return rewards - rewards.mean(), None

    try:
        cfg = load_run_config("text", "tiny", [
            "rollout.engine=hf", "trainer.total_steps=1", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.progress=false", "algo.adv_estimator=test_batch_mean", "optim.lr=1e-2",
        ], output_dir=str(tmp_path / "run"))
        env = TextEnvironment(cfg)
        trainer = Trainer(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                          config_dict=config_to_dict(cfg), policy_loss="test_vanilla_pg")
        trainer.setup()
        before = [p.detach().clone() for p in env.model.parameters() if p.requires_grad]
        metrics = trainer.train_step()
        after = [p.detach() for p in env.model.parameters() if p.requires_grad]
        env.close()
        assert "estimator" in calls and len(calls) > 1 and "loss/policy" in metrics
        assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the step trained
    finally:
        POLICY_LOSSES.remove("test_vanilla_pg")
        ADVANTAGE_ESTIMATORS.remove("test_batch_mean")


def test_algo_policy_loss_selects_a_registered_loss_that_trains_a_step(tmp_path, tiny_lm_dir):
    """``algo.policy_loss`` names a registered loss in the config: ``unirl.train`` trains with it (it is
    called on the step's log-probs and the weights move), with no ``policy_loss=`` passed by hand."""
    import unirl

    calls = []

    @register_policy_loss("test_config_pg")
    def config_pg(inputs: LossInputs, settings: LossSettings):
        calls.append(inputs.forward["logp"].shape)
        mask = inputs.mask.bool()
        loss = torch.where(mask, -inputs.advantages * inputs.forward["logp"], 0.0).sum() / mask.sum().clamp_min(1)
        return loss, {"loss/policy": loss.detach(), "loss/test_config_pg": loss.detach()}

    try:
        result = unirl.train("text", "tiny", {"rollout.engine": "hf", "trainer.total_steps": 1, "trainer.eval_every": 0,
                                              "trainer.save_every": 0, "algo.policy_loss": "test_config_pg",
                                              "optim.lr": 1e-2}, output_dir=tmp_path / "run", progress=False)
    finally:
        POLICY_LOSSES.remove("test_config_pg")
    assert calls and "loss/test_config_pg" in result.metrics[-1]  # the configured loss made the step's figures
    assert result.metrics[-1]["actor/grad_norm"] > 0


def test_a_loss_with_its_own_settings_reads_them_from_algo_loss_args(tmp_path, tiny_lm_dir):
    """A loss registers a dataclass of its knobs (``settings=``); ``algo.loss_args`` fills it where the config
    loads (an unknown key or a bad value is one line naming ``algo.loss_args.<key>``), and the loss reads the
    instance as ``settings.args`` during the step. One file adds such a loss: nothing else names it."""
    from dataclasses import dataclass

    import unirl
    from unirl.config import load_config
    from unirl.text.config import TextConfig

    @dataclass(frozen=True)
    class ScaledArgs:
        scale: float = 1.0

        def __post_init__(self):
            if not self.scale > 0:
                raise ValueError(f"scale must be > 0, got {self.scale}")

    seen = []

    @register_policy_loss("test_scaled_pg", settings=ScaledArgs)
    def scaled_pg(inputs: LossInputs, settings: LossSettings):
        seen.append(settings.args)
        mask = inputs.mask.bool()
        loss = torch.where(mask, -inputs.advantages * inputs.forward["logp"], 0.0).sum() / mask.sum().clamp_min(1)
        return settings.args.scale * loss, {"loss/policy": loss.detach()}

    try:
        base = ["algo.policy_loss=test_scaled_pg"]
        assert load_config(TextConfig, None, base).algo.loss_args == {}
        with pytest.raises(ValueError, match=r"algo.loss_args.scal: not a setting of the policy loss 'test_scaled_pg'; "
                                             r"its settings: scale"):
            load_config(TextConfig, None, [*base, "algo.loss_args.scal=2"])
        with pytest.raises(ValueError, match=r"algo.loss_args \(test_scaled_pg\): scale must be > 0, got -1"):
            load_config(TextConfig, None, [*base, "algo.loss_args.scale=-1"])
        with pytest.raises(ValueError, match="the policy loss 'clipped' has no settings of its own, got scale"):
            load_config(TextConfig, None, ["algo.loss_args.scale=2"])
        unirl.train("text", "tiny", {"rollout.engine": "hf", "trainer.total_steps": 1, "trainer.eval_every": 0,
                                     "trainer.save_every": 0, "algo.policy_loss": "test_scaled_pg",
                                     "algo.loss_args.scale": 3.0}, output_dir=tmp_path / "run", progress=False)
    finally:
        POLICY_LOSSES.remove("test_scaled_pg")
    assert seen and all(args == ScaledArgs(scale=3.0) for args in seen)


def test_algo_policy_loss_is_checked_where_the_config_loads():
    from unirl.config import load_config
    from unirl.diffusion.config import DiffusionConfig
    from unirl.text.config import TextConfig

    # An unknown name: one line with the registered ones (the shipped ones at least).
    from unirl.core import POLICY_LOSSES

    assert {"cispo", "clip_cov", "clipped", "dppo_kl", "dppo_tv", "geo_mean", "gspo", "kl_cov", "nft", "sapo", "grpo_guard",
            "flow_dppo", "dgpo", "tempflow"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match=r"policy_loss: unknown policy loss 'clippd'\. Did you mean 'clipped'\?"
                                         r" Available: " + re.escape(", ".join(POLICY_LOSSES))) as caught:
        load_config(TextConfig, None, ["algo.policy_loss=clippd"])
    assert "\n" not in str(caught.value)
    # A loss the rollouts cannot feed: nft reads DiffusionNFT's velocities only.
    with pytest.raises(ValueError, match="algo.policy_loss=nft"):
        load_config(TextConfig, None, ["algo.policy_loss=nft"])
    with pytest.raises(ValueError, match="algo.policy_loss=nft with algorithm=flowgrpo"):
        load_config(DiffusionConfig, None, ["algo.policy_loss=nft"])
    with pytest.raises(ValueError, match="algo.policy_loss=clipped with algorithm=nft"):
        load_config(DiffusionConfig, None, ["algorithm=nft", "sampling.train_cfg=false", "sampling.sde_window.size=0",
                                            "algo.policy_loss=clipped"])
    assert load_config(DiffusionConfig, None, ["algo.policy_loss=gspo", "algo.loss_agg=seq-mean-token-mean"]
                       ).algo.policy_loss == "gspo"
    # GSPO is defined with seq-mean-token-mean (verl hard-codes it): another is refused here, not at the first step.
    with pytest.raises(ValueError, match="algo.policy_loss=gspo aggregates with loss_agg=seq-mean-token-mean"):
        load_config(DiffusionConfig, None, ["algo.policy_loss=gspo"])


def test_the_run_policy_loss_is_the_configured_one_first():
    from types import SimpleNamespace

    from unirl.config.schema import AlgoConfig
    from unirl.trainer.update import run_policy_loss

    flowgrpo = SimpleNamespace(actions=SimpleNamespace(policy_loss=None))
    nft = SimpleNamespace(actions=SimpleNamespace(policy_loss="nft"))
    assert run_policy_loss(flowgrpo, AlgoConfig()) == "clipped"
    assert run_policy_loss(flowgrpo, AlgoConfig(level="sequence", loss_agg="seq-mean-token-mean")) == "gspo"
    assert run_policy_loss(nft, AlgoConfig()) == "nft"
    assert run_policy_loss(flowgrpo, AlgoConfig(policy_loss="gspo")) == "gspo"
