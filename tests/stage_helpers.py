"""A step stage's context without a model: for the tests that run one stage (``unirl.trainer.plan``) on
hand-made tensors. The backend is the real default one (``DDPBackend``) over a one-process CPU
Accelerator; no environment, optimizer or policy loss, which such a stage does not read."""

from __future__ import annotations

from accelerate import Accelerator

from unirl.config.schema import AlgoConfig, OptimConfig, TrainerConfig
from unirl.core.policy_losses import loss_settings
from unirl.trainer.backends.ddp import DDPBackend
from unirl.trainer.context import StepContext


def stage_context(algo: AlgoConfig, cfg: TrainerConfig) -> StepContext:
    backend = DDPBackend(Accelerator(cpu=True), cfg)
    return StepContext(env=None, backend=backend, algo=algo, cfg=cfg, optim=OptimConfig(), policy_loss=None,
                       loss_settings=loss_settings("clipped", algo))
