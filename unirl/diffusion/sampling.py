"""Sampling a flow-matching text-to-image model with per-step log-probabilities, and re-scoring steps.

FlowGRPO (https://arxiv.org/abs/2505.05470) samples with an SDE whose steps are Gaussians
(``unirl.diffusion.sde``), keeps the latents before and after each trained step with the step's
log-prob, and in training re-evaluates exactly those steps (the stored next latent is the action).
This module drives diffusers' components itself instead of forking a pipeline's ``__call__``: a
model family's adapter (``unirl.diffusion.families``) encodes prompts and runs one transformer
forward, the scheduler provides the shifted sigmas (``set_timesteps``), the VAE decodes.

The same function, ``guided_velocity``, runs the transformer at sampling and at training time, so
a re-scored step reproduces the sampled log-prob bit for bit when the model has not changed (the
on-policy checks in ``tests/test_diffusion_env.py`` and ``tests/test_flux.py``).

Shapes: N = B*G samples, S sampling steps, T trained steps per sample, latents ``[*latent]`` as the
family's transformer takes them (SD3 ``[C, h, w]``, FLUX packed ``[h/2 * w/2, 4C]``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from unirl.diffusion.dpm_solver import data_prediction, dpm_solver_pp_step
from unirl.diffusion.sde import StepCoefficients, check_sigmas, check_step_inputs, sde_step, step_coefficients, step_log_prob


@dataclass
class SampleOutput:
    """What a rollout keeps. ``latents``/``next_latents`` are the trained steps' inputs and outputs."""

    final: torch.Tensor  # [N, *latent] the last latent (to decode)
    latents: torch.Tensor  # [N, T, *latent]
    next_latents: torch.Tensor  # [N, T, *latent]
    logp: torch.Tensor  # [N, T]
    means: torch.Tensor | None = None  # [N, T, *latent] the trained steps' Gaussian means, when asked (``keep_means``)


# ----------------------------------------------------------------------------- schedule
def sigma_schedule(scheduler, num_steps: int, device=None, *, sigmas=None, mu: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheduler's shifted sigmas ``[S + 1]`` (ending in 0) and timesteps ``[S]`` for S steps.

    ``FlowMatchEulerDiscreteScheduler.set_timesteps`` applies the checkpoint's fixed ``shift`` (3.0 for
    SD3), or with ``use_dynamic_shifting`` the shift ``mu`` given here to the unshifted ``sigmas``
    (FLUX); ``timestep = sigma * num_train_timesteps``.
    """
    if sigmas is None and mu is None:
        scheduler.set_timesteps(num_steps, device=device)
    else:
        scheduler.set_timesteps(num_steps, device=device, sigmas=sigmas, mu=mu)
    sigmas = scheduler.sigmas.detach().clone().float()  # [S + 1]
    timesteps = scheduler.timesteps.detach().clone().float()  # [S]
    if sigmas.shape[0] != num_steps + 1 or timesteps.shape[0] != num_steps:
        raise ValueError(f"scheduler gave {sigmas.shape[0]} sigmas for {num_steps} steps (expected {num_steps + 1})")
    return sigmas, timesteps


def trained_steps(n: int, stochastic: torch.Tensor, fraction: float, generator: torch.Generator,
                  selection: str = "first") -> torch.Tensor:
    """``[N, T]`` sorted step indices trained per sample, ``T = max(1, int(K * fraction))`` of the K
    stochastic steps (FlowGRPO's ``timestep_fraction``; all K when it is 1).

    ``selection="first"``: the first T stochastic steps in sampling order, for every sample, as
    FlowGRPO's ``train_sd3.py`` trains them. ``"random"``: a random subset of T per sample."""
    if selection not in ("first", "random"):
        raise ValueError(f"selection must be 'first' or 'random', got {selection!r}")
    candidates = stochastic.nonzero().squeeze(-1)  # [K]
    k = len(candidates)
    t = max(1, int(k * fraction))
    if t == k or selection == "first":
        return candidates[:t].expand(n, t).clone()
    order = torch.stack([torch.randperm(k, generator=generator)[:t] for _ in range(n)])  # [N, T]
    return candidates[order].sort(dim=-1).values


# ---------------------------------------------------------------------------- velocity
def guided_velocity(family, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                    cond: dict[str, torch.Tensor], guidance_scale: float) -> torch.Tensor:
    """The (guided) velocity ``[n, *latent]`` at ``latents`` and per-sample ``timestep`` [n].

    ``cond`` holds the family's ``cond_keys`` (each ``[n, ...]``), plus ``neg_<key>`` of the same shapes
    when ``guidance_scale > 1``: classifier-free guidance (the family's ``combine_guidance``, by default
    ``v_u + g (v_c - v_u)``, https://arxiv.org/abs/2207.12598) with one batched forward, negative first,
    as the SD3 pipeline does, for a family whose ``guidance_mode`` is ``"cfg"``.
    """
    transformer = forward_module(transformer)
    if guidance_scale > 1:
        if family.guidance_mode != "cfg":  # the config refuses it; a direct caller learns it here
            raise ValueError(f"guidance_scale={guidance_scale}: {family.title} takes no classifier-free guidance")
        both = {k: torch.cat([cond["neg_" + k], cond[k]]) for k in family.cond_keys}  # [2n, ...]
        v = family.velocity(transformer, torch.cat([latents, latents]), torch.cat([timestep, timestep]), both)
        v_uncond, v_cond = v.chunk(2)
        return family.combine_guidance(v_uncond, v_cond, guidance_scale)
    return family.velocity(transformer, latents, timestep, cond)  # [n, *latent]: the family reads its cond_keys


class ForwardCounter:
    """Counts the samples that go through ``module``'s forward: the rows of its ``hidden_states`` (or first
    argument), so a classifier-free-guided step of n samples counts 2n (one batched forward of the
    negative and positive halves). A forward pre-hook on the module itself, so every route to it (a PEFT
    wrapper, ``forward_module``'s shortcut, DDP) is counted; ``take()`` returns the count and restarts it."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.count += hidden.shape[0]

    def take(self) -> int:
        count, self.count = self.count, 0
        return count

    def remove(self) -> None:
        self._handle.remove()


def forward_module(transformer):
    """The module to call for a forward of ``transformer``.

    PEFT's ``PeftModel`` wrapping a LoRA transformer hands a forward's arguments on to its base
    model, where the LoRA layers live (its other work, routing ``adapter_names`` for mixed-adapter
    batches, is not used here), so the base model is called directly: the same computation (tested
    bit for bit) without PEFT's Python on each forward, 0.05-0.1 ms on the development CPU, 16
    forwards a step on the tiny config. Enabling or disabling the adapter acts on the base model's
    LoRA layers, so the reference (``disable_adapter``) is unchanged. Any other module, a DDP or FSDP
    wrapper included (their forward does the gradient bookkeeping), and a PeftModel whose forward was
    wrapped (``trainer.mixed_precision``: accelerate puts autocast around the prepared model's
    forward) or carries hooks, is called as it is.
    """
    if type(transformer).__name__ == "PeftModel":  # cheap test first: this runs at every forward
        peft_model, tuner = _peft_classes()
        base = transformer._modules["base_model"]  # not through PEFT's __getattr__ fallbacks
        # Only the plain wrapper: a forward replaced on the instance (accelerate's mixed-precision
        # autocast wraps the prepared model's forward so) or hooks on it must run.
        plain = ("forward" not in transformer.__dict__ and not transformer._forward_hooks
                 and not transformer._forward_pre_hooks)
        if type(transformer) is peft_model and type(base) is tuner and plain:  # LoRA's tuner, not a subclass
            return base._modules["model"]  # the tuner (LoraModel) wraps the LoRA-injected transformer
    return transformer


@functools.cache
def _peft_classes() -> tuple[type, type]:
    from peft import LoraModel, PeftModel

    return PeftModel, LoraModel


# ----------------------------------------------------------------------------- sampling
def schedule_coefficients(sigmas: torch.Tensor, *, noise_level: float, sde_type: str = "flow"
                          ) -> tuple[list[StepCoefficients], list[StepCoefficients]]:
    """The constants of every step of the schedule ``sigmas`` [S + 1] (checked, float32, on ``sigmas``'
    device): ``(sde, ode)``, S 0-d ``StepCoefficients`` each, of the SDE step (``noise_level``) and of
    the ODE step. ``sample_with_logprob`` computes them at each call unless it is given them: a caller
    that samples one schedule at every rollout computes them once (two dozen small operations and a
    host sync a rollout)."""
    sigmas = sigmas.float()
    sigma, sigma_next = sigmas[:-1], sigmas[1:]  # [S] each
    check_sigmas(sigma, sigma_next)  # the whole schedule at once: the steps skip the checks
    return (step_coefficients(sigma, sigma_next, noise_level=noise_level, sde_type=sde_type).unbind(),
            step_coefficients(sigma, sigma_next, noise_level=0.0, sde_type=sde_type).unbind())


@torch.no_grad()
def sample_with_logprob(
    family,
    transformer,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    timesteps: torch.Tensor,
    cond: dict[str, torch.Tensor],
    *,
    guidance_scale: float,
    noise_level: float,
    stochastic: torch.Tensor,
    record: torch.Tensor | None = None,
    sde_type: str = "flow",
    generator: torch.Generator | None = None,
    coefficients: tuple[list[StepCoefficients], list[StepCoefficients]] | None = None,
    start: int = 0,
    stop: int | None = None,
    dpm: torch.Tensor | None = None,
    keep_means: bool = False,
) -> SampleOutput:
    """Run the denoising steps ``start .. stop - 1`` (all S by default) from ``noise`` [N, *latent] (the
    latents at ``sigmas[start]``), keeping the recorded steps; ``final`` is the latent at ``sigmas[stop]``.

    Args:
        family: the model family's adapter (``unirl.diffusion.families``); ``cond`` holds its
            ``cond_keys`` (and ``neg_<key>`` when ``guidance_scale > 1``).
        sigmas: ``[S + 1]`` and ``timesteps`` ``[S]`` from ``sigma_schedule``.
        stochastic: ``[S]`` bool, the SDE steps (``noise_level``); the others take the ODE step
            (``noise_level=0``, the scheduler's Euler step). All False: deterministic sampling.
        record: ``[N, T]`` step indices whose input latent, next latent and log-prob are kept
            (each must be a stochastic step); None keeps nothing (T = 0).
        generator: CPU generator for the SDE noise.
        coefficients: ``schedule_coefficients(sigmas, noise_level=..., sde_type=...)`` on the latents'
            device when the caller keeps them; computed here when None. Given ones are used as they
            are: they must come from these sigmas and settings.
        start, stop: the steps to run; a sampler that branches runs ``[0, k)`` once per prompt and
            ``[k, S)`` per sample from the repeated latents (``sampling.branch_prefix``).
        dpm: ``[S]`` bool, ODE steps taken by DPM-Solver++(2M) (``unirl.diffusion.dpm_solver``) instead
            of Euler; each uses the data prediction of the step before it (second order) unless that
            step is not run here or it is the last step (first order). None: Euler for every ODE step.
        keep_means: also keep the recorded steps' Gaussian means (``SampleOutput.means``): the old
            policy's means that GRPO-Guard and Flow-DPPO compare the current ones with.
    """
    n, num_steps = noise.shape[0], len(timesteps)
    stop = num_steps if stop is None else stop
    if not 0 <= start <= stop <= num_steps:
        raise ValueError(f"need 0 <= start <= stop <= {num_steps} steps, got start={start}, stop={stop}")
    record = torch.zeros(n, 0, dtype=torch.long) if record is None else record.cpu()
    rows = record.tolist()  # [N][T]: checked and grouped in Python, one read instead of a dozen small operations
    is_sde = stochastic.tolist()  # [S] python bools: no tensor read per step
    if not all(is_sde[i] for row in rows for i in row):
        raise ValueError("only stochastic steps can be recorded (an ODE step has no density)")
    if not all(start <= i < stop for row in rows for i in row):
        raise ValueError(f"recorded steps must lie in the steps run, [{start}, {stop})")
    is_dpm = [False] * num_steps if dpm is None else dpm.tolist()  # [S]
    if any(d and s for d, s in zip(is_dpm, is_sde)):
        raise ValueError("a DPM-Solver step must be an ODE step (dpm and stochastic overlap)")
    sigma_values = sigmas.tolist() if any(is_dpm) else None  # [S + 1] floats for the solver's scalars
    if coefficients is None:  # the constants meet the latents in addcmul: on their device
        coefficients = schedule_coefficients(sigmas.to(noise.device), noise_level=noise_level, sde_type=sde_type)
    sde_coef, ode_coef = coefficients  # step i takes entry i of one of them
    if len(sde_coef) != len(timesteps) or len(ode_coef) != len(timesteps):
        raise ValueError(f"coefficients must hold the constants of the {len(timesteps)} steps, got {len(sde_coef)} and {len(ode_coef)}")
    recorded = sorted({i for row in rows for i in row})  # the steps some sample records
    step_times = timesteps.unsqueeze(1).expand(-1, n).unbind()  # S x [n]: each step's timestep for the batch, views
    latents = noise.float()  # [N, *latent]
    before, after, logps, means = [], [], [], []  # per recorded step: [N, *latent], [N, *latent], [N], [N, *latent]
    prev_x0 = None  # the previous step's data prediction, when the next step is a DPM-Solver step
    for i in range(start, stop):
        v = guided_velocity(family, transformer, latents, step_times[i], cond, guidance_scale)
        if i == start:
            check_step_inputs(v, latents, None, noise_level, sde_type, "mean")
        if is_dpm[i]:
            x0 = data_prediction(latents, v, sigma_values[i])
            nxt = dpm_solver_pp_step(latents, x0, sigma_values[i], sigma_values[i + 1], prev_x0=prev_x0,
                                     prev_sigma=sigma_values[i - 1] if prev_x0 is not None else None)
        else:
            nxt, logp, mean, _ = sde_step(v, latents, (sde_coef if is_sde[i] else ode_coef)[i], generator=generator)
            x0 = data_prediction(latents, v, sigma_values[i]) if i + 1 < stop and is_dpm[i + 1] else None
        if i in recorded:
            before.append(latents), after.append(nxt), logps.append(logp)
            if keep_means:
                means.append(mean)
        latents, prev_x0 = nxt, x0
    out = _kept(latents, record, rows, recorded, before, after, logps)
    if keep_means and recorded:
        out.means = _stacked(means, record, rows, recorded)  # [N, T, *latent]
    return out


def _kept(final: torch.Tensor, record: torch.Tensor, rows: list[list[int]], recorded: list[int],
          before: list[torch.Tensor], after: list[torch.Tensor], logps: list[torch.Tensor]) -> SampleOutput:
    """The sampler's output: sample r's column t is step ``record[r, t]`` (``rows`` its list), taken from
    the per-step lists (``before``/``after`` [N, *latent], ``logps`` [N]) of the steps in ``recorded`` (sorted)."""
    n = final.shape[0]
    if not recorded:
        empty = torch.zeros(n, 0, *final.shape[1:], device=final.device)
        return SampleOutput(final=final, latents=empty, next_latents=empty.clone(), logp=torch.zeros(n, 0, device=final.device))
    if all(row == rows[0] for row in rows):  # every sample keeps the same steps (timestep_selection "first")
        order = [recorded.index(i) for i in rows[0]]  # [T]
        kept_before, kept_after = [before[j] for j in order], [after[j] for j in order]
        logp = torch.stack([logps[j] for j in order], dim=1)  # [N, T]
        if all(b is a for b, a in zip(kept_before[1:], kept_after[:-1])):
            # Consecutive steps (every step trained, the usual case): each step's next latent is the
            # following step's latent, so the T + 1 distinct latents are copied once and both are views.
            chain = torch.stack([kept_before[0], *kept_after], dim=1)  # [N, T + 1, *latent]
            return SampleOutput(final=final, latents=chain[:, :-1], next_latents=chain[:, 1:], logp=logp)
        return SampleOutput(final=final, latents=torch.stack(kept_before, dim=1),  # one copy each into [N, T, ...]
                            next_latents=torch.stack(kept_after, dim=1), logp=logp)
    # One gather per kept tensor.
    slot = torch.zeros(int(record.max()) + 1, dtype=torch.long)
    slot[recorded] = torch.arange(len(recorded))
    where = slot[record].to(final.device)  # [N, T] position of each recorded step in the lists
    rows = torch.arange(n, device=final.device).unsqueeze(1)  # [N, 1]
    return SampleOutput(final=final, latents=torch.stack(before)[where, rows],  # [N, T, *latent]
                        next_latents=torch.stack(after)[where, rows], logp=torch.stack(logps)[where, rows])


def _stacked(per_step: list[torch.Tensor], record: torch.Tensor, rows: list[list[int]], recorded: list[int]
             ) -> torch.Tensor:
    """``[N, T, ...]``: sample r's column t is the value of step ``record[r, t]`` in ``per_step`` (one
    ``[N, ...]`` tensor per step of ``recorded``), one copy (what ``_kept`` does for the latents)."""
    if all(row == rows[0] for row in rows):
        return torch.stack([per_step[recorded.index(i)] for i in rows[0]], dim=1)
    slot = torch.zeros(int(record.max()) + 1, dtype=torch.long)
    slot[recorded] = torch.arange(len(recorded))
    where = slot[record].to(per_step[0].device)  # [N, T]
    return torch.stack(per_step)[where, torch.arange(record.shape[0], device=where.device).unsqueeze(1)]


def rescore_steps(
    family,
    transformer,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    timestep: torch.Tensor,
    cond: dict[str, torch.Tensor],
    *,
    guidance_scale: float,
    noise_level: float,
    sde_type: str = "flow",
    check: bool = True,
    coefficients: list[StepCoefficients] | None = None,
) -> dict[str, torch.Tensor]:
    """Log-probs of stored steps under ``transformer`` (with gradients), the stored next latent as the action.

    Args:
        family: the model family's adapter, as in ``sample_with_logprob``.
        latents, next_latents: ``[n, T, *latent]``; ``sigma``, ``sigma_next``, ``timestep``: ``[n, T]``.
        check: False skips the checks of the sigmas (a host sync) and of the other inputs for steps a
            rollout stored, whose schedule and settings ``sample_with_logprob`` already checked.
        coefficients: the T columns' constants when the caller already has them
            (``step_coefficients(sigma, sigma_next, ..., latent_ndim=latents.ndim - 2).unbind(1)``);
            computed here when None. Given ones are used as they are: ``noise_level`` and ``sde_type``
            must be the ones they were computed with.

    Returns:
        ``logp`` [n, T], ``mean`` [n, T, *latent] and ``std`` [n, T] of each step's Gaussian.
    """
    n, T = latents.shape[:2]
    if sigma.shape != (n, T) or sigma_next.shape != (n, T) or timestep.shape != (n, T):
        raise ValueError(f"sigma, sigma_next and timestep must be [n, T] = [{n}, {T}], got {tuple(sigma.shape)}, "
                         f"{tuple(sigma_next.shape)}, {tuple(timestep.shape)}")
    if check:
        check_sigmas(sigma, sigma_next)  # every stored step at once: the steps below skip the checks
    if coefficients is None:
        coefficients = step_coefficients(sigma.to(latents.device, torch.float32), sigma_next.to(latents.device, torch.float32),
                                         noise_level=noise_level, sde_type=sde_type, latent_ndim=latents.ndim - 2).unbind(1)
    if len(coefficients) != T:
        raise ValueError(f"coefficients must hold the T = {T} columns' constants, got {len(coefficients)}")
    logps, means, stds = [], [], []
    columns = zip(latents.unbind(1), next_latents.unbind(1), timestep.unbind(1), coefficients)  # one view per column
    for j, (x, x_next, t, coef) in enumerate(columns):
        v = guided_velocity(family, transformer, x, t, cond, guidance_scale)
        if j == 0 and check:
            check_step_inputs(v, x, x_next, noise_level, sde_type, "mean")
        _, logp, mean, std = sde_step(v, x, coef, prev_sample=x_next)
        logps.append(logp)  # [n]
        means.append(mean)  # [n, *latent]
        stds.append(std.flatten())  # [n]
    if T == 1:  # one column: views, not copies of the mean and its gradient
        return {"logp": logps[0].unsqueeze(1), "mean": means[0].unsqueeze(1), "std": stds[0].unsqueeze(1)}
    return {"logp": torch.stack(logps, 1), "mean": torch.stack(means, 1), "std": torch.stack(stds, 1)}


def rescore_step(family, transformer, latents: torch.Tensor, next_latents: torch.Tensor, timestep: torch.Tensor,
                 cond: dict[str, torch.Tensor], coef: StepCoefficients, *, guidance_scale: float,
                 offset: torch.Tensor | None = None, with_mean: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One stored step as ``rescore_steps`` scores it, unchecked (for a caller holding one column's views):
    ``latents``, ``next_latents`` ``[n, *latent]``, ``timestep`` ``[n]``, ``coef`` its constants (``[n]``,
    latent-facing ``[n, 1, ..., 1]``). Returns the step's ``logp`` [n], ``mean`` [n, *latent] and ``std``
    (shaped like ``coef.std``).

    ``offset``: ``next_latents - coef.sample_weight * latents`` (float32) when the caller computed it
    for all its stored steps at once; the log-prob then comes from ``step_log_prob`` (the same bits as
    ``sde_step``'s, with two fewer operations carrying gradients), and the mean is computed only when
    ``with_mean`` (a KL needs it; otherwise it is None)."""
    v = guided_velocity(family, transformer, latents, timestep, cond, guidance_scale)
    if offset is None or coef.ode:
        _, logp, mean, std = sde_step(v, latents, coef, prev_sample=next_latents)
        return logp, mean, std
    v = v.float()  # sde_step's upcast
    logp = step_log_prob(v, offset, coef)
    mean = torch.addcmul(latents.float() * coef.sample_weight, v, coef.velocity_weight) if with_mean else None  # as sde_step
    return logp, mean, coef.std


# ------------------------------------------------------------------------------ images
def to_pil(images: torch.Tensor) -> list:
    """PIL RGB images from ``[N, 3, H, W]`` in [0, 1]; from videos ``[N, F, 3, H, W]``, one list of F
    frames per video (what a family with ``frames`` decodes)."""
    from PIL import Image

    if images.ndim == 5:
        frames = to_pil(images.flatten(0, 1))  # [N * F]
        per_video = images.shape[1]
        return [frames[i:i + per_video] for i in range(0, len(frames), per_video)]

    # Scaled and rounded in the decoder's layout, then made contiguous once: PIL copies a strided array
    # image by image otherwise (twice the time for a batch of small images).
    arrays = (images * 255).round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()  # [N, H, W, 3]
    return [Image.fromarray(a) for a in arrays]
