"""Registered policy losses: one signature, so the trainer calls the configured one and never branches
on the algorithm (verl's ``register_policy_loss`` in ``verl/trainer/ppo/core_algos.py`` is the model).

A policy loss is a function ``loss(inputs: LossInputs, settings: LossSettings) -> (loss, figures)``:

* ``inputs``: what one micro-batch (or one column piece of it, [n, T']) brings: the environment's
  forward of the stored actions (``Environment.score_actions``: ``logp`` and ``mask`` for a
  likelihood-ratio loss, DiffusionNFT's velocities for its loss), the old log-probs, the advantages,
  the rollout-correction weights and the aggregation's normaliser;
* ``settings``: the numbers of ``algo`` that every ratio loss reads (clip range, dual clip, aggregation) and,
  in ``settings.args``, the loss's own settings: a frozen dataclass the loss registers (``settings=``),
  filled from the config's ``algo.loss_args`` and checked where the config loads (``build_loss_args``);
* returns the 0-dim loss share (gradients flow) and its detached figures (``loss/policy`` at least,
  ``loss/<name>`` shares that add up over pieces).

``PolicyLoss`` wraps the function with what the trainer must know about it without knowing its name:
whether it reads log-probs (the ratio losses; then the old log-probs are needed and the ratio figures
are logged), whether it needs whole sequences (GSPO: no column pieces), and its figures
(``actor/<name>``, over each whole micro-batch): by default PPO's clip figures at ``algo.clip_low/high``
(``policy_loss_metrics``: ``clip_frac`` ...), which say nothing true of a loss that does not clip the
ratio there (CISPO clips an IS weight at its own bounds, DPPO masks by a divergence, GMPO clips the
log-ratio): such a loss registers ``figures=`` of its own.

To add a loss: write the function (and, if it has knobs, a frozen dataclass of them whose defaults are
its reference's) in one file, decorate it with
``@register_policy_loss("name", settings=MyArgs, reads_logprobs=..., whole_sequences=...)`` and import
the file before the run (``unirl.core`` imports the shipped ones); a config sets the knobs with
``algo.loss_args: {knob: value}``. ``tests/test_policy_losses.py`` adds one and trains a
step with it; ``docs/architecture.md`` says how.

Shapes: n samples of the micro-batch, T' the columns of the piece (tokens or trained denoising steps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from unirl.core.losses import AGG_MODES, aggregate, clipped_policy_loss, policy_loss_metrics
from unirl.core.nft import nft_loss, velocity_kl
from unirl.registry import Registry, build_settings


@dataclass(frozen=True)
class LossSettings:
    """The numbers a policy loss reads (plain values, no config object): ``algo``'s clip range, dual
    clip and aggregation mode, which every ratio loss shares, and ``args``: the loss's own settings (the
    instance of the dataclass it registered, from ``algo.loss_args``; None for a loss without any)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    args: Any = None


@dataclass
class LossInputs:
    """One micro-batch's (or one column piece's) inputs of a policy loss.

    ``forward``: ``Environment.score_actions``'s outputs for the piece (``logp`` [n, T'] with gradients,
    ``mask`` [n, T'] or None; DiffusionNFT: velocities [n, T', *latent]). ``old_logp`` [n, T'] (None for a
    loss that reads no log-probs), ``advantages`` [n, T'] (ratio losses) or [n] (per sample),
    ``weights`` [n, T'] rollout-correction weights or None, ``denominator`` and ``seq_lengths`` the
    aggregation's normaliser (``unirl.core.losses.aggregate``)."""

    forward: dict[str, torch.Tensor]
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    denominator: torch.Tensor | float | None = None
    seq_lengths: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor | None:
        return self.forward.get("mask")


LossFn = Callable[[LossInputs, LossSettings], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
#: ``figures(inputs, settings) -> {name: 0-dim detached tensor}``, logged as ``actor/<name>``: the inputs of a
#: whole micro-batch, ``forward["logp"]`` detached, no weights or normaliser.
FiguresFn = Callable[[LossInputs, LossSettings], "dict[str, torch.Tensor]"]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss and what the trainer must know about it (module docstring)."""

    fn: LossFn
    reads_logprobs: bool = True
    whole_sequences: bool = False
    #: For the ratio figures (``policy_loss_metrics``): the ratio level, token or sequence.
    level: str = field(default="token")
    #: The loss's own settings: a frozen dataclass whose defaults are its reference's (None: no knobs).
    settings: type | None = None
    #: The ``score_actions`` outputs the loss reads besides ``logp`` and ``mask`` (DiffusionNFT: the
    #: velocities; GRPO-Guard: the step means): an environment (a diffusion rollout mode) that does not
    #: give them refuses the loss where the config loads, and one that gives them only on demand
    #: (FlowGRPO's old step means) gives them exactly when the run's loss reads them.
    reads: frozenset[str] = frozenset()
    #: The one aggregation the loss is defined with (GSPO, SAPO, GMPO: ``seq-mean-token-mean``, which verl
    #: hard-codes for them), or None: any ``algo.loss_agg``. A config with another is refused where it loads.
    loss_agg: str | None = None
    #: Whether the loss reads ``exp(logp)`` as a probability in [0, 1] (DPPO's trust regions): true of
    #: tokens only; an environment whose log-probs are densities (diffusion) refuses it where its config loads.
    discrete: bool = False
    #: The loss's own figures (``FiguresFn``); None: PPO's clip figures at ``algo.clip_low/high`` and ``level``.
    figures: FiguresFn | None = None

    def ratio_figures(self, inputs: LossInputs, settings: LossSettings) -> dict[str, torch.Tensor]:
        """The figures of a micro-batch (``actor/<name>``): the loss's own, or PPO's clip figures
        (``policy_loss_metrics``: ``clip_frac``, ``clip_frac_low/high``, ``approx_kl``, ``ratio_mean/max/min``)."""
        if self.figures is not None:
            return self.figures(inputs, settings)
        return policy_loss_metrics(inputs.forward["logp"], inputs.old_logp, inputs.advantages, inputs.mask,
                                   clip_low=settings.clip_low, clip_high=settings.clip_high,
                                   dual_clip=settings.dual_clip, level=self.level)


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, *, settings: type | None = None, reads_logprobs: bool = True,
                         whole_sequences: bool = False, level: str = "token", loss_agg: str | None = None,
                         discrete: bool = False, figures: FiguresFn | None = None,
                         reads: tuple[str, ...] = ()) -> Callable[[LossFn], LossFn]:
    """Register ``fn`` as the policy loss ``name`` (a duplicate name is an error), with ``settings`` the
    dataclass of its own knobs (filled from ``algo.loss_args``), ``figures`` its figures (None: PPO's clip
    figures) and ``reads`` the forward outputs it reads besides ``logp`` and ``mask``; the other arguments
    are ``PolicyLoss``'s."""
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise TypeError(f"register_policy_loss({name!r}): settings must be a dataclass type, got {settings!r}")
    if loss_agg is not None and loss_agg not in AGG_MODES:
        raise ValueError(f"register_policy_loss({name!r}): loss_agg must be one of {', '.join(AGG_MODES)} or None, "
                         f"got {loss_agg!r}")

    def decorator(fn: LossFn) -> LossFn:
        POLICY_LOSSES.add(name, PolicyLoss(fn, reads_logprobs=reads_logprobs, whole_sequences=whole_sequences,
                                           level=level, settings=settings, loss_agg=loss_agg, discrete=discrete,
                                           figures=figures, reads=frozenset(reads)))
        return fn

    return decorator


def build_loss_args(name: str, given: dict[str, Any] | None) -> Any:
    """The settings instance of the registered loss ``name`` from ``given`` (``algo.loss_args``): its
    dataclass with the given fields replaced, its ``__post_init__`` checking their ranges. An unknown key,
    or keys for a loss that has no settings, is a ``ValueError`` naming ``algo.loss_args.<key>`` and the
    loss's valid keys."""
    cls = POLICY_LOSSES.get(name).settings
    return build_settings(cls, given, key="algo.loss_args", owner=f"the policy loss {name!r}", name=name)


def loss_settings(name: str, algo: Any) -> LossSettings:
    """The ``LossSettings`` of the registered loss ``name`` from the run's ``algo`` block (its shared clip
    range and aggregation, and ``algo.loss_args`` as the loss's own settings)."""
    return LossSettings(clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                        loss_agg=algo.loss_agg, args=build_loss_args(name, algo.loss_args))


def _clipped(inputs: LossInputs, s: LossSettings, level: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, _ = clipped_policy_loss(inputs.forward["logp"], inputs.old_logp, inputs.advantages, inputs.mask,
                                  clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip, level=level,
                                  agg=s.loss_agg, weights=inputs.weights, denominator=inputs.denominator,
                                  seq_lengths=inputs.seq_lengths, with_metrics=False)
    return loss, {"loss/policy": loss.detach()}


@register_policy_loss("clipped")
def clipped_ratio_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped ratio per token, with DAPO's clip-higher and dual clip (``clipped_policy_loss``)."""
    return _clipped(inputs, settings, "token")


@register_policy_loss("gspo", whole_sequences=True, level="sequence", loss_agg="seq-mean-token-mean")
def gspo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's sequence-level ratio (https://arxiv.org/abs/2507.18071; ``clipped_policy_loss``'s
    ``level="sequence"``): needs whole sequences, so the trainer does not cut it into column pieces."""
    return _clipped(inputs, settings, "sequence")


@dataclass(frozen=True)
class NftArgs:
    """DiffusionNFT's loss settings (``algo.loss_args`` with ``algorithm: nft``). Defaults are NVlabs'
    ``config/nft.py`` (``_get_config``, its SD3.5-M base) and ``config/base.py``."""

    #: The implicit policies' step beta: ``v+ = (1 - beta) v_old + beta v``, ``v- = (1 + beta) v_old - beta v``
    #: (``config.beta = 1.0``; its OCR setting uses 0.1).
    beta: float = 1.0
    #: A_max: the advantage mapped to optimality probability 1 (``r = 1/2 + 1/2 clip(A / A_max, -1, 1)``)
    #: and the loss's scale (``train.adv_clip_max = 5``).
    adv_clip: float = 5.0
    #: Weight of the KL to the reference, ``mean((v - v_ref)^2)`` per trained time, in the loss
    #: (``train.beta = 0.0001`` for SD3). 0 skips the reference's forward.
    kl_coef: float = 1.0e-4

    def __post_init__(self):
        for name, positive in (("beta", True), ("adv_clip", True), ("kl_coef", False)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or (
                    value <= 0 if positive else value < 0):
                raise ValueError(f"{name} must be {'>' if positive else '>='} 0, got {value!r}")


@register_policy_loss("nft", settings=NftArgs, reads_logprobs=False,
                      reads=("velocity", "old_velocity", "clean", "noisy", "sigma"))
def diffusion_nft_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's loss (``unirl.core.nft.nft_loss``) at each of the piece's noise levels, plus
    ``kl_coef`` times the velocity gap to the reference, aggregated with ``loss_agg`` (``NftArgs``).

    ``forward`` holds ``velocity``, ``old_velocity`` (and ``ref_velocity`` with a KL), ``clean``
    [n, *latent], ``noisy`` [n, T', *latent] and ``sigma`` [n, T']; ``advantages`` are per sample [n]."""
    f, s, args = inputs.forward, settings, settings.args or NftArgs()
    losses, figures = [], {"loss/policy": [], "loss/old_deviation": []}
    if args.kl_coef > 0:
        figures["loss/kl"] = []
    for j in range(f["sigma"].shape[1]):
        v = f["velocity"][:, j]  # [n, *latent]
        policy, figs = nft_loss(v, f["old_velocity"][:, j], f["clean"], f["noisy"][:, j], f["sigma"][:, j],
                                inputs.advantages, beta=args.beta, adv_clip=args.adv_clip)  # [n]
        loss = policy
        figures["loss/policy"].append(policy.detach())
        figures["loss/old_deviation"].append(figs["old_deviation"])
        if args.kl_coef > 0:
            kl = velocity_kl(v, f["ref_velocity"][:, j])  # [n]
            loss = loss + args.kl_coef * kl
            figures["loss/kl"].append(kl.detach())
        losses.append(loss)
    agg = dict(denominator=inputs.denominator, seq_lengths=inputs.seq_lengths)
    per_position = torch.stack(losses, dim=1)  # [n, T']
    total = aggregate(per_position, inputs.mask, s.loss_agg, **agg)
    shares = {name: aggregate(torch.stack(v, dim=1), inputs.mask, s.loss_agg, **agg) for name, v in figures.items()}
    return total, shares
