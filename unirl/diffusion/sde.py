"""One denoising step of a flow-matching sampler as a Gaussian policy, with its log-probability.

FlowGRPO (Liu et al., 2025, https://arxiv.org/abs/2505.05470) turns the deterministic Euler ODE of a
rectified-flow model into an SDE with the same marginals, so that each denoising step
``x_t -> x_{t+dt}`` is a Gaussian ``N(mean, std^2)`` whose log-density can enter a PPO/GRPO ratio.

Conventions (sigma is the noise level of the flow, ``x_sigma = (1 - sigma) x_0 + sigma x_1``; sampling
runs from ``sigma = 1`` (noise) to ``sigma = 0`` (data); ``dt = sigma_next - sigma < 0``):

* ``sde_type="flow"``: FlowGRPO's SDE (paper eq. 9, code ``sd3_sde_with_logprob.py``)::

      s    = noise_level * sqrt(sigma / (1 - sigma))      (at sigma == 1: sqrt(1 / (1 - sigma_next)))
      mean = x * (1 + s^2 / (2 sigma) * dt) + v * (1 + s^2 (1 - sigma) / (2 sigma)) * dt
      std  = s * sqrt(-dt)

  ``log_prob`` is the exact Gaussian log-density of the next sample.
* ``sde_type="cps"``: coefficient-preserving sampling, added to FlowGRPO after the paper::

      std  = sigma_next * sin(noise_level * pi / 2)
      x0   = x - sigma * v,   x1 = x + (1 - sigma) * v           (predicted data and noise)
      mean = x0 * (1 - sigma_next) + x1 * sqrt(sigma_next^2 - std^2)

  ``log_prob`` follows FlowGRPO's code, which "removes all constants": ``-(x_next - mean)^2``. That
  drops the additive ``-log(std) - log(2 pi) / 2`` (model-independent, cancels in a ratio) **and** the
  ``1 / (2 std^2)`` factor (it does not cancel: a ratio ``exp(lp - lp_old)`` is the Gaussian ratio
  raised to the power ``2 std^2``, a per-step temperature). ``noise_level`` must lie in [0, 1].

``step_kl`` is the KL penalty between the policy's and the reference's step (FlowGRPO's form by
default, the exact Gaussian KL as an option).

``noise_level = 0`` is the deterministic Euler ODE step ``x + dt * v`` for both types (the same update
as diffusers' ``FlowMatchEulerDiscreteScheduler.step``), with ``std = 0``; a point mass has no density,
so ``log_prob`` is *defined* as 0 there (such steps are never trained).

Everything is computed in float32 whatever the input dtype (bf16 overflows in the mean, as FlowGRPO
notes), and the returned tensors are float32. Shapes: N = B*G samples, each ``[C, h, w]`` (any trailing
shape works); ``log_prob`` is reduced over all non-batch dimensions (``"mean"``, FlowGRPO's choice, or
``"sum"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch
from diffusers.utils.torch_utils import randn_tensor

from unirl.core import gaussian_kl

SDE_TYPES = ("flow", "cps")
REDUCTIONS = ("mean", "sum")


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    sde_type: str = "flow",
    reduce: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Take (or score) one step ``sigma -> sigma_next`` of the sampling SDE.

    Args:
        velocity: ``[N, ...]`` model output ``v = x_1 - x_0`` at ``sample`` (after guidance).
        sample: ``[N, ...]`` current latent ``x_sigma``.
        sigma, sigma_next: ``[N]`` tensors (one noise level per sample) or python floats / 0-d
            tensors shared by the batch; ``0 <= sigma_next < sigma <= 1``.
        noise_level: FlowGRPO's ``a`` (flow) or the CPS angle fraction; ``0`` gives the ODE step.
        prev_sample: ``[N, ...]`` the next latent to score instead of drawing one (training
            re-evaluates a stored step this way). It is detached: gradients reach ``log_prob`` only
            through ``mean``, i.e. through ``velocity``.
        generator: torch generator(s) for the Gaussian noise when ``prev_sample`` is None.
        sde_type: ``"flow"`` or ``"cps"`` (see the module docstring).
        reduce: ``"mean"`` or ``"sum"`` of the per-element log-density over non-batch dimensions.

    Returns:
        ``(prev_sample [N, ...], log_prob [N], mean [N, ...], std [N, 1, ..., 1])``, all float32.
        ``std`` is the standard deviation of the step itself (``s * sqrt(-dt)`` for ``"flow"``), so a
        KL between two policies at the same step is ``||mean_a - mean_b||^2 / (2 std^2)``.
    """
    # 1. Check inputs.
    check_step_inputs(velocity, sample, prev_sample, noise_level, sde_type, reduce)
    n = sample.shape[0]
    sigma = per_sample_sigma(sigma, "sigma", n, sample)  # [N, 1, ..., 1]
    sigma_next = per_sample_sigma(sigma_next, "sigma_next", n, sample)  # [N, 1, ..., 1]
    check_sigmas(sigma, sigma_next)
    # 2. The step's constants, then the step.
    coef = step_coefficients(sigma.flatten(), sigma_next.flatten(), noise_level=noise_level, sde_type=sde_type,
                             latent_ndim=sample.ndim - 1)
    return sde_step(velocity, sample, coef, prev_sample=prev_sample, generator=generator, reduce=reduce)


@dataclass(frozen=True)
class StepCoefficients:
    """The constants of Gaussian steps ``sigma -> sigma_next``, float32, for steps of any shape
    ``lead``: ``[N]`` for one step of N samples, ``[S]`` for a whole schedule, ``[n, T]`` for stored
    steps, 0-d for one step shared by a batch (``unbind`` gives those of a schedule's steps).

    ``mean = sample_weight * x + velocity_weight * v`` (the module docstring's formulas, with the
    sigma terms gathered into the two weights), ``std`` the step's std: these, and ``dt``, are shaped
    ``lead`` followed by one 1 per latent dimension, to broadcast against ``[*lead, *latent]``. For
    ``"flow"`` the log-density is ``||x' - mean||^2 * neg_inv_two_var + count * neg_log_norm`` with
    those two ``lead``-shaped. The ODE step (``noise_level == 0``) keeps only ``dt``: its mean is
    ``x + dt * v``, diffusers' Euler step.
    """

    sde_type: str
    ode: bool
    dt: torch.Tensor  # sigma_next - sigma, negative
    std: torch.Tensor  # the step's std (0 for the ODE step)
    sample_weight: torch.Tensor | None = None
    velocity_weight: torch.Tensor | None = None
    neg_inv_two_var: torch.Tensor | None = None  # -1 / (2 std^2), flow only
    neg_log_norm: torch.Tensor | None = None  # -(log std + log sqrt(2 pi)), flow only

    def unbind(self, dim: int = 0) -> list["StepCoefficients"]:
        """The steps along ``dim`` (of ``lead``), one object each, as views: one operation per
        constant whatever the number of steps, where indexing step by step costs one per step."""
        names = ("dt", "std", "sample_weight", "velocity_weight", "neg_inv_two_var", "neg_log_norm")
        columns = [None if getattr(self, k) is None else getattr(self, k).unbind(dim) for k in names]
        count = self.dt.shape[dim]
        return [StepCoefficients(self.sde_type, self.ode, *(None if c is None else c[i] for c in columns))
                for i in range(count)]

    def take(self, index: torch.Tensor, latent_ndim: int = 0) -> "StepCoefficients":
        """The constants of the steps ``index`` (a long tensor of any shape ``lead``, on these constants'
        device) of a schedule's ``[S]`` constants (``step_coefficients`` with ``latent_ndim=0``), the
        latent-facing ones followed by ``latent_ndim`` 1s. The numbers ``step_coefficients`` gives for
        those steps' sigmas (it does the same operations element by element; tested bit for bit), in
        one indexing per constant instead of the two dozen operations of computing them."""
        if self.dt.ndim != 1:
            raise ValueError(f"take needs a schedule's constants [S], got dt of shape {tuple(self.dt.shape)}")
        ones = (1,) * latent_ndim

        def gathered(t: torch.Tensor | None, latent_facing: bool) -> torch.Tensor | None:
            if t is None:
                return None
            picked = t[index]  # [*lead]
            return picked.reshape(*picked.shape, *ones) if latent_facing and latent_ndim else picked

        return StepCoefficients(self.sde_type, self.ode, gathered(self.dt, True), gathered(self.std, True),
                                gathered(self.sample_weight, True), gathered(self.velocity_weight, True),
                                gathered(self.neg_inv_two_var, False), gathered(self.neg_log_norm, False))


def step_coefficients(sigma: torch.Tensor, sigma_next: torch.Tensor, *, noise_level: float,
                      sde_type: str = "flow", latent_ndim: int = 0) -> StepCoefficients:
    """``StepCoefficients`` of the steps ``sigma -> sigma_next`` (float32 tensors of one shape
    ``lead``, already checked: ``check_sigmas``), the latent-facing ones followed by ``latent_ndim``
    1s. Computed once for many steps, so that each step only does the latent-sized work. Element by
    element the same operations whatever the shape, so the constants of a whole schedule taken at
    step i equal those computed for step i alone (tested bit for bit)."""
    ones = (1,) * latent_ndim

    def latent_facing(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape, *ones) if latent_ndim else t

    dt = sigma_next - sigma
    if noise_level == 0:
        return StepCoefficients(sde_type=sde_type, ode=True, dt=latent_facing(dt), std=latent_facing(torch.zeros_like(sigma)))
    s, std = sde_diffusion_coefficient(sigma, sigma_next, noise_level=noise_level, sde_type=sde_type)
    if sde_type == "flow":
        # FlowGRPO eq. 9 (s is sigma_t of the SDE, std = s sqrt(|dt|) the step's std).
        sample_weight = 1 + s**2 / (2 * sigma) * dt
        velocity_weight = (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
        return StepCoefficients(sde_type=sde_type, ode=False, dt=latent_facing(dt), std=latent_facing(std),
                                sample_weight=latent_facing(sample_weight), velocity_weight=latent_facing(velocity_weight),
                                neg_inv_two_var=-(1 / (2 * std**2)), neg_log_norm=-(torch.log(std) + math.log(math.sqrt(2 * math.pi))))
    # Coefficient-preserving: the next latent is (1 - sigma_next) x0 + sigma_next * (unit noise), split
    # between the predicted noise x1 = x + (1 - sigma) v and fresh noise so that their squared weights
    # sum to sigma_next^2; with x0 = x - sigma v the mean is linear in x and v.
    keep = torch.sqrt((sigma_next**2 - std**2).clamp_min(0))  # weight of x1
    return StepCoefficients(sde_type=sde_type, ode=False, dt=latent_facing(dt), std=latent_facing(std),
                            sample_weight=latent_facing((1 - sigma_next) + keep),
                            velocity_weight=latent_facing(keep * (1 - sigma) - sigma * (1 - sigma_next)))


def sde_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    coef: StepCoefficients,
    *,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    reduce: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sde_step_with_logprob`` without its checks and with its constants given, for loops that
    check their inputs once and compute the constants of all their steps at once.

    ``coef`` (``step_coefficients``) must hold this step's constants, ``[N]`` (latent-facing ones
    ``[N, 1, ..., 1]``) or 0-d (one step shared by the batch), from sigmas checked by
    ``check_sigmas``, and the other arguments must be valid (``check_step_inputs``): the sampler
    checks its whole schedule before the first step, the re-scoring all stored steps at once, instead
    of paying three host syncs and a dozen small operations at every step. ``sde_step_with_logprob``
    calls this, so results are identical. Returns what ``sde_step_with_logprob`` returns (``std``
    shaped like ``coef.std``).
    """
    n = sample.shape[0]
    # Upcast: the mean overflows in bf16.
    velocity = velocity.float()  # [N, ...]
    sample = sample.float()  # [N, ...]
    if prev_sample is not None:
        prev_sample = prev_sample.detach().float()  # [N, ...]

    # noise_level 0: the Euler ODE step, written as diffusers writes it so the two agree bit for bit.
    if coef.ode:
        mean = sample + coef.dt * velocity  # [N, ...]
        if prev_sample is None:
            prev_sample = mean
        return prev_sample, torch.zeros(n, device=sample.device), mean, coef.std

    # The Gaussian step's mean; draw the next sample unless it was given.
    scaled = sample * coef.sample_weight  # [N, ...]
    mean = torch.addcmul(scaled, velocity, coef.velocity_weight)  # [N, ...]: x a + v b
    if prev_sample is None:
        noise = gaussian_noise(sample.shape, generator, sample.device)  # [N, ...]
        prev_sample = noise.mul_(coef.std).add_(mean)  # [N, ...]: mean + std * noise, in the noise's memory
    log_prob = step_log_prob(velocity, prev_sample - scaled, coef, reduce=reduce)
    return prev_sample, log_prob, mean, coef.std


def gaussian_noise(shape: tuple[int, ...], generator: torch.Generator | list[torch.Generator] | None,
                   device: torch.device) -> torch.Tensor:
    """Standard normal float32 noise of ``shape`` on ``device``, the numbers diffusers' ``randn_tensor``
    draws (tested): a single generator draws on its own device (a CPU generator on the CPU, then the
    tensor moves), a list of generators one sample each. A single generator is served here directly:
    the helper's device checks (and its log line for a CPU generator beside a GPU) are Python at every
    SDE step."""
    if isinstance(generator, torch.Generator):
        noise = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
        return noise if noise.device == device else noise.to(device)
    return randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)


def step_log_prob(velocity: torch.Tensor, offset: torch.Tensor, coef: StepCoefficients, *, reduce: str = "mean"
                  ) -> torch.Tensor:
    """Log-density ``[N]`` of a Gaussian step's next latent ``x'`` given ``offset = x' - sample_weight * x``,
    the part of ``x' - mean`` that does not depend on the model: ``x' - mean = offset - velocity_weight
    * v``. ``sde_step`` computes it so, and a loop re-scoring stored steps computes every step's offset
    at once (one operation for all of them, no gradient) and leaves two of the six operations per step
    that carry gradients, with the same bits as ``sde_step``'s (tested). ``coef`` must be an SDE
    step's (not ``ode``); ``velocity`` float32, as ``sde_step`` makes it.

    FlowGRPO's per-element ``-(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)``, reduced over the
    non-batch dimensions. std is constant per sample, so the squared distance is reduced first and
    the per-sample terms applied after (equal to float32 rounding)."""
    diff = torch.addcmul(offset, velocity, coef.velocity_weight, value=-1)  # [N, ...]: x' - mean
    reduce_dims = tuple(range(1, diff.ndim))
    sq = diff.square()  # [N, ...]
    sq = sq.mean(dim=reduce_dims) if reduce == "mean" else sq.sum(dim=reduce_dims)  # [N]
    if coef.sde_type != "flow":
        return -sq  # FlowGRPO's CPS convention, see the module docstring
    if reduce == "mean":
        return torch.addcmul(coef.neg_log_norm, sq, coef.neg_inv_two_var)  # [N]
    return torch.addcmul(math.prod(diff.shape[1:]) * coef.neg_log_norm, sq, coef.neg_inv_two_var)  # [N]


def check_step_inputs(velocity, sample, prev_sample, noise_level, sde_type, reduce) -> None:
    """The argument checks of ``sde_step_with_logprob`` other than the sigmas'."""
    for name, value in (("velocity", velocity), ("sample", sample)):
        if not isinstance(value, torch.Tensor) or value.ndim < 2:
            raise ValueError(f"{name} must be a tensor [N, ...] with at least 2 dimensions, got {_describe(value)}")
    if velocity.shape != sample.shape:
        raise ValueError(f"velocity {tuple(velocity.shape)} and sample {tuple(sample.shape)} must have the same shape")
    if prev_sample is not None and (not isinstance(prev_sample, torch.Tensor) or prev_sample.shape != sample.shape):
        raise ValueError(f"prev_sample {_describe(prev_sample)} must have the shape of sample {tuple(sample.shape)}")
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not isinstance(noise_level, Real) or not math.isfinite(noise_level) or noise_level < 0:
        raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level!r}")
    if sde_type == "cps" and noise_level > 1:
        raise ValueError(f"noise_level must lie in [0, 1] for sde_type='cps' (an angle fraction), got {noise_level!r}")


def per_sample_sigma(value, name: str, n: int, sample: torch.Tensor) -> torch.Tensor:
    """A float, 0-d or ``[N]`` sigma as a float32 ``[N, 1, ..., 1]`` tensor on ``sample``'s device."""
    if isinstance(value, Real) and not isinstance(value, bool):
        value = torch.tensor(float(value))
    if not isinstance(value, torch.Tensor) or value.ndim > 1 or (value.ndim == 1 and value.shape[0] != n):
        raise ValueError(f"{name} must be a float or a tensor [N] with N = {n} (the batch of sample), got {_describe(value)}")
    value = value.to(device=sample.device, dtype=torch.float32).expand(n)  # [N]
    return value.view(n, *([1] * (sample.ndim - 1)))


def check_sigmas(sigma: torch.Tensor, sigma_next: torch.Tensor) -> None:
    """Raise unless ``0 <= sigma_next < sigma <= 1`` elementwise (bad sigmas give silent NaNs).

    One host sync when they are valid (the three conditions imply ``sigma > 0`` and ``sigma_next < 1``;
    NaN fails them); loops call it once for all their steps (``sde_step``), not per step."""
    if bool(((sigma <= 1) & (sigma_next >= 0) & (sigma_next < sigma)).all()):
        return
    if not bool(((sigma > 0) & (sigma <= 1)).all()):
        raise ValueError(f"sigma must lie in (0, 1], got {sigma.flatten().tolist()}")
    if not bool(((sigma_next >= 0) & (sigma_next < 1)).all()):
        raise ValueError(f"sigma_next must lie in [0, 1), got {sigma_next.flatten().tolist()}")
    if not bool((sigma_next < sigma).all()):
        raise ValueError(
            f"sigma_next must be smaller than sigma (sampling runs from noise to data), "
            f"got sigma={sigma.flatten().tolist()}, sigma_next={sigma_next.flatten().tolist()}"
        )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return repr(value)


KL_FORMS = ("flowgrpo", "exact")


def sde_diffusion_coefficient(
    sigma: torch.Tensor | float, sigma_next: torch.Tensor | float, *, noise_level: float = 0.7, sde_type: str = "flow"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, step_std)`` of the step ``sigma -> sigma_next``, each ``[N]`` (or 0-d for float sigmas).

    ``s`` is what FlowGRPO's ``sde_step_with_logprob`` returns as ``std_dev_t``: for ``"flow"`` the
    SDE's diffusion coefficient ``noise_level * sqrt(sigma / (1 - sigma))`` (the next sigma in the
    denominator at sigma == 1) *without* the ``sqrt(|dt|)`` of the step; for ``"cps"`` the step's
    std ``sigma_next * sin(noise_level * pi / 2)`` itself. ``step_std`` is the std of the Gaussian step
    (``s * sqrt(|dt|)`` for flow, ``s`` for cps), as ``sde_step_with_logprob`` returns it.
    """
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=sigma.device)
    if sde_type == "flow":
        # At sigma == 1 the ratio sigma / (1 - sigma) is infinite; FlowGRPO uses the next sigma in the
        # denominator there (``torch.where(sigma == 1, sigma_max, sigma)``).
        s = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_next, sigma))) * noise_level
        return s, s * torch.sqrt(sigma - sigma_next)
    if sde_type == "cps":
        s = sigma_next * math.sin(noise_level * math.pi / 2)
        return s, s
    raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")


def step_kl(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float = 0.7,
    sde_type: str = "flow",
    form: str = "flowgrpo",
) -> torch.Tensor:
    """KL penalty ``[N]`` between the policy's and the reference's Gaussian steps ``sigma -> sigma_next``.

    Both steps share their std and differ in the mean, so every form is
    ``mean over non-batch dims of (mean - ref_mean)^2 / (2 d^2)`` (through ``unirl.core.gaussian_kl``)
    with a per-step ``d``:

    * ``form="flowgrpo"``: FlowGRPO's ``train_sd3.py`` (``kl_loss = ((prev_sample_mean -
      prev_sample_mean_ref)**2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)``), ``d = std_dev_t``. For
      ``sde_type="flow"`` that is the SDE's diffusion coefficient without the ``sqrt(|dt|)`` factor,
      i.e. ``|dt|`` times the exact KL of the step (on SD3's shift-3 10-step schedule the exact KL is
      3.7x to 112x larger, step by step). For ``"cps"`` ``std_dev_t`` is the step std, so this equals
      ``"exact"``.
    * ``form="exact"``: the KL between the two Gaussian steps, ``d`` = the step's std.

    Args:
        mean, ref_mean: ``[N, ...]`` means of the step under the policy and the reference.
        sigma, sigma_next: ``[N]`` tensors or floats, ``0 <= sigma_next < sigma <= 1``.
        noise_level, sde_type: as in ``sde_step_with_logprob``.
        form: ``"flowgrpo"`` or ``"exact"``.

    Returns:
        ``[N]`` float32.
    """
    if form not in KL_FORMS:
        raise ValueError(f"form must be one of {KL_FORMS}, got {form!r}")
    if not isinstance(mean, torch.Tensor) or mean.ndim < 2:
        raise ValueError(f"mean must be a tensor [N, ...] with at least 2 dimensions, got {_describe(mean)}")
    n = mean.shape[0]
    sigma = per_sample_sigma(sigma, "sigma", n, mean).flatten()  # [N]
    sigma_next = per_sample_sigma(sigma_next, "sigma_next", n, mean).flatten()  # [N]
    check_sigmas(sigma, sigma_next)
    s, step_std = sde_diffusion_coefficient(sigma, sigma_next, noise_level=noise_level, sde_type=sde_type)  # [N]
    d = s if form == "flowgrpo" else step_std
    return gaussian_kl(mean.float(), ref_mean.float(), d)  # [N]
