"""What the model-family tests share: a set-up environment on a toy, and a LoRA moved off zero."""

from __future__ import annotations

import torch

from unirl.config import load_config
from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.env import DiffusionEnvironment


def make_env(*overrides: str) -> DiffusionEnvironment:
    """A ``DiffusionEnvironment`` set up on the CPU from the default config and ``overrides``, also after a run
    in this process has left Accelerate's shared state on CUDA (``machine.fresh_accelerate_state``)."""
    from accelerate import Accelerator
    from machine import fresh_accelerate_state

    fresh_accelerate_state()
    env = DiffusionEnvironment(load_config(DiffusionConfig, None, list(overrides)))
    env.setup(Accelerator(cpu=True))
    return env


def perturb_lora(env: DiffusionEnvironment, seed: int = 0, scale: float = 0.3) -> None:
    """Gaussian LoRA B weights (they start at zero, where the policy is the reference), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in env.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
