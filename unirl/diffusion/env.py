"""The diffusion environment for flow-matching diffusers models (SD3, FLUX.1, ...), LoRA or full fine-tuning:
what FlowGRPO and DiffusionNFT share, with the algorithm's rollout mode behind one seam.

The algorithm (``algorithm:``) is a registered rollout mode (``rollout_mode.py``, ``ROLLOUT_MODES``):
FlowGRPO's SDE rollouts with per-step log-probs for the ratio loss (``flowgrpo.py``, the default),
DiffusionNFT's ODE rollouts of the old policy for the registered ``nft`` loss (``nft.py``), or one of
the faster methods on those two data paths (``awm.py``, ``dgpo.py``, ``tempflow.py``). The mode
samples and re-scores; this file adds what both use to the pure pieces (``sde.py``, ``sampling.py``)
and the model family's adapter (``families/``: prompt encoding, latent layout, sigma schedule,
transformer forward, decoding):

* the sampler's log-probs are the policy's own (the trainer samples), so
  ``recompute_old_logprobs`` is False (the mode's) and ``rollout.old_logp`` is the PPO "old" log-prob;
* the reference is the same transformer with its LoRA adapter disabled (or a frozen copy);
* an EMA of the trainable weights is swapped in for evaluation and saving (FlowGRPO does the same);
* chunks of samples are scored in the reward pool while the next chunk samples (the last chunk, with
  nothing left to overlap, when ``score`` is called); ``rollout/transformer_calls`` logs the
  transformer rows a rollout ran.

Differences from FlowGRPO's reference code: the EMA is updated once per optimizer step (FlowGRPO
calls its ``ema.step`` after every micro-batch with the optimizer-step count, so with gradient
accumulation it repeats the same update several times at each qualifying step); the negative prompt
(the family's ``negative_prompt``, the empty string for SD3) is encoded once; and the SDE window
(``unirl/diffusion/window.py``) is a function of the run's seed and the training step.

Shapes: B prompts, G group size, N = B*G, T trained steps, latents ``[*latent]`` in the family's
layout (SD3 ``[C, h, w]``, FLUX packed ``[h/2 * w/2, 4C]``).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.ema import ParamEMA
from unirl.diffusion.families import family_for
from unirl.diffusion.frames import FrameRewards
from unirl.diffusion.pipeline import load_pipeline
from unirl.diffusion.prompt_cache import PromptCache
from unirl.diffusion.prompts import load_prompt_rows
from unirl.diffusion.modes import shipped_modes
from unirl.diffusion.sampling import ForwardCounter
from unirl.diffusion.batches import DiffusionSampler
from unirl.env import Environment, Models, lora_or_frozen_reference, sharded_state_dict
from unirl.prompts import Prompts
from unirl.reward_set import RewardSet


class StepPrompts(Prompts):
    """``Prompts`` that tell the environment which step they were drawn for (``env.step``: the rollout modes
    seed their noise and place their SDE window by it)."""

    def __init__(self, env, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.env = env

    def next(self, step: int) -> list[dict]:
        self.env.step = step
        return super().next(step)


class DiffusionEnvironment(Environment):
    def __init__(self, cfg: DiffusionConfig):
        self.cfg = cfg
        self._model = None
        self.ref = None
        self.ema = None
        self.step = 0  # the training step of the last prompts drawn
        size = cfg.sampling.prompt_cache_size  # the text encoders' outputs kept across steps (0: off)
        self.prompt_cache = PromptCache(size) if size else None
        # The algorithm's rollout and forward: the registered mode of ``algorithm:`` (rollout_mode.py); the
        # forward of stored samples is the mode's.
        self.mode = self.actions = shipped_modes().get(cfg.algorithm)(self)
        self.sampler = self.scorer = DiffusionSampler(self)  # samples, their rewards queued, then collected

    # ------------------------------------------------------------------ setup
    def setup(self, accelerator) -> None:
        cfg, s = self.cfg, self.cfg.sampling
        self.accelerator = accelerator
        device = accelerator.device
        # 1. Pipeline components of the model family; only the transformer trains.
        self.family = family_for(cfg)
        pipe, self.model_path = load_pipeline(cfg.model.name_or_path, self.family, cfg.model.dtype, device)
        self.pipe, self.vae, self.scheduler = pipe, pipe.vae, pipe.scheduler
        self.latent_shape = self.family.latent_shape(pipe, s.resolution)
        # 2. The policy: LoRA on the attention projections (reference = adapter disabled) or the whole
        #    transformer (reference = a frozen copy, only when the KL is used).
        transformer = pipe.transformer.requires_grad_(False).to(device)
        if cfg.model.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        if cfg.model.lora.enabled:
            from peft import LoraConfig, get_peft_model

            lora = cfg.model.lora
            transformer = get_peft_model(transformer, LoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, init_lora_weights="gaussian",
                target_modules=lora.target_modules))
        else:
            if cfg.algo.kl_coef > 0 or cfg.algo.use_kl_in_reward:
                self.ref = copy.deepcopy(transformer).eval()
            transformer.requires_grad_(True)
        self._model = transformer
        self.forwards = ForwardCounter(pipe.transformer)  # the rows each rollout runs (rollout/transformer_calls)
        if cfg.ema.enabled:
            self.ema = ParamEMA([p for p in transformer.parameters() if p.requires_grad], cfg.ema.decay,
                                cfg.ema.update_every)
        # 3. The family's negative prompt, encoded once; the sigma schedules.
        with torch.no_grad():
            negative = self.family.encode(pipe, [self.family.negative_prompt], max_sequence_length=s.max_sequence_length, device=device)
        self.negative = {"neg_" + k: v for k, v in negative.items()}  # each [1, ...]
        self.train_sigmas, self.train_timesteps = self.family.schedule(self.scheduler, s.num_steps, self.latent_shape)
        self.eval_sigmas, self.eval_timesteps = self.family.schedule(self.scheduler, s.eval_num_steps, self.latent_shape)
        # 4. Data and rewards.
        image = self.family.conditioning_image
        self.train_rows = load_prompt_rows(cfg.data.train, "train", image)
        self.test_rows = load_prompt_rows(cfg.data.test, "test", image) if cfg.data.test else []
        if cfg.data.eval_size is not None:
            self.test_rows = self.test_rows[: cfg.data.eval_size]
        self.prompts = StepPrompts(self, self.train_rows, cfg.trainer.prompts_per_step, seed=cfg.trainer.seed,
                                   shuffle=cfg.data.shuffle, rank=accelerator.process_index,
                                   world_size=accelerator.num_processes, test_rows=self.test_rows)
        self.rewards = RewardSet(cfg.rewards, aggregation=cfg.algo.reward_aggregation, workers=cfg.trainer.reward_workers,
                                 eps=cfg.algo.adv_eps)
        if self.family.frames:  # videos: each reward scores their frames (``frames.FrameRewards``)
            self.rewards = FrameRewards(self.rewards, stride=cfg.video.frame_stride, reduce=cfg.video.frame_reduce)
        # Rewards not optimised, scored on the held-out images at each evaluation (``offtarget.py``).
        off = cfg.offtarget
        self.offtarget_rewards = None
        if off.enabled and off.rewards:
            self.offtarget_rewards = RewardSet(off.rewards, aggregation=cfg.algo.reward_aggregation, workers=0)
            if self.family.frames:
                self.offtarget_rewards = FrameRewards(self.offtarget_rewards, stride=cfg.video.frame_stride,
                                                      reduce=cfg.video.frame_reduce)
        # 5. What the algorithm's rollout mode adds (FlowGRPO: the schedule's step constants; NFT: the old policy).
        self.mode.setup()
        # After the mode's setup: NFT's and DGPO's frozen reference copy (full fine-tuning) is made there, and the
        # backend lays out every frozen copy it is given here.
        self.models = Models(reference=self._reference, frozen={"reference": self.ref} if self.ref is not None else {})

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, module):
        self._model = module

    @property
    def train_guidance(self) -> float:
        """Guidance of the rollouts and the training forward (1 unless ``sampling.train_cfg``)."""
        return self.cfg.sampling.guidance_scale if self.cfg.sampling.train_cfg else 1.0

    def cond(self, cond: dict[str, torch.Tensor], guidance: float) -> dict[str, torch.Tensor]:
        """The family's conditioning ``{key: [n, ...]}``, plus the negative prompt's ``neg_<key>`` for CFG."""
        if guidance > 1:
            n = next(iter(cond.values())).shape[0]
            cond = {**cond, **{k: v.expand(n, *v.shape[1:]) for k, v in self.negative.items()}}  # [n, ...]
        return cond

    def encode(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """The family's conditioning of ``rows`` ``{key: [len(rows), ...]}``: their prompts' and, for a family
        with a conditioning image, their images' (``row["image"]``, a path checked at loading); from the prompt
        cache when ``sampling.prompt_cache_size`` is set (``unirl/diffusion/prompt_cache.py``)."""
        if self.prompt_cache is not None:
            return self.prompt_cache.encode(rows, self._encode)
        return self._encode(rows)

    def _encode(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        s, device = self.cfg.sampling, self.accelerator.device
        cond = self.family.encode(self.pipe, [row["prompt"] for row in rows], max_sequence_length=s.max_sequence_length,
                                  device=device)
        if self.family.conditioning_image:
            cond.update(self.family.encode_images(self.pipe, [row["image"] for row in rows], resolution=s.resolution,
                                                  device=device))
        return cond

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        if self.ema is not None:
            self.ema.step(optimizer_steps)
        self.mode.after_optimizer_step(optimizer_steps)

    def _reference(self):
        return lora_or_frozen_reference(self.accelerator, self._model, self.ref, self.cfg.model.lora.enabled)

    # ------------------------------------------------------------ evaluation
    @contextlib.contextmanager
    def ema_weights(self):
        if self.ema is None:
            yield
            return
        with self.ema.swapped():
            yield

    def sample_deterministic(self, rows: list[dict], positions: list[int] | None = None) -> list:
        """Images from the ODE sampler with fixed seeds (``unirl.diffusion.held_out.sample_deterministic``)."""
        from unirl.diffusion.held_out import sample_deterministic

        return sample_deterministic(self, rows, positions)

    def evaluation(self, step: int, run_dir: Path) -> tuple[dict[str, float], dict]:
        """Held-out evaluation: the ODE's images of the test prompts with the EMA weights, scored and drawn
        on a grid (``unirl.diffusion.held_out``)."""
        from unirl.diffusion.held_out import held_out_evaluation

        return held_out_evaluation(self, step, run_dir)

    # ----------------------------------------------------------- checkpoints
    def save_pretrained(self, directory: Path) -> None:
        """LoRA: diffusers' format (the family's stock pipeline, ``StableDiffusion3Pipeline`` or
        ``FluxPipeline``, loads it with ``load_lora_weights(directory)``);
        full fine-tuning: the transformer's ``save_pretrained`` in ``directory/transformer``. EMA weights
        when the EMA is on. Called on every process: the full state dict is gathered from all of them
        (FSDP shards it); the main process writes."""
        acc = self.accelerator
        directory = Path(directory)
        model = acc.unwrap_model(self._model)
        with self.ema_weights():  # written while the EMA weights are swapped in
            full = sharded_state_dict(acc, self._model)  # collective under FSDP, None otherwise
            if not acc.is_main_process:
                return
            directory.mkdir(parents=True, exist_ok=True)
            if self.cfg.model.lora.enabled:
                from peft.utils import get_peft_model_state_dict

                prefix = "base_model.model."
                state = {k.removeprefix(prefix): v.detach().cpu().contiguous()
                         for k, v in get_peft_model_state_dict(model, state_dict=full).items()}
                self.family.pipeline_class().save_lora_weights(
                    directory, transformer_lora_layers=state,
                    transformer_lora_adapter_metadata=model.peft_config["default"].to_dict())
            else:
                model.save_pretrained(directory / "transformer", state_dict=full)

    def checkpoint_objects(self) -> dict:
        return {**({"ema": self.ema} if self.ema is not None else {}), **self.mode.checkpoint_objects()}

    def close(self) -> None:
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if getattr(self, "offtarget_rewards", None) is not None:
            self.offtarget_rewards.close()

