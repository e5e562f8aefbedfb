"""Config of a FlowGRPO run on a flow-matching diffusers model of any registered family (``unirl train diffusion --config NAME``).

The shared ``algo``, ``optim``, ``trainer``, ``rewards`` and ``output_dir`` fields are the text
environment's (``unirl/config/schema.py``); everything diffusion-specific lives in ``model``, ``sampling``,
``ema`` and ``data``. FlowGRPO: https://arxiv.org/abs/2505.05470 (reference code
https://github.com/yifan123/flow_grpo, ``config/grpo.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from unirl.config import PATH
from unirl.config.schema import RewardConfig, RunConfig, check_range
from unirl.trainer.backends import check_backend

#: FlowGRPO's LoRA targets for SD3: the joint attention's image-stream and text-stream projections.
#: The same names match FLUX.1's double-stream blocks and the q/k/v of its single-stream blocks.
SD3_LORA_TARGETS = [
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
]


@dataclass
class LoraConfig:
    """A LoRA adapter on the transformer (peft, saved in diffusers' format)."""

    #: False: full fine-tuning of the transformer (the reference is then a frozen copy).
    enabled: bool = True
    #: LoRA rank.
    r: int = 32
    #: LoRA scale numerator (the update is scaled by alpha / r).
    alpha: int = 64
    #: Dropout on the LoRA branch's input.
    dropout: float = 0.0
    #: Names of the transformer's linear layers that get an adapter.
    target_modules: list[str] = field(default_factory=lambda: list(SD3_LORA_TARGETS))

    def __post_init__(self):
        check_range(self, "r", low=1)
        check_range(self, "alpha", low=0, low_open=True)
        check_range(self, "dropout", low=0, high=1, high_open=True)


@dataclass
class ModelConfig:
    """The pipeline: its family, checkpoint, dtype and what is trained."""

    #: The model family: a name registered in ``unirl.diffusion.families`` (``sd3``: Stable Diffusion 3 /
    #: 3.5; ``flux``: FLUX.1; ``unirl train diffusion --dry-run`` with a wrong one lists them). A config
    #: field rather than a guess from the checkpoint, so that ``--dry-run`` shows it and the sampling
    #: checks can read the family's capabilities; loading a checkpoint of another family fails with both names.
    family: str = "sd3"
    #: A diffusers pipeline directory or hub name (``stabilityai/stable-diffusion-3.5-medium``,
    #: ``black-forest-labs/FLUX.1-dev``), or a toy pipeline of ``family`` built locally from a fixed seed
    #: (``unirl/diffusion/tiny/<family>.py``): ``tiny`` (random weights) or ``tiny-colour`` (text
    #: encoders warm-started to name colours, for the prompt-dependent demo).
    name_or_path: str = "tiny"
    #: dtype of the frozen components and the transformer's base weights; LoRA weights stay float32.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig = field(default_factory=LoraConfig)
    #: Recompute the transformer's activations in the backward pass (less memory, more compute).
    gradient_checkpointing: bool = False

    def __post_init__(self):
        from unirl.diffusion.families import FAMILIES

        if self.family not in FAMILIES:
            raise ValueError(FAMILIES.unknown_message(self.family))


@dataclass
class SdeWindowConfig:
    """The SDE window: only ``size`` consecutive steps are stochastic (and trained); the others are
    deterministic ODE steps. Where it lies at each training step is ``schedule``'s rule
    (``unirl/diffusion/window.py``): ``random``, Flow-GRPO-Fast (FlowGRPO's ``sde_window_size`` /
    ``sde_window_range``), or ``progressive``, MixGRPO's sliding window (https://arxiv.org/abs/2507.21802)."""

    #: Number of stochastic steps; 0 makes every step stochastic (plain FlowGRPO).
    size: int = 0
    #: ``[lo, hi)`` step indices the window must lie in; null: all steps. (MixGRPO's ``max_timesteps``
    #: is ``hi = num_steps - 2``: its last step is never trained.)
    range: Optional[tuple[int, int]] = None
    #: ``random``: the start is drawn uniformly per training step from the run's seed and the step so
    #: that ``[start, start + size)`` lies in ``range`` (FlowGRPO-Fast; MixGRPO's ``random`` strategy).
    #: ``progressive``: MixGRPO's sliding window: it starts at ``lo``, moves by ``stride`` steps every
    #: ``shift_interval`` training steps, is cut at ``hi`` near the end (``[start, min(start + size, hi))``)
    #: and rolls back to ``lo`` after its last position (MixGRPO's ``--roll_back``).
    schedule: Literal["random", "progressive"] = "random"
    #: ``progressive``: training steps the window stays at one position (MixGRPO's ``iters_per_group``,
    #: the paper's shift interval; its MixGRPO script uses 25, the MixGRPO-Flash one 20).
    shift_interval: int = 25
    #: ``progressive``: steps the window moves at each shift (MixGRPO's ``prog_overlap_step``: its scripts
    #: pass ``--prog_overlap`` with 1; without that flag it moves by the window size; 0 keeps it in place,
    #: as its MixGRPO-Flash* script does).
    stride: int = 1

    def __post_init__(self):
        check_range(self, "shift_interval", low=1)
        check_range(self, "stride", low=0)


@dataclass
class SamplingConfig:
    """Sampling the images: resolution, steps, guidance and the SDE that makes them stochastic."""

    #: Image height and width in pixels (a multiple of the VAE scale factor times the patch size).
    resolution: int = 512
    #: Denoising steps of a training rollout.
    num_steps: int = 10
    #: Denoising steps of the deterministic evaluation sampler (FlowGRPO: 40).
    eval_num_steps: int = 40
    #: Classifier-free guidance scale (1 disables guidance), with the model family's negative prompt (the
    #: empty prompt for SD3).
    #: Guidance-distilled families (FLUX.1) take no CFG here: it must be 1 for them.
    guidance_scale: float = 4.5
    #: The embedded guidance of guidance-distilled families (FLUX.1-dev: the pipeline's ``guidance_scale``,
    #: 3.5 by default), fed to the transformer's guidance embedding at sampling, training and evaluation;
    #: ignored by other families and by checkpoints without ``guidance_embeds``.
    distilled_guidance: float = 3.5
    #: Use guidance in the rollouts and in the training forward (FlowGRPO's ``train.cfg``). False: the
    #: policy is the conditional model alone (rollouts unguided, one forward per step, half the cost);
    #: evaluation still uses ``guidance_scale``. With guidance the gradient flows through both branches,
    #: as in the newest FlowGRPO (its July 2025 ``train_sd3.py`` detached the unconditional one).
    train_cfg: bool = True
    #: FlowGRPO's ``a`` in the SDE's ``sigma_t = a sqrt(t / (1 - t))`` (flow) or the CPS angle fraction.
    noise_level: float = 0.7
    #: The stochastic sampler: ``flow`` (FlowGRPO's SDE) or ``cps`` (coefficients-preserving sampling).
    sde_type: Literal["flow", "cps"] = "flow"
    sde_window: SdeWindowConfig = field(default_factory=SdeWindowConfig)
    #: Flow-GRPO-Fast branching, FlowGRPO's ``train_sd3_fast`` behaviour: when the SDE window starts at
    #: step k > 0, the k deterministic steps before it run once per prompt (B transformer rows a step
    #: instead of B*G) and the group's G members branch from that latent, each drawing its own SDE noise
    #: from the window on. The members of a group must then share their initial noise
    #: (``same_noise_per_group: true``), and with it the images are those of the unbranched sampler.
    branch_prefix: bool = False
    #: The solver of the deterministic steps after the SDE window in training rollouts: ``euler`` (the
    #: scheduler's Euler step) or ``dpm2m``, DPM-Solver++(2M) (https://arxiv.org/abs/2211.01095) as
    #: MixGRPO-Flash takes those steps (``dpm_algorithm_type=dpmsolver++``, ``dpm_solver_order=2``,
    #: ``dpm_solver_type=midpoint``, ``dpm_apply_strategy=post``; diffusers' ``DPMSolverMultistepScheduler``
    #: with flow sigmas, first order at the last step). The steps before and in the window stay Euler and
    #: FlowGRPO SDE steps; evaluation samples with Euler whatever this says.
    ode_solver: Literal["euler", "dpm2m"] = "euler"
    #: Fraction of the deterministic steps after the SDE window that a rollout takes, in fewer and longer
    #: DPM-Solver++(2M) steps (``ode_solver: dpm2m``): MixGRPO-Flash's ``dpm_post_compress_ratio`` (0.4 in
    #: its MixGRPO-Flash script, 0.2 in Flash*), counted as it counts them (``unirl/diffusion/window.py``,
    #: ``kept_steps``). 1: every step. Fewer transformer calls a rollout; the trained steps are unchanged.
    tail_step_ratio: float = 1.0
    #: Fraction of the stochastic steps trained per sample, ``T = int(K * fraction)`` of K (FlowGRPO's
    #: ``timestep_fraction``; at least one step is trained).
    timestep_fraction: float = 1.0
    #: Which T steps: ``first`` = the first T stochastic steps in sampling order, as FlowGRPO trains
    #: them (0.99 of 10 leaves out the last, sharpest step, whose std is about 0.006); ``random`` = a
    #: random subset per sample (unirl's earlier choice, which trains that step about 90% of the time).
    timestep_selection: Literal["first", "random"] = "first"
    #: The B*G samples of a step start from the same initial noise within a group (FlowGRPO's ``same_latent``).
    same_noise_per_group: bool = False
    #: Samples per transformer batch when sampling; finished chunks are scored while the next one samples.
    chunk_size: int = 16
    #: T5 tokens per prompt, padded or truncated to it (SD3's pipeline default is 256, FLUX's 512;
    #: FlowGRPO's train_sd3.py uses 128). Each token joins the transformer's joint attention in every
    #: block, so keep it as short as the prompts allow (the toy configs use 16).
    max_sequence_length: int = 128
    #: Frames per sample; more than 1 only for a family whose samples are videos.
    num_frames: int = 1
    #: Prompts whose text-encoder outputs are kept across steps (``unirl/diffusion/prompt_cache.py``; each
    #: prompt encoded alone, then reused bit for bit). 0 (unirl's default, the references encode every batch):
    #: each step encodes its rows in one batch, as before, so existing runs keep their numbers (the two
    #: differ in the last float bits on a CPU). Frozen encoders only: the cache never goes stale.
    prompt_cache_size: int = 0
    #: The KL in the reward (``algo.use_kl_in_reward``) reads the old policy's step means from the sampler, which
    #: keeps them as it samples (one more latent a trained step), instead of re-scoring the rollout with the
    #: policy before the advantages: the same weights and forward, so the same numbers (bit for bit when a
    #: sampling chunk is a micro-batch; tested), one transformer pass a trained step fewer. False (unirl's
    #: default; verl's recomputes): as before. SDE modes only (FlowGRPO, Fast, MixGRPO, TempFlow).
    sampler_old_means: bool = False

    def __post_init__(self):
        if self.num_steps < 1 or self.eval_num_steps < 1:
            raise ValueError("num_steps and eval_num_steps must be >= 1")
        if self.guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (1 disables guidance), got {self.guidance_scale}")
        if self.noise_level <= 0:
            raise ValueError(f"noise_level must be > 0 (0 has no density to train), got {self.noise_level}")
        if self.sde_type == "cps" and self.noise_level > 1:
            raise ValueError(f"noise_level must lie in (0, 1] for sde_type='cps', got {self.noise_level}")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must lie in (0, 1], got {self.timestep_fraction}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        for name in ("resolution", "max_sequence_length"):
            check_range(self, name, low=1)
        check_range(self, "distilled_guidance", low=0)
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        check_range(self, "prompt_cache_size", low=0)
        w = self.sde_window
        lo, hi = w.range if w.range is not None else (0, self.num_steps)
        if w.size < 0:
            raise ValueError(f"sde_window.size must be >= 0, got {w.size}")
        if w.size and not (0 <= lo and lo + w.size <= hi <= self.num_steps):
            raise ValueError(
                f"sde_window: a window of {w.size} steps must fit in range [{lo}, {hi}) within num_steps={self.num_steps}"
            )
        if self.branch_prefix and not self.same_noise_per_group:
            raise ValueError("sampling.branch_prefix=true: the group's members branch from one latent per prompt, so "
                             "they share its initial noise; set sampling.same_noise_per_group: true")
        if not 0 < self.tail_step_ratio <= 1:
            raise ValueError(f"sampling.tail_step_ratio must lie in (0, 1], got {self.tail_step_ratio}")
        if self.tail_step_ratio < 1 and self.ode_solver != "dpm2m":
            raise ValueError(f"sampling.tail_step_ratio={self.tail_step_ratio} takes the steps after the window in "
                             f"fewer, longer steps, which needs the higher-order solver: set sampling.ode_solver: dpm2m")
        if self.ode_solver != "euler" and not w.size:
            raise ValueError(f"sampling.ode_solver={self.ode_solver!r} takes the deterministic steps after the SDE "
                             f"window, and without one (sde_window.size: 0) every step is an SDE step; set "
                             f"sampling.sde_window.size")


@dataclass
class EmaConfig:
    """An exponential moving average of the trainable weights, used for evaluation and saving,
    on FlowGRPO's schedule (``EMAModuleWrapper``): after optimizer step k (k = 1, 2, ... counted over
    the whole run) the EMA is updated when ``(k + 1) % update_every == 0``, with decay
    ``min((1 + k) / (10 + k), decay)``."""

    #: Keep the EMA (evaluation and checkpoints use it).
    enabled: bool = True
    #: The ceiling of the decay schedule above.
    decay: float = 0.9
    #: Update every N optimizer steps (FlowGRPO's ``update_step_interval``; its SD3 script uses 8).
    update_every: int = 1

    def __post_init__(self):
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must lie in [0, 1), got {self.decay}")
        if self.update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {self.update_every}")


@dataclass
class VideoConfig:
    """How videos (a family with ``frames``: Wan 2.1) are scored and shown; image families ignore it.

    Each reward sees a video as its frames: it is called on every ``frame_stride``-th frame as on
    images (each frame with its video's prompt and columns), and the video's score is ``frame_reduce``
    of its frames' scores (docs/rewards.md, "Videos")."""

    #: Score every k-th frame, starting with the first (FlowGRPO's video OCR reward reads every 4th).
    frame_stride: int = 1
    #: The video's score from its frames' scores: ``mean``, ``min`` (every frame must be good) or ``max``.
    frame_reduce: Literal["mean", "min", "max"] = "mean"
    #: Frames per second of the evaluation's animated grid (``eval/step_N.gif``); FlowGRPO logs its videos at 8.
    fps: int = 8

    def __post_init__(self):
        check_range(self, "frame_stride", low=1)
        check_range(self, "fps", low=1)


@dataclass
class OffTargetConfig:
    """Figures the run does not optimise, logged under ``offtarget/`` so that reward hacking shows
    (``unirl/diffusion/offtarget.py``; ``unirl plot`` draws them): image statistics of the training rollouts
    (brightness, dark and blown-out pixel shares, within-prompt diversity) and, at each evaluation, the
    held-out reward, the ``rewards`` below and the held-out images' statistics."""

    #: Log them (the cost is measured in docs/diffusion.md: well under 1% of a tiny step).
    enabled: bool = True
    #: The training rollouts' image statistics every this many training steps; 0: only at evaluations.
    every: int = 1
    #: Registered rewards the run does not optimise, scored on the held-out images at each evaluation
    #: (``offtarget/eval/reward/<name>``): a second opinion of the images, e.g. ``aesthetic`` beside ``ocr``.
    rewards: list[RewardConfig] = field(default_factory=list)
    #: The diversity figures compare images area-averaged to at most this many pixels a side.
    diversity_size: int = 32

    def __post_init__(self):
        check_range(self, "every", low=0)
        check_range(self, "diversity_size", low=1)


@dataclass
class NftConfig:
    """DiffusionNFT's old policy (``algorithm: nft``; https://arxiv.org/abs/2509.16117, code
    github.com/NVlabs/DiffusionNFT). Its loss's settings (beta, adv_clip, kl_coef) are the registered
    ``nft`` loss's, set in ``algo.loss_args`` (``unirl.core.policy_losses.NftArgs``). Defaults are
    NVlabs' ``config/nft.py`` (``_get_config``, its SD3.5-M base) and ``config/base.py``."""

    config_moved = {"beta": "algo.loss_args.beta", "adv_clip": "algo.loss_args.adv_clip",
                    "kl_coef": "algo.loss_args.kl_coef"}

    #: The old policy (rollouts and ``v_old``) follows the trained weights once per training step,
    #: ``old <- d old + (1 - d) new`` with ``d = min(old_decay_rate * (k - old_decay_flat), old_decay_max)``
    #: after k optimizer steps, and d = 0 (a copy) while ``k < old_decay_flat`` (``return_decay``; its
    #: ``decay_type: 1``, the default: flat 0, rate 0.001, max 0.5; ``decay_type: 2`` for OCR: 75, 0.0075, 0.999).
    old_decay_flat: int = 0
    #: The decay's rise per optimizer step after ``old_decay_flat`` (``uprate``; ``decay_type: 1``: 0.001).
    old_decay_rate: float = 0.001
    #: The decay's ceiling, below 1 (``uphold``; ``decay_type: 1``: 0.5).
    old_decay_max: float = 0.5

    def __post_init__(self):
        check_range(self, "old_decay_flat", low=0)
        check_range(self, "old_decay_rate", low=0)
        check_range(self, "old_decay_max", low=0, high=1, high_open=True)


@dataclass
class DataConfig:
    """The prompts for training and evaluation."""

    #: A ``.txt`` file with one prompt per line, a ``.jsonl`` file with a ``prompt`` field (other
    #: fields become reward columns), ``tiny`` (a small prompt list built in code), a bundled file
    #: ``unirl://NAME`` (``unirl data list``) or generated prompts (``unirl://ocr/generated?n=20000&seed=0``).
    #: A relative path not found from the working directory is looked up beside the config file.
    train: str = field(default="tiny", metadata=PATH)
    #: Held-out prompts in the same forms; null disables evaluation.
    test: Optional[str] = field(default="tiny", metadata=PATH)
    #: Held-out prompts per evaluation (the first ones; null: all).
    eval_size: Optional[int] = 16
    #: Images drawn on the evaluation grid PNG.
    grid_size: int = 16
    #: Shuffle the training prompts each epoch (seeded by ``trainer.seed``); false: file order.
    shuffle: bool = True

    def __post_init__(self):
        check_range(self, "eval_size", low=1, optional=True)
        check_range(self, "grid_size", low=0)


@dataclass
class DiffusionConfig(RunConfig):
    """``unirl train diffusion``: the run-level blocks (``RunConfig``: rewards, algo, optim, trainer, source,
    output_dir) and the diffusion environment's own."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    #: The diffusion RL algorithm: a registered rollout mode (``unirl/diffusion/rollout_mode.py``; a wrong
    #: name is answered with the registered ones): ``flowgrpo`` (FlowGRPO: SDE rollouts with per-step
    #: log-probs, the clipped ratio of ``algo`` or a guard loss, ``algo.policy_loss: grpo_guard | flow_dppo``),
    #: ``nft`` (DiffusionNFT: the old policy's ODE rollouts, clean latents only, the loss ``nft``;
    #: ``unirl/diffusion/nft.py``), ``awm`` (Advantage Weighted Matching on NFT's data path), ``dgpo``
    #: (group preference on the forward process) or ``tempflow`` (TempFlow-GRPO's per-prompt branch step
    #: and noise-aware weights). docs/diffusion.md says what each keeps and trains.
    algorithm: str = "flowgrpo"
    #: The algorithm's own settings, by the names of the dataclass its mode registered (docs/diffusion.md;
    #: defaults are its reference's). Checked where the config loads; an unknown key names the valid ones.
    mode_args: dict[str, Any] = field(default_factory=dict)
    nft: NftConfig = field(default_factory=NftConfig)
    offtarget: OffTargetConfig = field(default_factory=OffTargetConfig)
    #: KL to the reference per trained step (``unirl.diffusion.sde.step_kl``): ``flowgrpo`` is
    #: FlowGRPO's ``train_sd3.py``, ``(mean - ref_mean)^2 / (2 s^2)`` with the SDE's diffusion
    #: coefficient s (for the flow SDE without the step's sqrt(|dt|), so |dt| times the exact KL);
    #: ``exact`` is the KL of the two Gaussian steps (divides by the step variance s^2 |dt|: 3.7x to
    #: 112x stronger per step on SD3's shift-3 10-step schedule). Equal for ``sde_type: cps``.
    kl_form: Literal["flowgrpo", "exact"] = "flowgrpo"
    #: The rewards, summed with their weights (``algo.reward_aggregation``); see docs/rewards.md.
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig(name="brightness")])
    #: Where the run directory goes (``--output-dir`` overrides).
    output_dir: str = "runs/diffusion"

    def __post_init__(self):
        from unirl.diffusion.families import FAMILIES

        super().__post_init__()
        check_backend(self.trainer.strategy, self.trainer.mixed_precision)
        if self.source.max_staleness or self.source.urls:
            raise ValueError("source: diffusion samples with the policy itself (no rollout engine), so its batches "
                             "are sampled when the step asks; leave source.max_staleness at 0 and source.urls empty")
        if self.source.bypass_mode:
            raise ValueError("source.bypass_mode=true: diffusion samples with the policy itself, so there is no "
                             "rollout engine whose log-probs the ratio could be taken against; set source.bypass_mode "
                             "to false or null")
        from unirl.core.policy_losses import POLICY_LOSSES

        policy_loss = self.policy_loss_name()
        if POLICY_LOSSES.get(policy_loss).discrete:
            raise ValueError(f"algo.policy_loss={policy_loss} reads exp(logp) as a token's probability; a diffusion "
                             f"step's log-prob is a density, so it is a text loss only")
        family = FAMILIES.get(self.model.family)  # ModelConfig checked the name
        if family.guidance_mode == "distilled" and self.sampling.guidance_scale != 1:
            raise ValueError(
                f"sampling.guidance_scale={self.sampling.guidance_scale}: {family.title} is guidance-distilled and "
                f"takes no classifier-free guidance here; set sampling.guidance_scale: 1.0 and its embedded guidance "
                f"with sampling.distilled_guidance"
            )
        from unirl.diffusion.modes import resolve_algorithm

        # The algorithm, its mode_args, the run's loss and its loss_args, and that the mode feeds that loss.
        resolve_algorithm(self)
        if self.sampling.num_frames != 1 and not family.frames:
            raise ValueError(f"sampling.num_frames={self.sampling.num_frames}: {family.title} makes images, not "
                             f"videos; set sampling.num_frames: 1")

    def mode_policy_loss(self) -> str | None:
        """The registered policy loss of ``algorithm``'s rollout mode (DiffusionNFT's, AWM's, DGPO's,
        TempFlow's own; None for FlowGRPO's ratio loss); an unregistered algorithm is refused here, naming
        the registered ones."""
        from unirl.diffusion.modes import shipped_modes

        modes = shipped_modes()
        if self.algorithm not in modes:
            raise ValueError(f"algorithm: {modes.unknown_message(self.algorithm)}")
        return modes.get(self.algorithm).policy_loss
