"""The diffusion environment: FlowGRPO for flow-matching diffusers models (SD3, FLUX.1, ...), LoRA or full fine-tuning.

FlowGRPO (Liu et al., 2025, https://arxiv.org/abs/2505.05470): sample each prompt G times with an SDE
that has the ODE's marginals, so each denoising step is a Gaussian policy with a log-prob; score the
images; train each stored step with the group-relative advantage through the same clipped ratio as
text GRPO (``unirl.core``), with a closed-form Gaussian KL to the reference model.

What this file adds to the pure pieces (``sde.py``, ``sampling.py``) and the model family's adapter
(``families/``: prompt encoding, latent layout, sigma schedule, transformer forward, decoding):

* the sampler's log-probs are the policy's own (the trainer samples), so
  ``recompute_old_logprobs = False`` and ``rollout.tensors["old_logp"]`` is the PPO "old" log-prob;
* the reference is the same transformer with its LoRA adapter disabled (or a frozen copy);
* an EMA of the trainable weights is swapped in for evaluation and saving (FlowGRPO does the same);
* chunks of samples are scored in the reward pool while the next chunk samples (the last chunk, with
  nothing left to overlap, when ``score`` is called).

Differences from FlowGRPO's reference code: the EMA is updated once per optimizer step (FlowGRPO
calls its ``ema.step`` after every micro-batch with the optimizer-step count, so with gradient
accumulation it repeats the same update several times at each qualifying step); the negative prompt
(the family's ``negative_prompt``, the empty string for SD3) is encoded once; and the SDE window
(``unirl/diffusion/window.py``) is a function of the run's seed and the training step.

Faster variants, all in ``rollout``: an SDE window (Flow-GRPO-Fast, or MixGRPO's sliding window) trains
a few steps instead of all; ``branch_prefix`` runs the deterministic steps before the window once per
prompt and branches the group from there; ``ode_solver: dpm2m`` takes the steps after the window with
DPM-Solver++(2M), in fewer steps with ``tail_step_ratio`` (MixGRPO-Flash). ``rollout/transformer_calls`` logs the transformer rows a rollout ran.

Shapes: B prompts, G group size, N = B*G, T trained steps, latents ``[*latent]`` in the family's
layout (SD3 ``[C, h, w]``, FLUX packed ``[h/2 * w/2, 4C]``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import textwrap
from concurrent.futures import Future
from pathlib import Path

import torch

from unirl.diffusion.config import DiffusionConfig
from unirl.diffusion.families import family_for
from unirl.diffusion.frames import FrameRewards, write_grid
from unirl.diffusion.pipeline import load_pipeline
from unirl.diffusion.sampling import (ForwardCounter, rescore_step, rescore_steps, sample_with_logprob, schedule_coefficients,
                                     to_pil, trained_steps)
from unirl.diffusion.window import kept_steps, window_bounds, window_mask
from unirl.diffusion.sde import step_coefficients, step_kl
from unirl.env import Environment, Rollout, lora_or_frozen_reference, sharded_state_dict
from unirl.scoring import RewardSet, concat_components

def load_prompt_rows(source: str, split: str, image: bool = False) -> list[dict]:
    """Rows ``{"prompt": ..., <columns>}`` from ``tiny``, a ``.txt`` (one prompt a line), a ``.jsonl``,
    a bundled ``unirl://NAME`` file or generated ``unirl://ocr/generated?n=...`` (``unirl/data_paths.py``).

    ``image``: the family takes a conditioning image per prompt (``ModelFamily.conditioning_image``), so
    every row must be a ``.jsonl`` row naming an existing, readable image file in its ``image`` field
    (relative paths are read from the prompt file's folder); the first row without one is named."""
    rows = _prompt_rows(source, split)
    if image:
        _check_images(rows, source, split)
    return rows


def _check_images(rows: list[dict], source: str, split: str) -> None:
    from unirl.data_paths import local_path
    from unirl.image_files import check_image_file

    for i, row in enumerate(rows):
        name = row.get("image")  # only .jsonl rows have one, so only then is the source a file
        path = local_path(source).parent / name if isinstance(name, str) else None
        if path is None or not path.is_file():
            raise ValueError(f"prompt file ({split}) {source}, row {i + 1}: model.family takes a conditioning image "
                             f"per prompt, so each row needs an 'image' naming an existing file; got {name!r}")
        try:
            check_image_file(path)  # decodable, not only present: header and checksums, cheap
        except ValueError as err:
            raise ValueError(f"prompt file ({split}) {source}, row {i + 1}: {err}") from None
        row["image"] = str(path)


def _prompt_rows(source: str, split: str) -> list[dict]:
    from unirl.data_paths import DataFileNotFoundError, generated_prompts, is_generated, local_path, locate

    if source == "tiny":
        from unirl.diffusion.tiny.prompts import tiny_prompts

        return [{"prompt": p} for p in tiny_prompts(split)]
    if is_generated(source):
        return [{"prompt": p} for p in generated_prompts(source)]
    path = local_path(source)
    if not path.exists():
        raise DataFileNotFoundError(locate(source).message(f"prompt file ({split})"))
    if path.suffix == ".jsonl":
        from unirl.text.data import load_rows

        rows = load_rows(str(path))  # the text runs' loader: a bad line is named with its number
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{i + 1}: each line must be a JSON object with a string 'prompt'")
        return rows
    if path.suffix == ".txt":
        return [{"prompt": line.strip()} for line in path.read_text().splitlines() if line.strip()]
    raise ValueError(f"prompt file {str(path)!r}: expected .txt (one prompt a line) or .jsonl")


class ParamEMA:
    """Exponential moving average of a list of parameters on FlowGRPO's schedule
    (``flow_grpo/ema.py``, ``EMAModuleWrapper.step``).

    ``step(k)`` is called after optimizer step k (k = 1, 2, ... over the whole run). When
    ``(k + 1) % update_every == 0`` the averages move towards the parameters with decay
    ``d_k = min((1 + k) / (10 + k), decay)``: ``shadow <- shadow + (1 - d_k) (param - shadow)``. The
    warm-up follows the optimizer-step count, not the number of updates, so with ``update_every=8``
    the first update (k = 7) already has decay 8/17 and 0.9 is reached at k = 81, the tenth update.
    ``swapped()`` puts the averages into the parameters for a while.
    """

    def __init__(self, params: list[torch.nn.Parameter], decay: float, update_every: int = 1):
        self.params, self.decay, self.update_every = list(params), decay, update_every
        self.shadow = [p.detach().clone().float() for p in self.params]
        self._upcast = any(p.dtype != torch.float32 for p in self.params)  # bf16 parameters, float32 averages

    def decay_at(self, optimizer_step: int) -> float:
        return min((1 + optimizer_step) / (10 + optimizer_step), self.decay)

    @torch.no_grad()
    def step(self, optimizer_step: int) -> None:
        if (optimizer_step + 1) % self.update_every or not self.shadow:
            return
        d = self.decay_at(optimizer_step)
        # shadow <- shadow + (1 - d) (param - shadow), each operation over all tensors at once.
        delta = torch._foreach_sub([p.float() for p in self.params] if self._upcast else self.params, self.shadow)
        torch._foreach_mul_(delta, 1 - d)
        torch._foreach_add_(self.shadow, delta)

    @contextlib.contextmanager
    def swapped(self):
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        for s, v in zip(self.shadow, state["shadow"], strict=True):
            s.copy_(v)


class DiffusionEnvironment(Environment):
    recompute_old_logprobs = False  # the trainer samples: the sampler's log-probs are the policy's

    def __init__(self, cfg: DiffusionConfig):
        self.cfg = cfg
        self._model = None
        self.ref = None
        self.ema = None
        self._step = 0
        # (id of the rollout, its chunks' rewards: futures of the pool, or a call for the last chunk)
        self._pending: tuple[int, list] | None = None

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
        self._rollout_figures: dict[str, float] = {}
        if cfg.ema.enabled:
            self.ema = ParamEMA([p for p in transformer.parameters() if p.requires_grad], cfg.ema.decay,
                                cfg.ema.update_every)
        # 3. The family's negative prompt, encoded once; the sigma schedules.
        with torch.no_grad():
            negative = self.family.encode(pipe, [self.family.negative_prompt], max_sequence_length=s.max_sequence_length, device=device)
        self.negative = {"neg_" + k: v for k, v in negative.items()}  # each [1, ...]
        self.train_sigmas, self.train_timesteps = self.family.schedule(self.scheduler, s.num_steps, self.latent_shape)
        self.eval_sigmas, self.eval_timesteps = self.family.schedule(self.scheduler, s.eval_num_steps, self.latent_shape)
        # The training schedule's step constants, once for every rollout: the sampler's (one object a
        # step) and the whole schedule's [S], from which the update gathers its stored steps'.
        self._train_sigmas_device = self.train_sigmas.to(device)  # [S + 1]
        self.train_coefficients = schedule_coefficients(self._train_sigmas_device, noise_level=s.noise_level,
                                                        sde_type=s.sde_type)
        self._train_constants = step_coefficients(self._train_sigmas_device[:-1], self._train_sigmas_device[1:],
                                                  noise_level=s.noise_level, sde_type=s.sde_type)  # [S]
        # 4. Data and rewards.
        from unirl.text.data import PromptSampler

        image = self.family.conditioning_image
        self.train_rows = load_prompt_rows(cfg.data.train, "train", image)
        self.test_rows = load_prompt_rows(cfg.data.test, "test", image) if cfg.data.test else []
        if cfg.data.eval_size is not None:
            self.test_rows = self.test_rows[: cfg.data.eval_size]
        self.sampler = PromptSampler(self.train_rows, cfg.trainer.prompts_per_step, seed=cfg.trainer.seed,
                                     shuffle=cfg.data.shuffle, rank=accelerator.process_index,
                                     world_size=accelerator.num_processes)
        self.rewards = RewardSet(cfg.rewards, aggregation=cfg.algo.reward_aggregation, workers=cfg.trainer.reward_workers,
                                 eps=cfg.algo.adv_eps)
        if self.family.frames:  # videos: each reward scores their frames (``frames.FrameRewards``)
            self.rewards = FrameRewards(self.rewards, stride=cfg.video.frame_stride, reduce=cfg.video.frame_reduce)

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

    def _cond(self, cond: dict[str, torch.Tensor], guidance: float) -> dict[str, torch.Tensor]:
        """The family's conditioning ``{key: [n, ...]}``, plus the negative prompt's ``neg_<key>`` for CFG."""
        if guidance > 1:
            n = next(iter(cond.values())).shape[0]
            cond = {**cond, **{k: v.expand(n, *v.shape[1:]) for k, v in self.negative.items()}}  # [n, ...]
        return cond

    def _encode(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """The family's conditioning of ``rows`` ``{key: [len(rows), ...]}``: their prompts' and, for a family
        with a conditioning image, their images' (``row["image"]``, a path checked at loading)."""
        s, device = self.cfg.sampling, self.accelerator.device
        cond = self.family.encode(self.pipe, [row["prompt"] for row in rows], max_sequence_length=s.max_sequence_length,
                                  device=device)
        if self.family.conditioning_image:
            cond.update(self.family.encode_images(self.pipe, [row["image"] for row in rows], resolution=s.resolution,
                                                  device=device))
        return cond

    # ---------------------------------------------------------------- rollout
    def next_prompts(self, step: int) -> list[dict]:
        self._step = step
        return self.sampler.batch(step)

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        if self.ema is not None:
            self.ema.step(optimizer_steps)

    @torch.no_grad()
    def rollout(self, rows: list[dict], group_size: int) -> Rollout:
        cfg, s = self.cfg, self.cfg.sampling
        device = self.accelerator.device
        B, G = len(rows), group_size
        N = B * G
        seed = cfg.trainer.seed * 1_000_003 + self.accelerator.process_index * 10_007 + self._step
        generator = torch.Generator().manual_seed(seed)
        # 1. Prompts (and input images): encoded once per row, repeated for the group.
        prompts = [row["prompt"] for row in rows for _ in range(G)]  # [N]
        encoded = self._encode(rows)  # each [B, ...]
        group_ids = torch.arange(B).repeat_interleave(G)  # [N]
        # 2. Initial noise (shared within a group if asked), SDE window and trained steps.
        noise = self.family.noise(B if s.same_noise_per_group else N, self.latent_shape, generator)
        # The window comes from the seed and the step only: every process, and a resumed run, uses the same one.
        w = s.sde_window
        start, stop = window_bounds(self._step, num_steps=s.num_steps, size=w.size, window_range=w.range,
                                    schedule=w.schedule, shift_interval=w.shift_interval, stride=w.stride,
                                    seed=cfg.trainer.seed)
        sigmas, timesteps, stochastic, dpm, coefficients = self._plan(start, stop)
        steps = trained_steps(N, stochastic, s.timestep_fraction, generator, s.timestep_selection)  # [N, T]
        self.forwards.take()  # count this rollout's transformer rows only
        # 3. Flow-GRPO-Fast branching: the deterministic steps before the window once per prompt, then each
        #    prompt's latent repeated for its G members (``noise`` is one per prompt then).
        first = start if s.branch_prefix else 0  # the first step sampled per member
        if first:
            noise = self._prefix(noise, encoded, sigmas, timesteps, stochastic, coefficients, stop=first)  # [B, *latent] at step k
        if s.same_noise_per_group:
            noise = noise.repeat_interleave(G, 0)  # [N, *latent]
        encoded = {k: v.repeat_interleave(G, 0) for k, v in encoded.items()}  # each [N, ...]
        # 4. Sample chunk by chunk; each finished chunk but the last is scored in the reward pool while the
        #    next one samples. The last has no sampling left to overlap: ``score`` scores it on the calling
        #    thread (a pool thread would only compete with this one for the GIL until then).
        outs, images, futures = [], [], []
        columns = {k: [row.get(k) for row in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        for lo in range(0, N, s.chunk_size):
            hi = min(lo + s.chunk_size, N)
            cond = self._cond({k: v[lo:hi] for k, v in encoded.items()}, self.train_guidance)
            out = sample_with_logprob(self.family, self._model, noise[lo:hi].to(device), sigmas, timesteps, cond,
                                      guidance_scale=self.train_guidance, noise_level=s.noise_level,
                                      stochastic=stochastic, record=steps[lo:hi], sde_type=s.sde_type,
                                      generator=generator, coefficients=coefficients, start=first, dpm=dpm)
            images += self._decode_and_queue(out.final, prompts, columns, lo, hi, last=hi == N, futures=futures)
            outs.append(out)
        self._rollout_figures = {"rollout/transformer_calls": float(self.forwards.take()),
                                 "rollout/window_start": float(start), "rollout/window_size": float(stop - start)}
        # 5. Everything training needs to re-evaluate the trained steps.
        sig = sigmas.cpu()

        def joined(parts: list[torch.Tensor]) -> torch.Tensor:  # one chunk (the usual case): no copy
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu()

        tensors = {
            "latents": joined([o.latents for o in outs]),  # [N, T, *latent]
            "next_latents": joined([o.next_latents for o in outs]),  # [N, T, *latent]
            "old_logp": joined([o.logp for o in outs]),  # [N, T]
            "step_index": steps,  # [N, T]
            "sigma": sig[steps],  # [N, T]
            "sigma_next": sig[steps + 1],  # [N, T]
            "timestep": timesteps.cpu()[steps],  # [N, T]
            **{k: v.cpu() for k, v in encoded.items()},  # the family's conditioning, each [N, ...]
        }
        rollout = Rollout(tensors=tensors, group_ids=group_ids, prompts=prompts, samples=images, columns=columns)
        self._pending = (id(rollout), futures)
        return rollout

    def _decode_and_queue(self, final: torch.Tensor, prompts: list[str], columns: dict[str, list], lo: int, hi: int,
                          *, last: bool, futures: list) -> list:
        """Decode a sampled chunk's clean latents ``final`` (samples ``lo:hi``) and queue its rewards: in the
        pool for every chunk but the last, which ``score`` runs on the calling thread (nothing is left to
        sample while it scores). Returns the chunk's images."""
        chunk_images = to_pil(self.family.decode(self.pipe, final))
        chunk = dict(prompts=prompts[lo:hi], columns={k: v[lo:hi] for k, v in columns.items()})
        if last:
            futures.append(functools.partial(self.rewards.components, chunk_images, **chunk))
        else:
            futures.append(self.rewards.submit(chunk_images, **chunk))
        return chunk_images

    def score(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        if self._pending is not None and self._pending[0] == id(rollout):
            components = concat_components([f.result() if isinstance(f, Future) else f() for f in self._pending[1]])
            self._pending = None
        else:  # a rollout not made by the last ``rollout`` call: score it inline
            components = self.rewards.components(rollout.samples, prompts=rollout.prompts, columns=rollout.columns)
        rollout.tensors.update({f"score/{k}": v for k, v in components.items()})  # for global metrics
        rewards, metrics = self.rewards.combine(components, rollout.group_ids)
        return rewards, {**metrics, **self._rollout_figures}

    def _plan(self, start: int, stop: int) -> tuple:
        """The steps of a rollout whose SDE window is ``[start, stop)``: ``(sigmas [S' + 1], timesteps [S'],
        stochastic [S'], dpm [S'] or None, the steps' constants)`` on the device, S' = S unless
        ``tail_step_ratio`` cuts the steps after the window (the steps up to its end keep their index)."""
        s, device = self.cfg.sampling, self.accelerator.device
        stochastic = window_mask(s.num_steps, start, stop)  # [S]
        # DPM-Solver++(2M) for the ODE steps after the window (MixGRPO's "post" strategy).
        dpm = torch.arange(s.num_steps) >= stop if s.ode_solver == "dpm2m" else None  # [S]
        sigmas, timesteps = self.train_sigmas.to(device), self.train_timesteps.to(device)
        if s.tail_step_ratio == 1:
            return sigmas, timesteps, stochastic, dpm, self.train_coefficients
        keep = kept_steps(s.num_steps, stop, s.tail_step_ratio)  # MixGRPO-Flash: indices into the S + 1 sigmas
        sigmas = sigmas[keep]  # [S' + 1]
        coefficients = schedule_coefficients(sigmas, noise_level=s.noise_level, sde_type=s.sde_type)
        return sigmas, timesteps[keep[:-1]], stochastic[keep[:-1]], dpm[keep[:-1]], coefficients

    def _prefix(self, noise: torch.Tensor, encoded: dict[str, torch.Tensor], sigmas: torch.Tensor,
                timesteps: torch.Tensor, stochastic: torch.Tensor, coefficients, stop: int) -> torch.Tensor:
        """The latents ``[B, *latent]`` at step ``stop`` from the prompts' initial ``noise`` [B, *latent]:
        the deterministic steps ``[0, stop)`` once per prompt (``encoded`` each ``[B, ...]``), in chunks
        of ``sampling.chunk_size`` prompts. The steps draw no noise, so the SDE generator's state after
        them is the unbranched sampler's."""
        s, device = self.cfg.sampling, self.accelerator.device
        parts = []
        for lo in range(0, noise.shape[0], s.chunk_size):
            hi = min(lo + s.chunk_size, noise.shape[0])
            cond = self._cond({k: v[lo:hi] for k, v in encoded.items()}, self.train_guidance)
            out = sample_with_logprob(self.family, self._model, noise[lo:hi].to(device), sigmas, timesteps, cond,
                                      guidance_scale=self.train_guidance, noise_level=s.noise_level,
                                      stochastic=stochastic, sde_type=s.sde_type, coefficients=coefficients, stop=stop)
            parts.append(out.final)
        return torch.cat(parts)

    # ------------------------------------------------------------- log-probs
    def evaluate(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """Re-score the trained steps ``columns`` with the stored next latent as the action (gradients flow)."""
        s = self.cfg.sampling
        stored = batch.cache.get("stored_steps")
        if stored is None:  # once per batch, however many pieces the loop scores it in
            stored = batch.cache["stored_steps"] = self._stored_steps(batch)
        picked = range(*columns.indices(stored["steps"]["sigma"].shape[1]))
        if len(picked) == 1:  # the loop's pieces, one trained step each: views made once per batch
            j = picked[0]
            one = {k: v[j] for k, v in stored["columns"].items()}  # [n, ...]: column j of each
            # The mean only for a KL: without one nothing reads it.
            logp, mean, _ = rescore_step(self.family, model, one["latents"], one["next_latents"], one["timestep"],
                                         stored["cond"], stored["coef"][j], guidance_scale=self.train_guidance,
                                         offset=one.get("offset"),
                                         with_mean=self.cfg.algo.kl_coef > 0 or self.cfg.algo.use_kl_in_reward)
            out = {"logp": logp.unsqueeze(1), "std": stored["narrow"]["std"][j],
                   "sigma": stored["narrow"]["sigma"][j], "sigma_next": stored["narrow"]["sigma_next"][j],
                   "mask": None}  # [n, 1, ...]; no mask: every stored step is trained
            if mean is not None:
                out["mean"] = mean.unsqueeze(1)  # [n, 1, *latent]
        else:
            t = {k: v[:, columns] for k, v in stored["steps"].items()}  # [n, T', ...]
            # The steps are the rollout's, from the schedule and settings its sampler checked: no check here.
            out = rescore_steps(self.family, model, t["latents"], t["next_latents"], t["sigma"], t["sigma_next"],
                                t["timestep"], stored["cond"], guidance_scale=self.train_guidance, noise_level=s.noise_level,
                                sde_type=s.sde_type, check=False, coefficients=stored["coef"][columns])
            out["sigma"], out["sigma_next"] = t["sigma"], t["sigma_next"]  # [n, T'], for the KL
            out["mask"] = None  # every stored step is trained
        return out

    def _stored_steps(self, batch: Rollout) -> dict:
        """The batch's stored steps on the device (``steps``: latents, next latents [n, T, *latent], float32
        sigmas and timesteps [n, T]), their T columns as views (``columns``: latents, next latents
        [n, *latent], timesteps [n] and the steps' offsets that ``step_log_prob`` takes; ``narrow``: sigmas
        and stds [n, 1]), its conditioning (``cond``) and the columns' constants (``coef``): what each piece
        of ``evaluate`` takes instead of slicing, moving and recomputing them (one operation per tensor for
        the whole batch, not one per piece)."""
        device = self.accelerator.device
        steps = {k: batch.tensors[k].to(device) for k in ("latents", "next_latents", "sigma", "sigma_next", "timestep")}
        steps["sigma"], steps["sigma_next"] = steps["sigma"].float(), steps["sigma_next"].float()
        whole = self._stored_constants(batch, steps)  # [n, T], latent-facing [n, T, 1, ...]
        columns = {k: v.unbind(1) for k, v in steps.items() if k in ("latents", "next_latents", "timestep")}
        if not whole.ode:  # every step's offset x' - a x at once (step_log_prob), not once a piece with gradients on
            columns["offset"] = (steps["next_latents"].float() - steps["latents"].float() * whole.sample_weight).unbind(1)
        n, T = steps["sigma"].shape
        narrow = {k: steps[k].split(1, dim=1) for k in ("sigma", "sigma_next")}
        narrow["std"] = whole.std.reshape(n, T).split(1, dim=1)
        cond = self._cond({k: batch.tensors[k].to(device) for k in self.family.cond_keys}, self.train_guidance)
        return {"steps": steps, "columns": columns, "narrow": narrow, "cond": cond, "coef": whole.unbind(1)}  # coef: T x [n]

    def _stored_constants(self, batch: Rollout, steps: dict[str, torch.Tensor]):
        """The stored steps' ``StepCoefficients`` [n, T] (latent-facing ones [n, T, 1, ...]), gathered from
        the training schedule's by ``step_index``: a dozen operations a batch where computing them from
        the stored sigmas is thirty, with the same numbers (tested). A rollout without ``step_index``
        gets them computed; one whose stored sigmas are not the schedule's at its ``step_index`` fails."""
        s, latent_ndim = self.cfg.sampling, steps["latents"].ndim - 2
        index = batch.tensors.get("step_index")
        if index is None:
            return step_coefficients(steps["sigma"], steps["sigma_next"], noise_level=s.noise_level,
                                     sde_type=s.sde_type, latent_ndim=latent_ndim)
        sigmas = self._train_sigmas_device  # [S + 1]
        index = index.to(sigmas.device)  # [n, T]
        if not (torch.equal(sigmas[index], steps["sigma"]) and torch.equal(sigmas[index + 1], steps["sigma_next"])):
            raise ValueError("the rollout's stored sigma / sigma_next are not the training schedule's sigmas at its "
                             "step_index (sampling.num_steps or the scheduler changed since it was sampled?)")
        return self._train_constants.take(index, latent_ndim)

    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        return torch.ones_like(batch.tensors["old_logp"], dtype=torch.bool)  # [n, T]: every stored step is trained

    def column_slices(self, batch: Rollout) -> list[slice]:
        # One trained step at a time, backward after each (FlowGRPO's order): peak memory holds the
        # graph of one transformer forward, whatever the number of trained steps.
        return [slice(j, j + 1) for j in range(batch.tensors["old_logp"].shape[1])]

    def kl(self, current: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, T] KL penalty between the policy's and the reference's Gaussian steps (``kl_form``)."""
        s = self.cfg.sampling
        n, T = current["logp"].shape
        mean = current["mean"].flatten(0, 1)  # [n*T, *latent]
        ref_mean = reference["mean"].to(mean.device).flatten(0, 1)
        kl = step_kl(mean, ref_mean, current["sigma"].flatten(), current["sigma_next"].flatten(),
                     noise_level=s.noise_level, sde_type=s.sde_type, form=self.cfg.kl_form)  # [n*T]
        return kl.view(n, T)

    def reference_model(self):
        return lora_or_frozen_reference(self.accelerator, self._model, self.ref, self.cfg.model.lora.enabled)

    # ------------------------------------------------------------ evaluation
    @contextlib.contextmanager
    def _ema_weights(self):
        if self.ema is None:
            yield
            return
        with self.ema.swapped():
            yield

    @torch.no_grad()
    def sample_deterministic(self, rows: list[dict], positions: list[int] | None = None) -> list:
        """Images from the ODE sampler (noise 0, ``eval_num_steps``, ``guidance_scale``) with fixed seeds, for
        prompt rows (``{"prompt": ...}``, with an ``image`` for a family that takes one).

        ``positions`` [n]: where each row sits in the whole evaluation set (default 0..n-1); the
        initial noise depends on the position only, so a process sampling a share of the prompts
        draws the same images as one process sampling them all."""
        s, device = self.cfg.sampling, self.accelerator.device
        positions = list(range(len(rows))) if positions is None else positions
        if not rows:
            return []
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed + 12_345)
        noise = self.family.noise(max(positions) + 1, self.latent_shape, generator)[positions]
        stochastic = torch.zeros(s.eval_num_steps, dtype=torch.bool)
        images = []
        for lo in range(0, len(rows), s.chunk_size):
            chunk = rows[lo:lo + s.chunk_size]
            encoded = self._encode(chunk)
            out = sample_with_logprob(self.family, self._model, noise[lo:lo + len(chunk)].to(device),
                                      self.eval_sigmas.to(device), self.eval_timesteps.to(device),
                                      self._cond(encoded, s.guidance_scale), guidance_scale=s.guidance_scale,
                                      noise_level=0.0, stochastic=stochastic)
            images += to_pil(self.family.decode(self.pipe, out.final))
        return images

    def evaluation(self, step: int, run_dir: Path) -> dict[str, float]:
        """Deterministic (ODE) images of the held-out prompts with the EMA weights, scored by the
        config's rewards. With several processes each samples every world-th prompt and the scores
        (and the grid's images) are gathered; the main process writes ``eval/step_N.png`` (videos: their
        first frames, and ``eval/step_N.gif`` playing them), and
        ``eval/step_N.jsonl`` with a judge reward's answers when one is configured."""
        if not self.test_rows:
            return {}
        from accelerate.utils import gather_object

        acc, k = self.accelerator, self.cfg.data.grid_size
        mine = list(range(acc.process_index, len(self.test_rows), acc.num_processes))
        rows = [self.test_rows[i] for i in mine]
        with self._ema_weights():
            images = self.sample_deterministic(rows, mine)
        comps, judged = {}, {}  # judged: a judge reward's answers, by reward
        if rows:
            columns = {c: [row.get(c) for row in rows] for c in rows[0] if c != "prompt"}
            comps = self.rewards.components(images, prompts=[row["prompt"] for row in rows], columns=columns, texts=judged)
        local = [(i, {name: float(v[j]) for name, v in comps.items()}, images[j] if i < k else None,
                  {name: v[j] for name, v in judged.items()}) for j, i in enumerate(mine)]
        results = sorted(gather_object(local) if acc.num_processes > 1 else local, key=lambda res: res[0])
        comps = {name: torch.tensor([res[1][name] for res in results]) for name in self.rewards.names}
        total, _ = self.rewards.combine(comps, torch.arange(len(results)))
        out = {f"eval/reward/{name}": v.nanmean().item() for name, v in comps.items()}
        out["eval/reward"] = total.mean().item()
        if acc.is_main_process:
            shown = results[:k]
            captions = [f"{self.test_rows[i]['prompt']}\n" + " ".join(f"{name}={v:.3f}" for name, v in scores.items())
                        for i, scores, _, _ in shown]
            path = Path(run_dir) / "eval" / f"step_{step:06d}.png"
            grid = write_grid([image for _, _, image, _ in shown], captions, path, fps=self.cfg.video.fps)
            if any(judge for *_, judge in results):  # a judge's reasons beside its scores
                with open(path.with_suffix(".jsonl"), "w") as f:
                    for i, scores, _, judge in results:
                        f.write(json.dumps({"prompt": self.test_rows[i]["prompt"], **scores, "judge": judge}) + "\n")
            self._evaluation_media = {"images": {"eval/grid": grid}}  # for the trackers
        return out

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
        with self._ema_weights():  # written while the EMA weights are swapped in
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

    def checkpoint_objects(self) -> list:
        return [self.ema] if self.ema is not None else []

    def close(self) -> None:
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()


def image_grid(images: list, captions: list[str], cell: int = 160, columns: int = 4):
    """A PNG-ready grid: each image scaled to ``cell`` px with its caption (prompt, rewards) below."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    text_h = 5 * 12 + 4
    rows = max(1, -(-len(images) // columns))
    grid = Image.new("RGB", (columns * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, caption) in enumerate(zip(images, captions)):
        x, y = (i % columns) * cell, (i // columns) * (cell + text_h)
        resample = Image.NEAREST if image.width < cell else Image.BICUBIC
        grid.paste(image.convert("RGB").resize((cell, cell), resample), (x, y))
        prompt, _, scores = caption.partition("\n")
        lines = textwrap.wrap(prompt, width=cell // 6)[:4] + [scores]
        draw.multiline_text((x + 2, y + cell + 2), "\n".join(lines), fill="black", font=font, spacing=1)
    return grid
