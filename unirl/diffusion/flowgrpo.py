"""FlowGRPO's rollout mode (``algorithm: flowgrpo``, the default) of ``DiffusionEnvironment``.

FlowGRPO (Liu et al., 2025, https://arxiv.org/abs/2505.05470): sample each prompt G times with an SDE
that has the ODE's marginals, so each denoising step is a Gaussian policy with a log-prob; keep the
trained steps (latent, next latent, sigmas, the sampler's log-prob); in the update re-score each stored
step under the current model (``score_actions``) for the registered ratio loss, with a closed-form
Gaussian KL to the reference (``kl``).

Faster variants, all in ``rollout``: an SDE window (Flow-GRPO-Fast, or MixGRPO's sliding window) trains
a few steps instead of all; ``branch_prefix`` runs the deterministic steps before the window once per
prompt and branches the group from there; ``ode_solver: dpm2m`` takes the steps after the window with
DPM-Solver++(2M), in fewer steps with ``tail_step_ratio`` (MixGRPO-Flash).

Shapes: B prompts, G group size, N = B*G, T trained steps, latents ``[*latent]`` in the family's
layout (SD3 ``[C, h, w]``, FLUX packed ``[h/2 * w/2, 4C]``).
"""

from __future__ import annotations

import torch

from unirl.diffusion.rollout_mode import RolloutMode, register_rollout_mode
from unirl.diffusion.sampling import rescore_step, rescore_steps, sample_with_logprob, schedule_coefficients, trained_steps
from unirl.diffusion.sde import step_coefficients, step_kl
from unirl.diffusion.window import kept_steps, window_bounds, window_mask
from unirl.env import Rollout


@register_rollout_mode("flowgrpo")
class FlowGRPORollout(RolloutMode):
    """FlowGRPO: SDE rollouts with per-step log-probs, re-scored step by step for the ratio loss or a guard
    (``unirl/diffusion/flowgrpo.py``)."""

    policy_loss = None  # the ratio loss of ``algo`` (clipped, or gspo with algo.level: sequence)
    keeps_sampler_means = True  # its SDE sampler keeps the step means when asked (sampling.sampler_old_means)
    # ``old_mean``: the sampler's step means, kept only when the run's loss reads them (the guards).
    offers = frozenset({"logp", "mean", "old_mean", "std", "sigma", "sigma_next"})

    @classmethod
    def check_config(cls, cfg) -> None:
        algo, s = cfg.algo, cfg.sampling
        if algo.kl_in_reward == "per_step":  # each step's advantage from its own column (unirl.core.stepwise_advantages)
            if not algo.use_kl_in_reward:
                raise ValueError("algo.kl_in_reward=per_step places the KL in the reward: set algo.use_kl_in_reward: true")
            if algo.adv_estimator not in ("grpo", "rloo"):
                raise ValueError(f"algo.kl_in_reward=per_step takes an outcome estimator per step (grpo, rloo), got "
                                 f"algo.adv_estimator={algo.adv_estimator}")
            if s.timestep_selection == "random" and s.timestep_fraction < 1:
                raise ValueError("algo.kl_in_reward=per_step compares step t across a group: every sample must train "
                                 "the same steps; set sampling.timestep_selection: first (or timestep_fraction: 1)")

    def setup(self) -> None:
        # The training schedule's step constants, once for every rollout: the sampler's (one object a
        # step) and the whole schedule's [S], from which the update gathers its stored steps'.
        env, s = self.env, self.env.cfg.sampling
        self.sigmas_device = env.train_sigmas.to(env.accelerator.device)  # [S + 1]
        self.coefficients = schedule_coefficients(self.sigmas_device, noise_level=s.noise_level, sde_type=s.sde_type)
        self.constants = step_coefficients(self.sigmas_device[:-1], self.sigmas_device[1:], noise_level=s.noise_level,
                                           sde_type=s.sde_type)  # [S]
        # What the run's loss reads beyond the log-probs: the guards compare the current step means with
        # the sampler's (kept at rollout, one more latent a trained step).
        self.keep_old_means = "old_mean" in self.loss.reads or s.sampler_old_means

    @property
    def with_mean(self) -> bool:
        """Whether the forward computes the step means: for a loss that reads them or a KL (``algo`` as it is
        now: a tool may change the KL between calls)."""
        algo = self.env.cfg.algo
        return "mean" in self.loss.reads or algo.kl_coef > 0 or algo.use_kl_in_reward

    def rollout(self, rows: list[dict], group_size: int) -> tuple[Rollout, list, dict[str, float]]:
        env = self.env
        cfg, s = env.cfg, env.cfg.sampling
        device = env.accelerator.device
        B, G = len(rows), group_size
        N = B * G
        seed = cfg.trainer.seed * 1_000_003 + env.accelerator.process_index * 10_007 + env.step
        generator = torch.Generator().manual_seed(seed)
        # 1. Prompts (and input images): encoded once per row, repeated for the group.
        prompts = [row["prompt"] for row in rows for _ in range(G)]  # [N]
        encoded = env.encode(rows)  # each [B, ...]
        group_ids = torch.arange(B).repeat_interleave(G)  # [N]
        # 2. Initial noise (shared within a group if asked), SDE window and trained steps.
        noise = env.family.noise(B if s.same_noise_per_group else N, env.latent_shape, generator)
        # The window comes from the seed and the step only: every process, and a resumed run, uses the same one.
        w = s.sde_window
        start, stop = window_bounds(env.step, num_steps=s.num_steps, size=w.size, window_range=w.range,
                                    schedule=w.schedule, shift_interval=w.shift_interval, stride=w.stride,
                                    seed=cfg.trainer.seed)
        sigmas, timesteps, stochastic, dpm, coefficients = self._plan(start, stop)
        steps = trained_steps(N, stochastic, s.timestep_fraction, generator, s.timestep_selection)  # [N, T]
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
            cond = env.cond({k: v[lo:hi] for k, v in encoded.items()}, env.train_guidance)
            out = sample_with_logprob(env.family, env.model, noise[lo:hi].to(device), sigmas, timesteps, cond,
                                      guidance_scale=env.train_guidance, noise_level=s.noise_level,
                                      stochastic=stochastic, record=steps[lo:hi], sde_type=s.sde_type,
                                      generator=generator, coefficients=coefficients, start=first, dpm=dpm,
                                      keep_means=self.keep_old_means)
            images += env.sampler.decode_and_queue(out.final, prompts, columns, lo, hi, last=hi == N, futures=futures)
            outs.append(out)
        # 5. Everything training needs to re-evaluate the trained steps.
        sig = sigmas.cpu()

        def joined(parts: list[torch.Tensor]) -> torch.Tensor:  # one chunk (the usual case): no copy
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu()

        tensors = {
            "latents": joined([o.latents for o in outs]),  # [N, T, *latent]
            "next_latents": joined([o.next_latents for o in outs]),  # [N, T, *latent]
            "step_index": steps,  # [N, T]
            "sigma": sig[steps],  # [N, T]
            "sigma_next": sig[steps + 1],  # [N, T]
            "timestep": timesteps.cpu()[steps],  # [N, T]
            **{k: v.cpu() for k, v in encoded.items()},  # the family's conditioning, each [N, ...]
        }
        if self.keep_old_means:
            tensors["old_mean"] = joined([o.means for o in outs])  # [N, T, *latent]: the sampling policy's means
        rollout = Rollout(tensors=tensors, group_ids=group_ids, prompts=prompts, samples=images, columns=columns,
                          old_logp=joined([o.logp for o in outs]))  # [N, T]
        return rollout, futures, {"rollout/window_start": float(start), "rollout/window_size": float(stop - start)}

    def _plan(self, start: int, stop: int) -> tuple:
        """The steps of a rollout whose SDE window is ``[start, stop)``: ``(sigmas [S' + 1], timesteps [S'],
        stochastic [S'], dpm [S'] or None, the steps' constants)`` on the device, S' = S unless
        ``tail_step_ratio`` cuts the steps after the window (the steps up to its end keep their index)."""
        env = self.env
        s, device = env.cfg.sampling, env.accelerator.device
        stochastic = window_mask(s.num_steps, start, stop)  # [S]
        # DPM-Solver++(2M) for the ODE steps after the window (MixGRPO's "post" strategy).
        dpm = torch.arange(s.num_steps) >= stop if s.ode_solver == "dpm2m" else None  # [S]
        sigmas, timesteps = env.train_sigmas.to(device), env.train_timesteps.to(device)
        if s.tail_step_ratio == 1:
            return sigmas, timesteps, stochastic, dpm, self.coefficients
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
        env = self.env
        s, device = env.cfg.sampling, env.accelerator.device
        parts = []
        for lo in range(0, noise.shape[0], s.chunk_size):
            hi = min(lo + s.chunk_size, noise.shape[0])
            cond = env.cond({k: v[lo:hi] for k, v in encoded.items()}, env.train_guidance)
            out = sample_with_logprob(env.family, env.model, noise[lo:hi].to(device), sigmas, timesteps, cond,
                                      guidance_scale=env.train_guidance, noise_level=s.noise_level,
                                      stochastic=stochastic, sde_type=s.sde_type, coefficients=coefficients, stop=stop)
            parts.append(out.final)
        return torch.cat(parts)

    # ------------------------------------------------------------- log-probs
    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """Re-score the trained steps ``columns`` with the stored next latent as the action (gradients flow)."""
        env = self.env
        s = env.cfg.sampling
        stored = batch.cache.get("stored_steps")
        if stored is None:  # once per batch, however many pieces the loop scores it in
            stored = batch.cache["stored_steps"] = self._stored_steps(batch)
        picked = range(*columns.indices(stored["steps"]["sigma"].shape[1]))
        if len(picked) == 1:  # the loop's pieces, one trained step each: views made once per batch
            j = picked[0]
            one = {k: v[j] for k, v in stored["columns"].items()}  # [n, ...]: column j of each
            # The mean only for a KL or a loss that reads it: otherwise nothing does.
            logp, mean, _ = rescore_step(env.family, model, one["latents"], one["next_latents"], one["timestep"],
                                         stored["cond"], stored["coef"][j], guidance_scale=env.train_guidance,
                                         offset=one.get("offset"), with_mean=self.with_mean)
            out = {"logp": logp.unsqueeze(1), "std": stored["narrow"]["std"][j],
                   "sigma": stored["narrow"]["sigma"][j], "sigma_next": stored["narrow"]["sigma_next"][j],
                   "mask": None}  # [n, 1, ...]; no mask: every stored step is trained
            if mean is not None:
                out["mean"] = mean.unsqueeze(1)  # [n, 1, *latent]
            if "old_mean" in one:
                out["old_mean"] = one["old_mean"].unsqueeze(1)  # [n, 1, *latent]
        else:
            t = {k: v[:, columns] for k, v in stored["steps"].items()}  # [n, T', ...]
            # The steps are the rollout's, from the schedule and settings its sampler checked: no check here.
            out = rescore_steps(env.family, model, t["latents"], t["next_latents"], t["sigma"], t["sigma_next"],
                                t["timestep"], stored["cond"], guidance_scale=env.train_guidance, noise_level=s.noise_level,
                                sde_type=s.sde_type, check=False, coefficients=stored["coef"][columns])
            out["sigma"], out["sigma_next"] = t["sigma"], t["sigma_next"]  # [n, T'], for the KL
            if "old_mean" in t:
                out["old_mean"] = t["old_mean"]  # [n, T', *latent]
            out["mask"] = None  # every stored step is trained
        return out

    def _stored_steps(self, batch: Rollout) -> dict:
        """The batch's stored steps on the device (``steps``: latents, next latents [n, T, *latent], float32
        sigmas and timesteps [n, T]), their T columns as views (``columns``: latents, next latents
        [n, *latent], timesteps [n] and the steps' offsets that ``step_log_prob`` takes; ``narrow``: sigmas
        and stds [n, 1]), its conditioning (``cond``) and the columns' constants (``coef``): what each piece
        of ``score_actions`` takes instead of slicing, moving and recomputing them (one operation per tensor for
        the whole batch, not one per piece)."""
        env = self.env
        device = env.accelerator.device
        names = ("latents", "next_latents", "sigma", "sigma_next", "timestep", "old_mean")
        steps = {k: batch.tensors[k].to(device) for k in names if k in batch.tensors}
        steps["sigma"], steps["sigma_next"] = steps["sigma"].float(), steps["sigma_next"].float()
        whole = self._stored_constants(batch, steps)  # [n, T], latent-facing [n, T, 1, ...]
        columns = {k: v.unbind(1) for k, v in steps.items() if k in ("latents", "next_latents", "timestep", "old_mean")}
        if not whole.ode:  # every step's offset x' - a x at once (step_log_prob), not once a piece with gradients on
            columns["offset"] = (steps["next_latents"].float() - steps["latents"].float() * whole.sample_weight).unbind(1)
        n, T = steps["sigma"].shape
        narrow = {k: steps[k].split(1, dim=1) for k in ("sigma", "sigma_next")}
        narrow["std"] = whole.std.reshape(n, T).split(1, dim=1)
        cond = env.cond({k: batch.tensors[k].to(device) for k in env.family.cond_keys}, env.train_guidance)
        return {"steps": steps, "columns": columns, "narrow": narrow, "cond": cond, "coef": whole.unbind(1)}  # coef: T x [n]

    def _stored_constants(self, batch: Rollout, steps: dict[str, torch.Tensor]):
        """The stored steps' ``StepCoefficients`` [n, T] (latent-facing ones [n, T, 1, ...]), gathered from
        the training schedule's by ``step_index``: a dozen operations a batch where computing them from
        the stored sigmas is thirty, with the same numbers (tested). A rollout without ``step_index``
        gets them computed; one whose stored sigmas are not the schedule's at its ``step_index`` fails."""
        env = self.env
        s, latent_ndim = env.cfg.sampling, steps["latents"].ndim - 2
        index = batch.tensors.get("step_index")
        if index is None:
            return step_coefficients(steps["sigma"], steps["sigma_next"], noise_level=s.noise_level,
                                     sde_type=s.sde_type, latent_ndim=latent_ndim)
        sigmas = self.sigmas_device  # [S + 1]
        index = index.to(sigmas.device)  # [n, T]
        if not (torch.equal(sigmas[index], steps["sigma"]) and torch.equal(sigmas[index + 1], steps["sigma_next"])):
            raise ValueError("the rollout's stored sigma / sigma_next are not the training schedule's sigmas at its "
                             "step_index (sampling.num_steps or the scheduler changed since it was sampled?)")
        return self.constants.take(index, latent_ndim)

    def sampled_outputs(self, batch: Rollout) -> dict[str, torch.Tensor] | None:
        """The old policy's outputs the KL in the reward reads (``kl``), as the sampler kept them
        (``sampling.sampler_old_means``): the trainer's own weights sampled, so a re-scoring gives the same."""
        if not self.env.cfg.sampling.sampler_old_means:
            return None
        t = batch.tensors
        return {"logp": batch.old_logp, "mean": t["old_mean"], "sigma": t["sigma"].float(),
                "sigma_next": t["sigma_next"].float()}  # [n, T], [n, T, *latent]

    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        return torch.ones_like(batch.old_logp, dtype=torch.bool)  # [n, T]: every stored step is trained

    def column_slices(self, batch: Rollout) -> list[slice]:
        # One trained step at a time, backward after each (FlowGRPO's order): peak memory holds the
        # graph of one transformer forward, whatever the number of trained steps.
        return [slice(j, j + 1) for j in range(batch.old_logp.shape[1])]

    def kl(self, current: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, T] KL penalty between the policy's and the reference's Gaussian steps (``kl_form``)."""
        env = self.env
        s = env.cfg.sampling
        n, T = current["logp"].shape
        mean = current["mean"].flatten(0, 1)  # [n*T, *latent]
        ref_mean = reference["mean"].to(mean.device).flatten(0, 1)
        kl = step_kl(mean, ref_mean, current["sigma"].flatten(), current["sigma_next"].flatten(),
                     noise_level=s.noise_level, sde_type=s.sde_type, form=env.cfg.kl_form)  # [n*T]
        return kl.view(n, T)
