"""MixGRPO (https://arxiv.org/abs/2507.21802): the sliding SDE window over training, and DPM-Solver++(2M)
for the deterministic steps after it, on the toy SD3 (real diffusers classes).

The window's rule is re-typed here from MixGRPO's ``GRPOTrainingStates`` (``fastvideo/utils/grpo_states.py``):
a mutable position advanced once per training step, against which ``window_bounds``' closed form (a
function of the step alone) is checked. The solver is checked against diffusers'
``DPMSolverMultistepScheduler`` in the flow-matching configuration MixGRPO-Flash uses.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from test_diffusion_env import make_env, perturb_lora, tiny_sd3_dir  # noqa: F401  (the fixture)
from unirl.diffusion.dpm_solver import data_prediction, dpm_solver_pp_step
from unirl.diffusion.sampling import guided_velocity, sample_with_logprob
from unirl.diffusion.window import kept_steps, window_bounds, window_mask


def mixgrpo_windows(steps: int, lo: int, hi: int, size: int, interval: int, stride: int) -> list[tuple[int, int]]:
    """MixGRPO's progressive strategy with ``--prog_overlap --roll_back``, step by step: the window of an
    iteration is read before the position is advanced (its training loop calls ``get_current_timesteps``,
    then ``update_iteration``). One change, documented in ``unirl/diffusion/window.py``: the position rolls
    back when it reaches ``hi`` (an empty window), where MixGRPO rolls back when it passes ``hi``."""
    cur, in_group, out = lo, 0, []
    for _ in range(steps):
        out.append((cur, min(cur + size, hi)))
        in_group += 1
        if in_group >= interval:
            in_group = 0
            cur += stride
        if cur >= hi:
            cur = lo
    return out


@pytest.mark.parametrize("num_steps,lo,hi,size,interval,stride", [
    (25, 0, 23, 4, 25, 1),  # MixGRPO's script: 25 steps, max_timesteps = 25 - 2, window 4, shift every 25
    (25, 0, 23, 4, 20, 1),  # MixGRPO-Flash
    (25, 0, 23, 4, 20, 0),  # MixGRPO-Flash*: the window stays at the start
    (10, 0, 8, 4, 3, 4),  # without --prog_overlap: moves by its own size
    (8, 2, 7, 2, 1, 2),  # a range that starts later, a shift every step
    (8, 0, 6, 2, 5, 3),  # a stride that does not divide the range
])
def test_progressive_window_follows_mixgrpos_rule_over_training(num_steps, lo, hi, size, interval, stride):
    expected = mixgrpo_windows(700, lo, hi, size, interval, stride)
    got = [window_bounds(step, num_steps=num_steps, size=size, window_range=(lo, hi), schedule="progressive",
                         shift_interval=interval, stride=stride, seed=step % 3) for step in range(700)]
    assert got == expected
    assert all(start < stop for start, stop in got)  # never an empty window


def test_progressive_window_by_hand():
    # 8 steps, window 3 in [0, 6), one position per 2 training steps, stride 2: starts 0, 2, 4 (cut to [4, 6)), 0, ...
    got = [window_bounds(s, num_steps=8, size=3, window_range=(0, 6), schedule="progressive", shift_interval=2,
                         stride=2) for s in range(8)]
    assert got == [(0, 3), (0, 3), (2, 5), (2, 5), (4, 6), (4, 6), (0, 3), (0, 3)]
    assert window_mask(8, 4, 6).tolist() == [False] * 4 + [True, True, False, False]


def test_random_window_is_the_seeded_uniform_draw():
    for seed in range(3):
        got = [window_bounds(step, num_steps=10, size=3, window_range=(2, 8), seed=seed) for step in range(300)]
        draws = [random.Random(seed * 7_919 + step).randint(2, 5) for step in range(300)]  # uniform in [lo, hi - size]
        assert got == [(d, d + 3) for d in draws]
        assert {start for start, _ in got} == {2, 3, 4, 5}
    assert window_bounds(5, num_steps=6, size=0) == (0, 6)  # no window: every step
    with pytest.raises(ValueError, match="does not fit"):
        window_bounds(0, num_steps=6, size=4, window_range=(0, 3))


def test_rollouts_use_the_window_of_their_step(tiny_sd3_dir):
    env = make_env(tiny_sd3_dir, "sampling.sde_window.size=2", "sampling.sde_window.range=[0,5]",
                   "sampling.sde_window.schedule=progressive", "sampling.sde_window.shift_interval=1",
                   "sampling.sde_window.stride=2", "sampling.guidance_scale=1.0")
    for step, (start, stop) in enumerate([(0, 2), (2, 4), (4, 5), (0, 2)]):
        rollout = env.sampler.rollout(env.prompts.next(step), group_size=4)
        _, metrics = env.scorer.score(rollout)
        assert rollout.tensors["step_index"][0].tolist() == list(range(start, stop))
        assert metrics["rollout/window_start"] == start and metrics["rollout/window_size"] == stop - start
    env.close()


# ------------------------------------------------------------------------------------------ solver
def _diffusers_dpm(num_steps: int):
    from diffusers import DPMSolverMultistepScheduler

    # MixGRPO-Flash: dpmsolver++, order 2, midpoint, flow sigmas with shift 3; first order at the last step.
    scheduler = DPMSolverMultistepScheduler(num_train_timesteps=1000, algorithm_type="dpmsolver++", solver_order=2,
                                            solver_type="midpoint", prediction_type="flow_prediction",
                                            use_flow_sigmas=True, flow_shift=3.0, lower_order_final=True,
                                            final_sigmas_type="zero")
    scheduler.set_timesteps(num_steps)
    return scheduler


def _cond(env, n):
    prompts = ["a red cat", "a blue dog", "a green car"][:n]
    with torch.no_grad():
        encoded = env.family.encode(env.pipe, prompts, max_sequence_length=16, device="cpu")
    return encoded


@pytest.mark.parametrize("num_steps", [4, 7, 12])
@pytest.mark.parametrize("seed", [0, 1])
def test_dpm_solver_matches_diffusers_dpm_multistep_on_the_toy_pipeline(tiny_sd3_dir, num_steps, seed):
    env = make_env(tiny_sd3_dir, "sampling.guidance_scale=1.0")
    perturb_lora(env, seed=seed)
    scheduler = _diffusers_dpm(num_steps)
    sigmas = scheduler.sigmas.float()  # [S + 1], ending in 0
    timesteps = scheduler.timesteps.float()  # [S], what the transformer is conditioned on, in both loops
    noise = torch.randn(3, *env.latent_shape, generator=torch.Generator().manual_seed(seed))
    cond = _cond(env, 3)
    with torch.no_grad():
        x = noise.clone()
        for t in timesteps:  # diffusers' loop: its scheduler keeps the multistep history
            v = guided_velocity(env.family, env.model, x, t.expand(3), cond, 1.0)
            x = scheduler.step(v, t, x, return_dict=False)[0]
        ours = sample_with_logprob(env.family, env.model, noise, sigmas, timesteps, cond, guidance_scale=1.0,
                                   noise_level=0.7, stochastic=torch.zeros(num_steps, dtype=torch.bool),
                                   dpm=torch.ones(num_steps, dtype=torch.bool)).final
        euler = sample_with_logprob(env.family, env.model, noise, sigmas, timesteps, cond, guidance_scale=1.0,
                                    noise_level=0.7, stochastic=torch.zeros(num_steps, dtype=torch.bool)).final
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)
    assert (euler - x).abs().max() > 1e-3  # a different solver: the comparison could fail
    env.close()


def _retyped_dpm(x, m0, m1, sigma_s1, sigma_s0, sigma_t):
    """DPM-Solver++(2M), midpoint, in the log-SNR form (Lu et al. 2022, Algorithm 2; diffusers'
    ``multistep_dpm_solver_second_order_update``), for a flow model: alpha = 1 - sigma; m1 None: first order."""
    lam = lambda s: math.log(1 - s) - math.log(s)  # noqa: E731
    h = lam(sigma_t) - lam(sigma_s0)
    first = (sigma_t / sigma_s0) * x - (1 - sigma_t) * (math.exp(-h) - 1) * m0
    if m1 is None:
        return first
    r0 = (lam(sigma_s0) - lam(sigma_s1)) / h
    d1 = (m0 - m1) / r0
    return first - 0.5 * (1 - sigma_t) * (math.exp(-h) - 1) * d1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dpm_step_matches_the_retyped_formula(seed):
    g = torch.Generator().manual_seed(seed)
    x, m0, m1 = (torch.randn(2, 4, 3, 3, generator=g) for _ in range(3))
    s1, s0, t = sorted(torch.rand(3, generator=g).mul(0.9).add(0.05).tolist(), reverse=True)
    torch.testing.assert_close(dpm_solver_pp_step(x, m0, s0, t, prev_x0=m1, prev_sigma=s1),
                               _retyped_dpm(x, m0, m1, s1, s0, t), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dpm_solver_pp_step(x, m0, s0, t), _retyped_dpm(x, m0, None, s1, s0, t),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(dpm_solver_pp_step(x, m0, s0, 0.0, prev_x0=m1, prev_sigma=s1), m0)  # last step: x0
    v = torch.randn(2, 4, 3, 3, generator=g)
    # From pure noise (sigma = 1) the first-order step is Euler's x + (sigma_next - 1) v.
    torch.testing.assert_close(dpm_solver_pp_step(x, data_prediction(x, v, 1.0), 1.0, t), x + (t - 1) * v)


@pytest.mark.parametrize("seed", [0, 1])
def test_steps_after_the_window_continue_from_its_last_data_prediction(tiny_sd3_dir, seed):
    """MixGRPO's "post" plan: Euler before the window, FlowGRPO SDE steps in it, DPM-Solver++(2M) after it,
    whose first step is already second order with the window's last step as its history."""
    env = make_env(tiny_sd3_dir, "sampling.guidance_scale=1.0", "sampling.sde_window.size=2")
    perturb_lora(env, seed=seed)
    sigmas, timesteps = env.train_sigmas, env.train_timesteps  # 6 steps, the toy scheduler's shift 3
    S, stop = len(timesteps), 3
    stochastic = window_mask(S, 1, stop)
    dpm = torch.arange(S) >= stop
    noise = torch.randn(2, *env.latent_shape, generator=torch.Generator().manual_seed(seed))
    cond = _cond(env, 2)
    with torch.no_grad():
        out = sample_with_logprob(env.family, env.model, noise, sigmas, timesteps, cond, guidance_scale=1.0,
                                  noise_level=0.7, stochastic=stochastic, dpm=dpm,
                                  generator=torch.Generator().manual_seed(7))
        # The same SDE draws up to the window's end, then the re-typed solver step by step.
        x = sample_with_logprob(env.family, env.model, noise, sigmas, timesteps, cond, guidance_scale=1.0,
                                noise_level=0.7, stochastic=stochastic, stop=stop - 1,
                                generator=torch.Generator().manual_seed(7)).final  # at sigma[stop - 1]
        s = sigmas.tolist()
        prev = None
        for i in range(stop - 1, S):
            v = guided_velocity(env.family, env.model, x, timesteps[i].expand(2), cond, 1.0)
            m0 = x - s[i] * v
            if i == stop - 1:  # the window's last SDE step, with the generator's state where the sampler had it
                gen = torch.Generator().manual_seed(7)
                x = sample_with_logprob(env.family, env.model, noise, sigmas, timesteps, cond, guidance_scale=1.0,
                                        noise_level=0.7, stochastic=stochastic, stop=stop, generator=gen).final
            elif s[i + 1] == 0:
                x = m0  # first order at the last step
            else:
                x = _retyped_dpm(x, m0, prev, s[i - 1], s[i], s[i + 1])
            prev = m0
    torch.testing.assert_close(out.final, x, rtol=1e-5, atol=1e-5)
    env.close()


# ------------------------------------------------------------------------------ the compressed tail
def mixgrpo_post_sigmas(num_steps: int, last: int, ratio: float, shift: float = 3.0) -> torch.Tensor:
    """MixGRPO-Flash's schedule (``run_sample_step``, ``dpm_apply_strategy="post"``) re-typed: the shifted
    linear schedule up to the window's last step ``last``, then ``int((S - last) * ratio)`` points
    re-spaced linearly in unshifted time from the window's end to 0, shifted."""
    shifted = lambda t: shift * t / (1 + (shift - 1) * t)  # noqa: E731  (sd3_time_shift)
    full = shifted(torch.linspace(1, 0, num_steps + 1, dtype=torch.float64))
    points = int(max((num_steps - last) * ratio, 1))
    start = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)[last + 1].item()
    return torch.cat([full[:last + 1], shifted(torch.linspace(start, 0, points, dtype=torch.float64))])


@pytest.mark.parametrize("num_steps,stop,ratio", [(25, 4, 0.4), (25, 10, 0.4), (25, 4, 0.2), (16, 7, 0.5), (10, 4, 1.0)])
def test_kept_steps_are_mixgrpo_flashs_compressed_schedule(num_steps, stop, ratio):
    shifted = lambda t: 3.0 * t / (1 + 2.0 * t)  # noqa: E731
    sigmas = shifted(torch.linspace(1, 0, num_steps + 1, dtype=torch.float64))  # a schedule linear in unshifted time
    keep = kept_steps(num_steps, stop, ratio)
    expected = mixgrpo_post_sigmas(num_steps, stop - 1, ratio)
    assert len(keep) == len(expected)
    assert keep[:stop + 1] == list(range(stop + 1)) and keep[-1] == num_steps
    if (num_steps - stop) % (len(keep) - stop - 1) == 0:  # evenly divisible: the same sigmas
        torch.testing.assert_close(sigmas[keep], expected, rtol=0, atol=1e-12)
    else:  # otherwise within one original step of MixGRPO's
        gap = (sigmas[:-1] - sigmas[1:]).max()
        assert (sigmas[keep] - expected).abs().max() <= gap


def test_a_compressed_rollout_runs_fewer_steps_and_stays_on_policy(tiny_sd3_dir):
    env = make_env(tiny_sd3_dir, "sampling.guidance_scale=1.0", "sampling.sde_window.size=2",
                   "sampling.sde_window.range=[1,3]", "sampling.same_noise_per_group=true", "sampling.branch_prefix=true",
                   "sampling.ode_solver=dpm2m", "sampling.tail_step_ratio=0.5")
    perturb_lora(env)
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    _, metrics = env.scorer.score(rollout)
    # 6 steps, window [1, 3): the 3 steps after it become int(4 * 0.5) - 1 = 1; the prefix step runs per prompt.
    assert kept_steps(6, 3, 0.5) == [0, 1, 2, 3, 6]
    assert metrics["rollout/transformer_calls"] == 2 * 1 + 8 * (2 + 1)
    with torch.no_grad():
        cur = env.actions.score_actions(env.model, rollout)
    assert torch.equal(cur["logp"], rollout.old_logp)
    env.close()
