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


def sigterm_after(trainer, step: int) -> None:
    """Make ``trainer`` receive SIGTERM during step ``step`` (as a scheduler's stop would arrive): that step
    finishes, the checkpoint is written and ``train`` raises ``Preempted``."""
    import signal

    run_step = trainer.train_step

    def signalled():
        if trainer.step == step - 1:
            trainer.signals.signal = signal.SIGTERM
        return run_step()

    trainer.train_step = signalled


#: The toy SD3 at its smallest (32 px, 6 steps, 3 prompts x 4): the diffusion tests that build a Trainer in
#: process (tests/test_flow_methods.py, tests/test_step_reuse.py) start from it.
TINY_DIFFUSION = ["model.name_or_path=tiny", "sampling.resolution=32", "sampling.max_sequence_length=16",
                  "sampling.guidance_scale=1.0", "sampling.train_cfg=false", "trainer.prompts_per_step=3",
                  "trainer.group_size=4", "trainer.mini_batch_size=12", "trainer.micro_batch_size=12",
                  "sampling.chunk_size=5", "sampling.num_steps=6", "sampling.eval_num_steps=4", "ema.enabled=false",
                  "trainer.eval_every=0", "trainer.progress=false", "trainer.reward_workers=0"]


def diffusion_trainer(tmp_path, *overrides: str, base: list[str] = TINY_DIFFUSION):
    """A set-up Trainer of the toy SD3 with ``base`` then ``overrides`` (later ones win), writing to ``tmp_path``."""
    from unirl.config import load_config
    from unirl.diffusion import build_environment
    from unirl.diffusion.config import DiffusionConfig
    from unirl.trainer.loop import Trainer

    cfg = load_config(DiffusionConfig, None, [*base, f"output_dir={tmp_path}", *overrides])
    trainer = Trainer.from_config(build_environment(cfg), cfg)
    trainer.setup()
    return trainer
