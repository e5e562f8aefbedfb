"""The FlowGRPO SDE step against re-derivations written here from the formulas, in float64."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from unirl.diffusion.sde import sde_step_with_logprob

SEEDS = [0, 1, 2, 3]
# (sigma, sigma_next) pairs: the first step of a schedule (sigma == 1), middle steps, the last step.
SIGMA_PAIRS = [(1.0, 0.9), (0.8, 0.6), (0.5, 0.45), (0.2, 0.0), (0.05, 0.01)]


def _reference_flow(v, x, sigma, sigma_next, a):
    """FlowGRPO eq. 9 in float64, sigmas as python floats."""
    dt = sigma_next - sigma
    denominator = 1 - (sigma_next if sigma == 1 else sigma)
    s = a * math.sqrt(sigma / denominator)
    mean = x * (1 + s * s / (2 * sigma) * dt) + v * (1 + s * s * (1 - sigma) / (2 * sigma)) * dt
    return mean, s * math.sqrt(-dt)


def _reference_cps(v, x, sigma, sigma_next, a):
    std = sigma_next * math.sin(a * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    return x0 * (1 - sigma_next) + x1 * math.sqrt(max(sigma_next**2 - std**2, 0.0)), std


def _inputs(seed, shape=(3, 4, 6, 6)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sigma,sigma_next", SIGMA_PAIRS)
@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.2])
def test_flow_step_matches_rederivation(seed, sigma, sigma_next, noise_level):
    v, x = _inputs(seed)
    n = x.shape[0]
    prev, log_prob, mean, std = sde_step_with_logprob(
        v, x, torch.full((n,), sigma), torch.full((n,), sigma_next), noise_level=noise_level,
        generator=torch.Generator().manual_seed(100 + seed),
    )
    ref_mean, ref_std = _reference_flow(v.double(), x.double(), sigma, sigma_next, noise_level)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    assert std.shape == (n, 1, 1, 1)
    torch.testing.assert_close(std.double(), torch.full((n, 1, 1, 1), ref_std, dtype=torch.float64), rtol=1e-6, atol=0)
    # The sample is mean + std * (the generator's standard normal draw).
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + seed))
    torch.testing.assert_close(prev, mean + std * noise, rtol=0, atol=0)
    # log_prob is the Gaussian log-density of the returned sample, averaged over non-batch dims.
    expected = torch.distributions.Normal(ref_mean, ref_std).log_prob(prev.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob.double(), expected, rtol=1e-5, atol=1e-4)
    assert prev.dtype == log_prob.dtype == mean.dtype == std.dtype == torch.float32


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sde_type,noise_level", [("flow", 0.7), ("cps", 0.7), ("cps", 1.0)])
def test_rescoring_the_drawn_sample_reproduces_log_prob_exactly(seed, sde_type, noise_level):
    v, x = _inputs(seed)
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.9, 0.5, 0.0])  # one pair per sample
    kwargs = dict(noise_level=noise_level, sde_type=sde_type)
    prev, log_prob, mean, std = sde_step_with_logprob(v, x, sigma, sigma_next, generator=torch.Generator().manual_seed(seed), **kwargs)
    prev2, log_prob2, mean2, std2 = sde_step_with_logprob(v, x, sigma, sigma_next, prev_sample=prev.clone(), **kwargs)
    assert torch.equal(prev2, prev) and torch.equal(log_prob2, log_prob)
    assert torch.equal(mean2, mean) and torch.equal(std2, std)


@pytest.mark.parametrize("seed", SEEDS)
def test_per_sample_sigmas_equal_separate_calls(seed):
    v, x = _inputs(seed)
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.25]), torch.tensor([0.8, 0.3, 0.1])
    prev, log_prob, mean, std = sde_step_with_logprob(v, x, sigma, sigma_next, generator=torch.Generator().manual_seed(seed))
    for i in range(3):
        _, lp_i, mean_i, std_i = sde_step_with_logprob(
            v[i : i + 1], x[i : i + 1], float(sigma[i]), float(sigma_next[i]), prev_sample=prev[i : i + 1]
        )
        torch.testing.assert_close(mean_i, mean[i : i + 1], rtol=0, atol=0)
        torch.testing.assert_close(std_i, std[i : i + 1], rtol=0, atol=0)
        torch.testing.assert_close(lp_i, log_prob[i : i + 1], rtol=1e-6, atol=1e-6)


def test_reduce_sum_is_mean_times_elements():
    v, x = _inputs(0)
    kwargs = dict(sigma=0.6, sigma_next=0.4, generator=torch.Generator().manual_seed(0))
    prev, lp_mean, _, _ = sde_step_with_logprob(v, x, **kwargs)
    _, lp_sum, _, _ = sde_step_with_logprob(v, x, 0.6, 0.4, prev_sample=prev, reduce="sum")
    torch.testing.assert_close(lp_sum, lp_mean * (4 * 6 * 6), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("sde_type", ["flow", "cps"])
def test_noise_level_zero_is_diffusers_euler_over_a_schedule(shift, sde_type):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(8)
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)) / 2
    x_ours = x_ref = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(2))
    for i, t in enumerate(scheduler.timesteps):
        # A velocity that depends on the state, so an error would propagate along the trajectory.
        v_ours = torch.einsum("oc,nchw->nohw", weight, x_ours) * (1 + t / 1000)
        v_ref = torch.einsum("oc,nchw->nohw", weight, x_ref) * (1 + t / 1000)
        x_ref = scheduler.step(v_ref, t, x_ref, return_dict=False)[0]
        x_ours, log_prob, mean, std = sde_step_with_logprob(
            v_ours, x_ours, scheduler.sigmas[i], scheduler.sigmas[i + 1], noise_level=0.0, sde_type=sde_type
        )
        assert torch.equal(x_ours, x_ref), f"step {i}"
        assert torch.equal(mean, x_ours)
        assert torch.count_nonzero(std) == 0 and torch.count_nonzero(log_prob) == 0
    assert scheduler.sigmas[-1] == 0


def test_small_noise_level_approaches_the_ode_step():
    v, x = _inputs(3)
    ode, _, _, _ = sde_step_with_logprob(v, x, 0.7, 0.5, noise_level=0.0)
    _, _, mean, std = sde_step_with_logprob(v, x, 0.7, 0.5, noise_level=1e-3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(mean, ode, rtol=0, atol=1e-5)
    assert 0 < float(std.max()) < 1e-3


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sigma,sigma_next", SIGMA_PAIRS)
@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.0])
def test_cps_step_matches_rederivation(seed, sigma, sigma_next, noise_level):
    v, x = _inputs(seed)
    prev, log_prob, mean, std = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=noise_level, sde_type="cps", generator=torch.Generator().manual_seed(seed)
    )
    ref_mean, ref_std = _reference_cps(v.double(), x.double(), sigma, sigma_next, noise_level)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std.double(), torch.full_like(std.double(), ref_std), rtol=1e-6, atol=1e-7)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(prev, mean + std * noise, rtol=0, atol=0)
    # FlowGRPO's CPS log-prob: -(x - mean)^2 averaged, i.e. the Gaussian log-density with the additive
    # constants dropped and multiplied by 2 std^2.
    torch.testing.assert_close(log_prob.double(), -((prev.double() - ref_mean) ** 2).mean(dim=(1, 2, 3)), rtol=1e-4, atol=1e-6)
    if ref_std > 0:
        gaussian = torch.distributions.Normal(ref_mean, ref_std).log_prob(prev.double()).mean(dim=(1, 2, 3))
        undone = (gaussian + math.log(ref_std) + 0.5 * math.log(2 * math.pi)) * 2 * ref_std**2
        torch.testing.assert_close(log_prob.double(), undone, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("noise_level", [0.0, 0.5, 1.0])
def test_cps_preserves_the_noise_coefficient_for_the_true_velocity(seed, noise_level):
    # With the exact velocity x1 - x0 of x = (1 - sigma) x0 + sigma x1, CPS predicts x0 and x1 exactly and
    # the next latent is (1 - sigma_next) x0 + sigma_next (cos(.) x1 + sin(.) eps): the marginal at sigma_next.
    g = torch.Generator().manual_seed(seed)
    x0, x1 = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64)
    sigma, sigma_next = 0.8, 0.55
    x = (1 - sigma) * x0 + sigma * x1
    prev, _, mean, std = sde_step_with_logprob(
        x1 - x0, x, sigma, sigma_next, noise_level=noise_level, sde_type="cps", generator=torch.Generator().manual_seed(seed)
    )
    angle = noise_level * math.pi / 2
    torch.testing.assert_close(mean.double(), (1 - sigma_next) * x0 + sigma_next * math.cos(angle) * x1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std.double(), torch.full_like(std.double(), sigma_next * math.sin(angle)), rtol=1e-6, atol=1e-7)


def test_low_precision_inputs_are_computed_in_float32():
    v, x = _inputs(5)
    v16, x16 = v.bfloat16(), x.bfloat16()
    prev16, lp16, mean16, std16 = sde_step_with_logprob(v16, x16, 0.9, 0.7, generator=torch.Generator().manual_seed(0))
    prev, lp, mean, std = sde_step_with_logprob(v16.float(), x16.float(), 0.9, 0.7, generator=torch.Generator().manual_seed(0))
    assert {t.dtype for t in (prev16, lp16, mean16, std16)} == {torch.float32}
    assert torch.equal(prev16, prev) and torch.equal(lp16, lp) and torch.equal(mean16, mean)


def test_gradient_reaches_velocity_not_the_scored_sample():
    v, x = _inputs(6)
    v.requires_grad_(True)
    prev = torch.randn_like(x).requires_grad_(True)
    _, log_prob, _, _ = sde_step_with_logprob(v, x, 0.5, 0.3, prev_sample=prev)
    log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert prev.grad is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sigma=1.5, sigma_next=0.5), "sigma must lie"),
        (dict(sigma=0.0, sigma_next=0.0), "sigma must lie"),
        (dict(sigma=0.5, sigma_next=-0.1), "sigma_next must lie"),
        (dict(sigma=0.5, sigma_next=0.5), "sigma_next must be smaller"),
        (dict(sigma=torch.tensor([0.5, 0.4]), sigma_next=0.1), "sigma must be a float or a tensor"),
        (dict(sigma=0.5, sigma_next=torch.zeros(3, 1)), "sigma_next must be a float or a tensor"),
        (dict(sigma=0.5, sigma_next=0.1, noise_level=-0.1), "noise_level"),
        (dict(sigma=0.5, sigma_next=0.1, noise_level=1.5, sde_type="cps"), "noise_level"),
        (dict(sigma=0.5, sigma_next=0.1, sde_type="ddim"), "sde_type"),
        (dict(sigma=0.5, sigma_next=0.1, reduce="max"), "reduce"),
        (dict(sigma=0.5, sigma_next=0.1, prev_sample=torch.zeros(3, 4, 6, 5)), "prev_sample"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(kwargs, match):
    v, x = _inputs(0)
    sigma, sigma_next = kwargs.pop("sigma"), kwargs.pop("sigma_next")
    with pytest.raises(ValueError, match=match):
        sde_step_with_logprob(v, x, sigma, sigma_next, **kwargs)


def test_shape_mismatch_between_velocity_and_sample_raises():
    v, x = _inputs(0)
    with pytest.raises(ValueError, match="velocity"):
        sde_step_with_logprob(v[:, :2], x, 0.5, 0.3)
    with pytest.raises(ValueError, match="sample must be a tensor"):
        sde_step_with_logprob(v, x[0, 0, 0], 0.5, 0.3)


def test_gaussian_noise_draws_what_diffusers_randn_tensor_draws():
    """The SDE step's noise: a single generator served directly, the same numbers as diffusers' helper
    (and the same next draw after it), a list of generators through the helper."""
    from diffusers.utils.torch_utils import randn_tensor

    from unirl.diffusion.sde import gaussian_noise

    for seed in (0, 1, 2):
        for shape in ((4, 3, 5, 5), (2, 7, 16), (1, 4)):
            a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            for _ in range(2):  # twice: the generators advance alike
                assert torch.equal(gaussian_noise(shape, a, torch.device("cpu")),
                                   randn_tensor(shape, generator=b, device=torch.device("cpu"), dtype=torch.float32))
            listed = [torch.Generator().manual_seed(seed + k) for k in range(shape[0])]
            again = [torch.Generator().manual_seed(seed + k) for k in range(shape[0])]
            assert torch.equal(gaussian_noise(shape, listed, torch.device("cpu")),
                               randn_tensor(shape, generator=again, device=torch.device("cpu"), dtype=torch.float32))
