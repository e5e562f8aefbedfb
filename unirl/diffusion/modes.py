"""The shipped diffusion algorithms, loaded: ``shipped_modes`` imports each registered rollout mode
(``unirl/diffusion/{flowgrpo,nft,awm,dgpo,tempflow,gardo}.py``, which register on import into
``unirl.diffusion.rollout_mode.ROLLOUT_MODES``), and the checks of a config's ``algorithm`` and
``mode_args`` against them. Kept apart from ``rollout_mode.py`` so the modes import the registry and the
registry imports no mode."""

from __future__ import annotations

from typing import Any

from unirl.diffusion.rollout_mode import ROLLOUT_MODES, RolloutMode, build_settings
from unirl.registry import Registry


def shipped_modes() -> Registry[type[RolloutMode]]:
    """``ROLLOUT_MODES`` with the shipped modes imported (they register on import)."""
    import unirl.diffusion.awm  # noqa: F401
    import unirl.diffusion.dgpo  # noqa: F401
    import unirl.diffusion.flowgrpo  # noqa: F401
    import unirl.diffusion.gardo  # noqa: F401
    import unirl.diffusion.nft  # noqa: F401
    import unirl.diffusion.tempflow  # noqa: F401

    return ROLLOUT_MODES


def build_mode_args(name: str, given: dict[str, Any] | None) -> Any:
    """The settings instance of the shipped or registered rollout mode ``name`` from ``given`` (``mode_args``)."""
    return build_settings(name, shipped_modes().get(name).settings, given)


def resolve_algorithm(cfg) -> str:
    """Check ``cfg.algorithm`` (a registered mode), its ``mode_args``, the run's policy loss and its
    ``algo.loss_args``, that the mode's forward gives what the loss reads, and the mode's own
    ``check_config``; returns the run's policy loss. Called where a ``DiffusionConfig`` loads."""
    from unirl.config.schema import check_loss_args

    modes = shipped_modes()
    if cfg.algorithm not in modes:
        raise ValueError(f"algorithm: {modes.unknown_message(cfg.algorithm)}")
    mode = modes.get(cfg.algorithm)
    build_mode_args(cfg.algorithm, cfg.mode_args)
    own = mode.policy_loss or "the ratio loss of algo, clipped or gspo"
    name = check_loss_args(cfg.algo, mode.policy_loss, offers=mode.offers, where=f"algorithm={cfg.algorithm}",
                           hint=f"; leave algo.policy_loss null for the algorithm's own ({own}) or choose another algorithm")
    if cfg.sampling.sampler_old_means:
        if not mode.keeps_sampler_means:
            raise ValueError(f"sampling.sampler_old_means=true: algorithm={cfg.algorithm} samples no SDE steps, so its "
                             f"sampler has no step means to keep; set it to false")
        if not cfg.algo.use_kl_in_reward:
            raise ValueError("sampling.sampler_old_means=true: only the KL in the reward reads the old step means; "
                             "set algo.use_kl_in_reward: true or sampling.sampler_old_means: false")
    mode.check_config(cfg)
    return name
