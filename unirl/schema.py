"""Config dataclasses shared by every environment: the algorithm, the optimizer and the loop.

YAML fills these (see ``unirl/config.py``); ``key=value`` overrides win; unknown keys and wrong
types fail with the dotted path of the bad key. Environment configs (``unirl/text/config.py``,
``unirl/diffusion/config.py``) nest them under ``algo``, ``optim`` and ``trainer``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from unirl.config import FILE_SPEC

#: Trackers ``trainer.log_with`` accepts: the module that must import, and the package to install.
TRACKERS = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}


@dataclass
class KLControlConfig:
    """The coefficient of the KL in the reward (``algo.use_kl_in_reward``), verl's ``algorithm.kl_ctrl``."""

    #: ``fixed`` (beta stays ``kl_coef``) or ``adaptive`` (Ziegler et al. 2019; ``unirl/kl_control.py``).
    type: Literal["fixed", "adaptive"] = "fixed"
    #: The initial beta (verl's default 0.001).
    kl_coef: float = 0.001
    #: ``adaptive``: the per-token KL it steers towards, and the number of sequences over which it
    #: may change beta by 20% (verl's defaults 0.1 and 10000).
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self):
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.target_kl <= 0 or self.horizon < 1:
            raise ValueError(f"target_kl must be > 0 and horizon >= 1, got {self.target_kl} and {self.horizon}")


@dataclass
class AlgoConfig:
    """Policy-gradient settings (the functions live in ``unirl/core``)."""

    #: Advantage estimator: ``grpo``, ``rloo`` or ``reinforce++-baseline`` (one reward a sample, groups
    #: as the baseline); ``gae`` (PPO: a critic is trained as the baseline, ``critic:``) or
    #: ``reinforce++`` (discounted token rewards, whitened), which read the rewards on tokens.
    adv_estimator: str = "grpo"
    #: How ``grpo`` scales the centred rewards: by the group's std (GRPO), the batch's std
    #: (FlowGRPO's global_std) or not at all (Dr.GRPO).
    adv_scale: Literal["group", "batch", "none"] = "group"
    #: The std convention of ``adv_scale``: ``unbiased`` (Bessel's correction; verl, TRL) or
    #: ``biased`` (numpy's ``np.std``; FlowGRPO's ``PerPromptStatTracker``).
    adv_std: Literal["unbiased", "biased"] = "unbiased"
    #: Added to the std before dividing (verl/TRL 1e-6; FlowGRPO 1e-4).
    adv_eps: float = 1e-6
    #: Clamp advantages to [-adv_clip, adv_clip] (FlowGRPO uses 5); null disables.
    adv_clip: Optional[float] = None
    #: Drop samples whose advantage is zero at every token/step before the update (FlowGRPO does),
    #: so under ``token-mean`` they do not dilute the policy term; ``adv/dropped_frac`` logs how many.
    #: The number of optimizer steps per training step stays the same: the kept samples are split
    #: into as many mini-batches, topped up with dropped samples (chosen at random) until they
    #: divide evenly, as FlowGRPO does.
    drop_zero_adv: bool = False
    clip_low: float = 0.2
    #: DAPO's clip-higher uses a larger upper bound (e.g. 0.28).
    clip_high: float = 0.2
    #: Dual-clip constant (> 1) for negative advantages; null disables.
    dual_clip: Optional[float] = None
    #: ``sequence`` gives GSPO's sequence-level ratio; it needs ``loss_agg: seq-mean-token-mean``
    #: (verl hard-codes that mode for GSPO).
    level: Literal["token", "sequence"] = "token"
    #: Loss aggregation (verl's names): token-mean, seq-mean-token-mean, seq-mean-token-sum,
    #: seq-mean-token-sum-norm (Dr. GRPO: divided by sequences x the environment's constant length,
    #: ``rollout.max_new_tokens`` for text, like TRL's ``dr_grpo``).
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    #: Weight of the KL-to-reference penalty in the loss (``beta``); 0 skips the reference pass.
    kl_coef: float = 0.0
    #: KL estimator for text (k1, k2, k3, k3+); diffusion uses the closed-form Gaussian KL.
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    #: verl's safety clamp of the k3 estimators (``low_var_kl``): the value is clamped to at most
    #: this (and its exponent to [-20, 20]). Applies to k3 and k3+ only; null gives the exact value.
    kl_clamp: Optional[float] = 10.0
    #: Entropy bonus coefficient (text); 0 disables.
    entropy_coef: float = 0.0
    #: Truncated importance sampling cap for the rollout-engine vs trainer mismatch; null disables.
    tis_cap: Optional[float] = None
    #: How several rewards combine (TRL's multi_objective_aggregation): ``sum_then_normalize`` takes
    #: the weighted sum of the raw rewards, then advantages normalise it; ``normalize_then_sum``
    #: normalises each reward within its group first, then takes the weighted sum.
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    #: Subtract ``beta * KL(old policy || reference)`` from the reward on every token (verl's
    #: ``algorithm.use_kl_in_reward``, estimator ``kl_estimator``); beta from ``kl_ctrl``. Logged as
    #: ``actor/reward_kl_penalty`` (the batch's mean KL) and ``actor/reward_kl_penalty_coeff`` (beta).
    use_kl_in_reward: bool = False
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    #: Discount and GAE's lambda of the token-reward estimators (``gae``, ``reinforce++``; verl's 1 and 1).
    gamma: float = 1.0
    lam: float = 1.0

    def __post_init__(self):
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low and clip_high must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"kl_clamp must be > 0 or null, got {self.kl_clamp}")
        if self.adv_eps < 0:
            raise ValueError(f"adv_eps must be >= 0, got {self.adv_eps}")
        if self.level == "sequence" and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(
                f"level=sequence (GSPO) aggregates with loss_agg=seq-mean-token-mean, as verl does; "
                f"got loss_agg={self.loss_agg} (set algo.loss_agg=seq-mean-token-mean)"
            )
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma} and {self.lam}")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    #: Linear warm-up steps (optimizer steps), then constant.
    warmup_steps: int = 0
    #: Gradient-norm clipping; null disables.
    max_grad_norm: Optional[float] = 1.0

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass
class RewardConfig:
    """One reward: a registered name, ``path/file.py:function`` or ``package.module:function``."""

    name: str = field(default="gsm8k", metadata=FILE_SPEC)
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    """The loop: how many samples per step and how they are cut for the update."""

    total_steps: int = 100
    #: B: prompts per step (per process).
    prompts_per_step: int = 8
    #: G: samples per prompt.
    group_size: int = 8
    #: Passes over each step's samples.
    ppo_epochs: int = 1
    #: Samples per optimizer step; must divide B*G.
    mini_batch_size: int = 64
    #: Samples per forward/backward (gradient accumulation inside a mini-batch); must divide mini_batch_size.
    micro_batch_size: int = 8
    #: Token budget per forward/backward (verl's dynamic batch size, ``ppo_max_token_len_per_gpu``):
    #: each mini-batch's samples, longest first, are packed into micro-batches of at most this many
    #: padded tokens (samples x the longest one's prompt + response; a longer sample goes alone), each
    #: padded only to its own longest. Replaces ``micro_batch_size`` for the trainer's passes; the loss
    #: is the same (the mini-batch normaliser is global). null: ``micro_batch_size`` samples each.
    micro_batch_tokens: Optional[int] = None
    seed: int = 0
    #: Run the held-out evaluation every N steps (and at the end); 0 disables.
    eval_every: int = 0
    #: Save a checkpoint every N steps (and at the end); 0 saves only at the end.
    save_every: int = 0
    #: Keep at most this many step checkpoints (oldest removed first); null keeps all.
    keep_checkpoints: Optional[int] = 2
    #: Continue from the latest checkpoint in the run directory.
    resume: bool = False
    #: Accelerate's mixed precision: no, fp16, bf16.
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    #: Extra trackers besides metrics.jsonl: wandb, tensorboard. They write under the run directory
    #: (wandb offline with ``WANDB_MODE=offline``) and get the same keys as metrics.jsonl, plus the
    #: evaluation's images (diffusion grids) and answers (text, as a table).
    log_with: list[str] = field(default_factory=list)
    project: str = "unirl"
    #: Show a progress bar.
    progress: bool = True
    #: Threads scoring finished chunks of samples while the next chunk is sampled (0: score inline).
    #: The rewards are identical either way.
    reward_workers: int = 0
    #: The first N steps update only the critic (verl's ``trainer.critic_warmup``), so the actor's first
    #: advantages come from a value model that has seen some returns.
    critic_warmup: int = 0

    def __post_init__(self):
        n = self.prompts_per_step * self.group_size
        for name in ("total_steps", "prompts_per_step", "group_size", "ppo_epochs", "mini_batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if n % self.mini_batch_size:
            raise ValueError(
                f"mini_batch_size={self.mini_batch_size} must divide prompts_per_step*group_size="
                f"{self.prompts_per_step}*{self.group_size}={n}"
            )
        if self.micro_batch_tokens is None and self.mini_batch_size % self.micro_batch_size:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must divide mini_batch_size={self.mini_batch_size}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 or null, got {self.micro_batch_tokens}")
        if self.reward_workers < 0:
            raise ValueError(f"reward_workers must be >= 0, got {self.reward_workers}")
        if self.critic_warmup < 0:
            raise ValueError(f"critic_warmup must be >= 0, got {self.critic_warmup}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 or null, got {self.keep_checkpoints}")
        for tracker in self.log_with:
            if tracker not in TRACKERS:
                raise ValueError(f"log_with: unknown tracker {tracker!r}; choose from {', '.join(TRACKERS)}")
            module, package = TRACKERS[tracker]
            if importlib.util.find_spec(module) is None:
                raise ValueError(f"log_with: {tracker} is not installed; run `pip install {package}` (or drop it from log_with)")
