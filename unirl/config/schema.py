"""Config dataclasses shared by every environment: the algorithm, the optimizer and the loop.

YAML fills these (see ``unirl/config/loading.py``); ``key=value`` overrides win; unknown keys and wrong
types fail with the dotted path of the bad key. Environment configs (``unirl/text/config.py``,
``unirl/diffusion/config.py``) nest them under ``algo``, ``optim`` and ``trainer``.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from unirl.config import FILE_SPEC
from unirl.config.checks import check_range  # noqa: F401 (the sections' and environments' range checks import it here)
from unirl.config.source import AgentEndpointConfig, SourceConfig  # noqa: F401 (a RunConfig's source block)

#: Trackers ``trainer.log_with`` accepts: the module that must import, and the package to install.
TRACKERS = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}
#: Advantage estimators whose baseline is the prompt's group: with one sample a group every advantage is 0.
GROUP_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce++-baseline"})


def check_adv_estimator(name: str) -> None:
    """Raise ``ValueError`` (one line listing the valid names) unless ``name`` is a registered advantage
    estimator. The names are those of ``unirl.core``'s ``ADVANTAGE_ESTIMATORS``, the registry the loop
    looks the estimator up in, so a user's registered estimator counts; reading it imports torch
    (loading a config costs that once; ``unirl config list`` loads none)."""
    from unirl.core import ADVANTAGE_ESTIMATORS

    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"adv_estimator: {ADVANTAGE_ESTIMATORS.unknown_message(name)}")


def check_policy_loss(name: str | None) -> None:
    """Raise ``ValueError`` (one line listing the valid names) unless ``name`` is None or a registered
    policy loss (``unirl.core``'s ``POLICY_LOSSES``, the registry the trainer looks it up in; a user's
    registered loss counts, as for ``check_adv_estimator``)."""
    if name is None:
        return
    from unirl.core import POLICY_LOSSES

    if name not in POLICY_LOSSES:
        raise ValueError(f"policy_loss: {POLICY_LOSSES.unknown_message(name)}")


def check_loss_args(algo: "AlgoConfig", default: str | None = None, *, offers: frozenset[str] | None = None,
                    where: str = "the environment", hint: str = "") -> str:
    """The run's policy loss (``algo.policy_loss``, else the rollout mode's ``default``, else the ratio loss
    at ``algo.level``: ``clipped`` per token, ``gspo`` per sequence), after checking ``algo.loss_args``
    against its registered settings (``ValueError`` naming the bad key) and ``algo.loss_agg`` against the
    one aggregation the loss may be defined with (``PolicyLoss.loss_agg``); environment configs call it.
    ``offers``: what the environment's forward gives (``score_actions``' keys besides ``mask``); a loss
    that reads more (``PolicyLoss.reads``, and ``logp`` for a ratio loss) is refused, naming what it lacks,
    ``where`` (whose rollouts lack it) and ``hint`` (what to do instead)."""
    from unirl.core.policy_losses import POLICY_LOSSES, build_loss_args

    name = algo.policy_loss or default or ("gspo" if algo.level == "sequence" else "clipped")
    build_loss_args(name, algo.loss_args)
    loss = POLICY_LOSSES.get(name)
    if loss.loss_agg is not None and algo.loss_agg != loss.loss_agg:
        raise ValueError(f"algo.policy_loss={name} aggregates with loss_agg={loss.loss_agg}, as verl does; got "
                         f"loss_agg={algo.loss_agg} (set algo.loss_agg={loss.loss_agg})")
    if offers is not None:
        missing = sorted((loss.reads | ({"logp"} if loss.reads_logprobs else set())) - offers)
        if missing:
            raise ValueError(f"algo.policy_loss={name} with {where}: the loss reads {', '.join(missing)}, which "
                             f"{where}'s rollouts do not give (they give {', '.join(sorted(offers))}){hint}")
    return name


def check_groups(algo: "AlgoConfig", trainer: "TrainerConfig") -> None:
    """A group estimator with one sample per prompt trains on all-zero advantages: refused."""
    if algo.adv_estimator in GROUP_ESTIMATORS and trainer.group_size < 2:
        raise ValueError(
            f"trainer.group_size={trainer.group_size}: algo.adv_estimator={algo.adv_estimator} compares the samples "
            f"of one prompt, so a group of one gives every advantage 0 (nothing is learned); use group_size >= 2")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``; ``unirl/trainer/dynamic_sampling.py``)."""

    #: Drop the groups whose ``metric`` is the same for every sample, and generate more batches of
    #: ``trainer.prompts_per_step`` prompts until that many groups are kept (the surplus is dropped).
    enabled: bool = False
    #: The raw reward component judged, by its metric name (``gsm8k`` for ``reward/gsm8k``): never the
    #: shaped total, whose overlong penalty would make a constant group look varied (verl-recipe #125).
    metric: Optional[str] = None
    #: Generation batches per step at most (verl's ``max_num_gen_batches``; the DAPO recipe's 10);
    #: 0: no limit (a line after 10, 100, 1000 ... batches says it is still drawing; SIGTERM stops it).
    max_num_gen_batches: int = 10
    #: At the limit with fewer groups kept: ``error`` stops the run (verl), ``train`` trains on the
    #: groups kept (the same number on every process).
    on_exhausted: Literal["error", "train"] = "error"

    def __post_init__(self):
        if self.enabled and not self.metric:
            raise ValueError("algo.filter_groups.metric: name the raw reward component to judge (e.g. gsm8k)")
        if self.max_num_gen_batches < 0:
            raise ValueError(f"algo.filter_groups.max_num_gen_batches must be >= 0, got {self.max_num_gen_batches}")


@dataclass
class KLControlConfig:
    """The coefficient of the KL in the reward (``algo.use_kl_in_reward``), verl's ``algorithm.kl_ctrl``."""

    #: ``fixed`` (beta stays ``kl_coef``) or ``adaptive`` (Ziegler et al. 2019; ``unirl/trainer/kl_control.py``).
    type: Literal["fixed", "adaptive"] = "fixed"
    #: The initial beta (verl's default 0.001).
    kl_coef: float = 0.001
    #: ``adaptive``: the per-token KL it steers towards (verl's default 0.1).
    target_kl: float = 0.1
    #: ``adaptive``: sequences over which beta may change by 20% (verl's 10000).
    horizon: int = 10000

    def __post_init__(self):
        check_range(self, "kl_coef", low=0)
        check_range(self, "target_kl", low=0, low_open=True)
        check_range(self, "horizon", low=1)


@dataclass
class AlgoConfig:
    """Policy-gradient settings (the functions live in ``unirl/core``)."""

    config_moved = {"bypass_mode": "source.bypass_mode"}

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
    #: Added to the std before dividing (verl 1e-6; TRL and FlowGRPO 1e-4).
    adv_eps: float = 1e-6
    #: Clamp advantages to [-adv_clip, adv_clip] (FlowGRPO uses 5); null disables.
    adv_clip: Optional[float] = None
    #: Drop samples whose advantage is zero at every token/step before the update (FlowGRPO does),
    #: so under ``token-mean`` they do not dilute the policy term; ``adv/dropped_frac`` logs how many.
    #: The number of optimizer steps per training step stays the same: the kept samples are topped up
    #: with dropped ones (chosen at random) to a multiple of the step's micro-batches per process
    #: (B*G / micro_batch_size; the mini-batches with micro_batch_tokens), as FlowGRPO tops up to a
    #: multiple of its per-process sampling batches, so every micro-batch is equally full.
    drop_zero_adv: bool = False
    #: PPO's lower clip: the ratio is clipped to at least 1 - clip_low.
    clip_low: float = 0.2
    #: DAPO's clip-higher uses a larger upper bound (e.g. 0.28).
    clip_high: float = 0.2
    #: Dual-clip constant (> 1) for negative advantages; null disables.
    dual_clip: Optional[float] = None
    #: ``sequence`` gives GSPO's sequence-level ratio; it needs ``loss_agg: seq-mean-token-mean``
    #: (verl hard-codes that mode for GSPO).
    level: Literal["token", "sequence"] = "token"
    #: The registered policy loss by name (``unirl/core/policy_losses.py``: ``clipped``, ``gspo``,
    #: ``nft``, or one you register, docs/architecture.md); null: the environment's rollout mode's
    #: (DiffusionNFT: ``nft``), else ``clipped``, or ``gspo`` with ``level: sequence``.
    policy_loss: Optional[str] = None
    #: The policy loss's own settings, by the names of the dataclass it registered (``unirl config losses``
    #: lists each loss's settings and defaults, which are its reference's): ``{beta: 0.1}`` for ``nft``.
    #: Checked where the config loads; an unknown key names the loss's valid ones.
    loss_args: dict[str, Any] = field(default_factory=dict)
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
    #: Importance-sampling bound C_max for the rollout-engine vs trainer mismatch (TRL's
    #: ``vllm_importance_sampling_clip_max``, verl's ``rollout_is_threshold``); null: no correction.
    tis_cap: Optional[float] = None
    #: How several rewards combine (TRL's multi_objective_aggregation): ``sum_then_normalize`` takes
    #: the weighted sum of the raw rewards, then advantages normalise it; ``normalize_then_sum``
    #: normalises each reward within its group first ((r - mean) / (std + adv_eps)), then takes the
    #: weighted sum, which the advantage estimator normalises again. TRL normalises that sum over the
    #: batch: ``adv_scale: batch`` with ``adv_eps: 1e-4`` gives TRL's advantages exactly (the sum's
    #: group means are already 0).
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    #: How ``tis_cap`` corrects the mismatch (TRL's ``vllm_importance_sampling_mode``): token_truncate
    #: (TIS, ``min(rho_t, C)``; what unirl did before the modes), token_mask (tokens outside the
    #: bounds get weight 0), sequence_truncate / sequence_mask (the same on the product of a
    #: sequence's ratios: verl's Seq-TIS / Seq-MIS). TRL's default is sequence_mask with C_max 3.
    #: The bounds act on rho = pi_trainer / pi_engine, as TRL's; verl's rejection ``seq_sum_k1`` /
    #: ``token_k1`` bounds 1/rho, so its ``rollout_rs_threshold: "a_b"`` is ``rollout_is_min: 1/b``,
    #: ``tis_cap: 1/a`` here (the same for its symmetric "0.5_2.0").
    #: ``unirl.core.rollout_correction``; the mismatch figures are logged whatever the mode.
    rollout_is: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "token_truncate"
    #: Lower bound C_min (TRL's ``vllm_importance_sampling_clip_min``): truncate modes clamp below it,
    #: mask modes reject below it; null: none.
    rollout_is_min: Optional[float] = None
    #: DAPO's dynamic sampling.
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    #: Subtract ``beta * KL(old policy || reference)`` from the reward on every token (verl's
    #: ``algorithm.use_kl_in_reward``, estimator ``kl_estimator``); beta from ``kl_ctrl``. Logged as
    #: ``actor/reward_kl_penalty`` (the batch's mean KL) and ``actor/reward_kl_penalty_coeff`` (beta).
    use_kl_in_reward: bool = False
    #: How the KL enters the reward: ``sum`` (verl's: the score minus beta times the trajectory's summed KL, one
    #: advantage a sample) or ``per_step`` (diffusion: each denoising step's reward is the score minus beta times
    #: that step's KL, advantages per step; FlowGRPO's ``kl_reward``, ``unirl.core.kl_step_rewards``).
    kl_in_reward: Literal["sum", "per_step"] = "sum"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    #: Discount and GAE's lambda of the token-reward estimators (``gae``, ``reinforce++``; verl's 1 and 1).
    gamma: float = 1.0
    #: GAE's lambda: 1 gives reward-to-go minus the value, 0 the one-step TD error (verl's 1).
    lam: float = 1.0

    def __post_init__(self):
        # Each range once; check_range also refuses NaN, which passes a plain comparison.
        check_adv_estimator(self.adv_estimator)
        check_policy_loss(self.policy_loss)
        check_range(self, "clip_low", low=0, high=1, high_open=True)  # the ratio's lower bound 1 - clip_low > 0
        for name in ("clip_high", "kl_coef", "entropy_coef", "adv_eps"):
            check_range(self, name, low=0)
        check_range(self, "dual_clip", low=1, low_open=True, optional=True)
        check_range(self, "tis_cap", low=0, low_open=True, optional=True)
        check_range(self, "kl_clamp", low=0, low_open=True, optional=True)
        check_range(self, "adv_clip", low=0, low_open=True, optional=True)  # -1 would set every advantage to -1
        check_range(self, "gamma", low=0, high=1)
        check_range(self, "lam", low=0, high=1)
        if self.rollout_is_min is not None and not 0 < self.rollout_is_min < (self.tis_cap or math.inf):
            raise ValueError(f"algo.rollout_is_min must be in (0, tis_cap={self.tis_cap}), got {self.rollout_is_min}")
        if self.level == "sequence" and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(
                f"level=sequence (GSPO) aggregates with loss_agg=seq-mean-token-mean, as verl does; "
                f"got loss_agg={self.loss_agg} (set algo.loss_agg=seq-mean-token-mean)"
            )


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    #: AdamW learning rate (after the warm-up).
    lr: float = 1e-6
    #: AdamW's decoupled weight decay.
    weight_decay: float = 0.0
    #: AdamW's (beta1, beta2).
    betas: tuple[float, float] = (0.9, 0.999)
    #: AdamW's epsilon.
    eps: float = 1e-8
    #: Linear warm-up from 0 over this many optimizer steps (verl's and transformers' ramp: the first
    #: step runs at LR 0), then ``lr_scheduler``.
    warmup_steps: int = 0
    #: Gradient-norm clipping; null disables.
    max_grad_norm: Optional[float] = 1.0
    #: After the warm-up: ``constant`` (verl's default), ``linear`` decay to ``min_lr_ratio * lr`` (TRL's
    #: default, to 0), ``cosine`` half-wave to ``min_lr_ratio * lr`` (verl's cosine). Over the run's
    #: optimizer steps: total_steps x ppo_epochs x mini-batches per step (unirl/trainer/optim.py). Steps count
    #: optimizer steps, as TRL's; verl steps its schedule once per training step, so its
    #: ``lr_warmup_steps`` is ``warmup_steps`` / (optimizer steps per training step) here.
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    #: Warm-up as a fraction of the run's optimizer steps (verl's ``lr_warmup_steps_ratio``, TRL's
    #: ``warmup_ratio``), rounded down as verl does; use it or ``warmup_steps``, not both.
    warmup_ratio: float = 0.0
    #: The LR that ``linear`` and ``cosine`` end at, as a fraction of ``lr`` (verl's ``min_lr_ratio``).
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        check_range(self, "lr", low=0, low_open=True)
        check_range(self, "warmup_steps", low=0)
        # max_grad_norm < 0 reverses the gradient, 0 zeroes it: neither trains.
        check_range(self, "max_grad_norm", low=0, low_open=True, optional=True)
        check_range(self, "weight_decay", low=0)
        check_range(self, "eps", low=0, low_open=True)
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"betas[{i}] must be >= 0 and < 1, got {beta!r}")
        self._check_schedule()

    def _check_schedule(self) -> None:
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_ratio > 0 and self.warmup_steps > 0:
            raise ValueError("optim.warmup_steps and optim.warmup_ratio are both set; keep one")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class RewardConfig:
    """One reward: a registered name, ``path/file.py:function`` or ``package.module:function``."""

    #: A bare string is a reward's name: ``rewards: [gsm8k, my_rewards.py:fn]`` (``unirl.config.SHORTHAND``).
    config_shorthand = "name"

    #: A registered name (``unirl rewards list``), ``path/file.py:function``, ``package.module:function``
    #: or ``http://host:port`` (``unirl serve-reward``).
    name: str = field(default="gsm8k", metadata=FILE_SPEC)
    #: Multiplies this reward in the run's total.
    weight: float = 1.0
    #: Settings for the reward: its keyword parameters (a class reward's constructor's); unknown ones are an error.
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: Seconds one call of this reward may take before the run stops with an error naming it (a hung
    #: reward otherwise hangs the run); null: no limit. An ``http://`` reward's client has its own
    #: ``kwargs.timeout`` per attempt.
    timeout_s: Optional[float] = None

    def __post_init__(self):
        if not math.isfinite(self.weight):
            raise ValueError(f"weight must be a finite number, got {self.weight!r}")
        check_range(self, "timeout_s", low=0, low_open=True, optional=True)


@dataclass
class FSDPConfig:
    """Memory settings of ``trainer.strategy: fsdp2``."""

    #: ``params``: each process's parameter shards, their gradients and the AdamW state live in host
    #: memory (torch's ``CPUOffloadPolicy``): each block's shards are copied to the device for its
    #: forward and backward, and the optimizer steps on the host. Saves all of that device memory for
    #: a host-to-device copy of the model per forward and backward and a CPU AdamW step. ``none``:
    #: everything on the device. On a CPU run both are the same (everything is in host memory
    #: already). There is no optimizer-only setting: FSDP2 keeps the optimizer state beside the
    #: parameter shards it updates.
    offload: Literal["none", "params"] = "none"


@dataclass
class TrainerConfig:
    """The loop: how many samples per step and how they are cut for the update."""

    #: Training steps (each: rollout, score, advantages, update).
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
    #: Seed of the run: weights' initial RNG, prompt order, sampling.
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
    #: How the processes hold the trained models. ``ddp``: every process a whole copy, gradients
    #: averaged (one process: the model as it is). ``fsdp2``: PyTorch's ``fully_shard`` applied by unirl
    #: to each transformer block and then the root of the policy, the reference and the critic, so each
    #: process holds 1/N of the parameters, gradients and optimizer state (the same code on CPU/gloo and
    #: GPU/NCCL; with ``mixed_precision: bf16`` on a GPU, bf16 parameters and float32 gradient reduction).
    #: Checkpoints are then written as each process's shards and resume on any number of processes
    #: (docs/scaling.md). A registered training backend (``unirl.trainer.backends``; one you register counts).
    strategy: str = "ddp"
    #: FSDP2's memory settings (read with ``strategy: fsdp2``).
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    #: Extra trackers besides metrics.jsonl: wandb, tensorboard. They write under the run directory
    #: (wandb offline with ``WANDB_MODE=offline``) and get the same keys as metrics.jsonl, plus the
    #: evaluation's images (diffusion grids) and answers (text, as a table).
    log_with: list[str] = field(default_factory=list)
    #: The trackers' project name (wandb, tensorboard).
    project: str = "unirl"
    #: Show a progress bar.
    progress: bool = True
    #: Samples of each step written to ``RUN/samples.jsonl`` and the trackers while the run trains (one per
    #: prompt, the first prompts; TRL's ``log_completions``, which is off by default there: a first run
    #: should show what its policy writes before it ends); 0: none (unirl/trainer/completions.py).
    log_completions: int = 2
    #: Print those samples above the progress bar every N steps (0: never; TRL prints at each logging step,
    #: its ``logging_steps``, 10 in ``GRPOConfig``).
    log_completions_every: int = 10
    #: Threads scoring finished chunks of samples while the next chunk is sampled (0: score inline).
    #: The rewards are identical either way.
    reward_workers: int = 0
    #: The actor trains from step N on (verl's ``trainer.critic_warmup``, counted as verl's code counts:
    #: steps are numbered from 1 and the actor trains when ``critic_warmup <= step``), so the first N-1
    #: steps update only the critic and the actor's first advantages come from a value model that has
    #: seen some returns. 0 and 1 both mean no warm-up; a verl config's value holds the actor back as long.
    critic_warmup: int = 0
    #: Stop the run when a loss (``loss/*``, ``critic/vf_loss``), the critic's values or the advantages are
    #: NaN or inf this many steps in a row (0: never stop). 3, because one such step can pass (its optimizer
    #: step is skipped when the gradient norm is not finite, as after an fp16 overflow or one NaN reward),
    #: while three in a row mean the weights or the critic are broken and every further step is wasted. A
    #: non-finite step is never checkpointed, so the last good checkpoint stays.
    max_nonfinite_steps: int = 3

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
        check_range(self, "log_completions", low=0)
        check_range(self, "log_completions_every", low=0)
        if self.critic_warmup < 0:
            raise ValueError(f"critic_warmup must be >= 0, got {self.critic_warmup}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 or null, got {self.keep_checkpoints}")
        for name in ("eval_every", "save_every", "max_nonfinite_steps"):
            check_range(self, name, low=0)
        check_range(self, "seed", low=0, high=2**32 - 1)  # numpy's seeds
        for tracker in self.log_with:
            if tracker not in TRACKERS:
                raise ValueError(f"log_with: unknown tracker {tracker!r}; choose from {', '.join(TRACKERS)}")
            module, package = TRACKERS[tracker]
            if importlib.util.find_spec(module) is None:
                raise ValueError(f"log_with: {tracker} is not installed; run `pip install {package}` (or drop it from log_with)")


@dataclass
class RunConfig:
    """The blocks every environment's config shares: the rewards, the algorithm, the optimizer, the loop,
    where batches come from and where the run goes. ``TextConfig`` and ``DiffusionConfig`` add their own."""

    #: The rewards, summed with their weights (``algo.reward_aggregation``); see docs/rewards.md.
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig()])
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    source: SourceConfig = field(default_factory=SourceConfig)
    #: Where the run directory goes (``--output-dir`` overrides).
    output_dir: str = "runs/run"

    def __post_init__(self):
        if not self.rewards:
            raise ValueError("rewards: at least one reward is needed")
        check_groups(self.algo, self.trainer)
        check_loss_args(self.algo, self.mode_policy_loss())
        if self.source.max_staleness > self.trainer.total_steps:
            # A batch k steps stale is sampled k steps ahead: more than the run's steps samples batches no step
            # takes (and a checkpoint holds every one of them), so a larger k is a typo, not a setting.
            raise ValueError(f"source.max_staleness={self.source.max_staleness} is more than trainer.total_steps="
                             f"{self.trainer.total_steps}: a batch can be at most the run's steps stale; use "
                             f"0..{self.trainer.total_steps} (1 is verl's one-step-off)")

    def mode_policy_loss(self) -> str | None:
        """The registered policy loss the environment's rollout mode trains with when ``algo.policy_loss`` is
        null (DiffusionNFT: ``nft``); None: the ratio loss of ``algo``."""
        return None

    def trainer_blocks(self) -> dict:
        """The environment's blocks the trainer takes (text: ``critic``, ``distill``): ``Trainer.from_config``."""
        return {}

    def policy_loss_name(self) -> str:
        """The run's policy loss (``check_loss_args``)."""
        return check_loss_args(self.algo, self.mode_policy_loss())
