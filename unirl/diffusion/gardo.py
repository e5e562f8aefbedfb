"""GARDO's rollout mode (``algorithm: gardo``): FlowGRPO's SDE rollouts and forward, with GARDO's gate,
diversity and resettable reference (arXiv 2512.24138; flow_grpo ``scripts/train_sd3_gardo.py``, commit 94e23ee).
The math is ``unirl/core/gardo.py`` (its loss ``gardo``); this file keeps the state the code keeps:

1. the reference: a copy of the trainable weights (the code's second LoRA adapter ``old``, a copy of the policy at
   the start), swapped in for its forward of each trained step before the policy's (``score_actions``: the step KL
   ``ref_kl`` [n, T'], FlowGRPO's form);
2. its reset to the policy (``maybe_reset``, before each step's rollout: the code resets after sampling, and
   sampling leaves the weights as they are): when an optimizer step of an earlier training step had a gated KL
   mean above ``reset_kl``, or ``reset_every`` steps passed since the last reset (the code's ``epoch - prev_epoch
   > reset_freq``);
3. the gate (``scored``, once the rewards are in): the uncertainty of each sample from its rank under the trained
   reward and under the ``aux_rewards`` (rewards of the config scored but, at weight 0, not trained: the code's
   ``aesthetic`` and ``imagereward`` beside its main reward), over the whole batch, and the gate's fraction;
4. the diversity weights (``rollout``): from features of the decoded images, per prompt group. The code embeds
   them with DINOv3; here they are the images pooled to at most ``diversity_size`` pixels a side
   (``unirl.diffusion.offtarget.pooled``): no vision model needs downloading, and on the toy images the pixels
   are the content.

Shapes: B prompts, G group size, N = B*G, T trained steps, latents ``[*latent]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from unirl.core.gardo import diversity_weights, gated_kl, next_gate_fraction, uncertainty, uncertainty_gate
from unirl.diffusion.ema import ParamEMA
from unirl.diffusion.flowgrpo import FlowGRPORollout
from unirl.diffusion.offtarget import pooled
from unirl.diffusion.rollout_mode import build_settings, register_rollout_mode
from unirl.env import Rollout


@dataclass(frozen=True)
class GardoModeArgs:
    """GARDO's gate and reference (``mode_args`` with ``algorithm: gardo``); defaults are flow_grpo's
    ``config/grpo_gardo.py`` and its script's ``RiskCompensator``."""

    #: Rewards of the config (weight 0: scored, not trained) whose ranks judge a sample's uncertainty.
    aux_rewards: tuple[str, ...] = ("aesthetic", "imagereward")
    #: Reset the reference when a training step's gated KL mean exceeded this (``kl_thres``: 3e-4).
    reset_kl: float = 3e-4
    #: ... or when more than this many steps passed since the last reset (``reset_freq``: 15).
    reset_every: int = 15
    #: The gate's first fraction and its controller (``RiskCompensator``: base 0.1, alpha 0.1, [0.02, 0.2], 20).
    gate_base: float = 0.1
    gate_rate: float = 0.1
    gate_min: float = 0.02
    gate_max: float = 0.2
    gate_window: int = 20
    #: Images pooled to at most this many pixels a side are the diversity features (the code: DINOv3's).
    diversity_size: int = 32

    def __post_init__(self):
        if isinstance(self.aux_rewards, str) or not self.aux_rewards or not all(isinstance(a, str) for a in self.aux_rewards):
            raise ValueError(f"aux_rewards must name at least one reward of the config, got {self.aux_rewards!r}")
        if not 0 < self.gate_min <= self.gate_base <= self.gate_max <= 1:
            raise ValueError(f"need 0 < gate_min <= gate_base <= gate_max <= 1, got {self.gate_min}, "
                             f"{self.gate_base}, {self.gate_max}")
        for name in ("reset_every", "gate_window", "diversity_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not self.reset_kl > 0 or not 0 <= self.gate_rate < 1:
            raise ValueError(f"reset_kl must be > 0 and gate_rate in [0, 1), got {self.reset_kl}, {self.gate_rate}")


class ReferenceCopy(ParamEMA):
    """A copy of the trainable weights, swapped in for the reference's forward (``swapped``), set to the
    weights by ``reset``."""

    @torch.no_grad()
    def reset(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.copy_(p)


@register_rollout_mode("gardo", settings=GardoModeArgs)
class GardoRollout(FlowGRPORollout):
    """FlowGRPO with GARDO's gated KL to a resettable reference and its diversity weights (module docstring)."""

    policy_loss = "gardo"
    offers = FlowGRPORollout.offers | {"ref_kl", "kl_gate", "diversity"}

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if cfg.algo.kl_coef > 0 or cfg.algo.use_kl_in_reward:
            raise ValueError("algorithm=gardo: its gated KL is in its loss (algo.loss_args.kl_coef); set "
                             "algo.kl_coef: 0 and algo.use_kl_in_reward: false")
        names = [r.name for r in cfg.rewards]
        for aux in build_settings(cfg.algorithm, cls.settings, cfg.mode_args).aux_rewards:
            if aux not in names:
                raise ValueError(f"mode_args.aux_rewards: {aux!r} is not among the rewards ({', '.join(names)}); "
                                 f"list it there with weight: 0 (scored for the gate, not trained)")

    def setup(self) -> None:
        super().setup()
        self.reference = ReferenceCopy([p for p in self.env.model.parameters() if p.requires_grad], decay=0.0)
        self.needs_reset, self.last_reset = False, 0
        self.fraction, self.history = self.args.gate_base, []
        self.kl_pieces: list[torch.Tensor] = []  # this optimizer step's gated KL means (the reset's trigger)

    @property
    def with_mean(self) -> bool:
        return True  # the step KL to the reference compares the two step means

    # ------------------------------------------------------------ the reference
    def maybe_reset(self, step: int) -> bool:
        """Reset the reference to the policy when the last steps' KL or the step count asks (module docstring)."""
        if (step != 0 and self.needs_reset) or step - self.last_reset > self.args.reset_every:
            self.reference.reset()
            self.needs_reset, self.last_reset = False, step
            return True
        return False

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        if not self.kl_pieces:
            return
        kl = torch.stack(self.kl_pieces).mean()  # the code's info["kl_loss"]: the accumulated pieces' mean
        acc = self.env.accelerator
        if acc.num_processes > 1:
            kl = acc.reduce(kl.to(acc.device), reduction="mean")
        self.needs_reset = self.needs_reset or bool(kl > self.args.reset_kl)
        self.kl_pieces = []

    # ------------------------------------------------------------ rollout, gate
    def rollout(self, rows: list[dict], group_size: int) -> tuple[Rollout, list, dict[str, float]]:
        reset = self.maybe_reset(self.env.step)
        rollout, futures, figures = super().rollout(rows, group_size)
        images = torch.stack([torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).permute(2, 0, 1)
                              for im in rollout.samples])  # [N, 3, H, W]
        rollout.tensors["diversity"] = diversity_weights(pooled(images, self.args.diversity_size), rollout.group_ids)
        return rollout, futures, {**figures, "rollout/gardo_reset": float(reset)}

    def scored(self, rollout: Rollout, rewards: torch.Tensor) -> None:
        """The gate of each sample [N] (``rollout.tensors["kl_gate"]``) from the batch's ranks."""
        acc = self.env.accelerator
        scores = torch.stack([rewards.float(), *(rollout.tensors[f"score/{a}"].float() for a in self.args.aux_rewards)])
        if acc.num_processes > 1:  # ranks over the global batch, as the code's gathered rewards
            scores = acc.gather(scores.T.contiguous().to(acc.device)).T.cpu()  # [1 + K, N_all]
        u = uncertainty(scores[0], scores[1:])  # [N_all]
        mean_u = float(u[u >= 0].mean())
        a = self.args
        self.fraction = next_gate_fraction(self.fraction, mean_u, self.history, base=a.gate_base, rate=a.gate_rate,
                                           low=a.gate_min, high=a.gate_max)
        self.history = (self.history + [mean_u])[-a.gate_window:]
        n, rank = len(rollout), acc.process_index
        rollout.tensors["kl_gate"] = uncertainty_gate(u, self.fraction)[rank * n:(rank + 1) * n]  # [N]

    # ------------------------------------------------------------ the forward
    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """FlowGRPO's forward, plus the step KL to the reference ``ref_kl`` [n, T'] (the reference's forward
        first: swapping its weights in after the policy's forward would change what that graph saved), the gate
        ``kl_gate`` and the diversity weights ``diversity`` [n, T']."""
        with torch.no_grad(), self.reference.swapped():
            ref = super().score_actions(self.env.accelerator.unwrap_model(model), batch, columns)
        out = super().score_actions(model, batch, columns)
        n, width = out["logp"].shape
        out["ref_kl"] = self.kl(out, ref)  # [n, T']
        device = out["logp"].device
        out["kl_gate"] = batch.tensors["kl_gate"].to(device).float()[:, None].expand(n, width)
        out["diversity"] = batch.tensors["diversity"].to(device).float()[:, None].expand(n, width)
        if torch.is_grad_enabled():  # the update's forward: its gated KL counts towards the reset
            self.kl_pieces.append(gated_kl(out["ref_kl"].detach(), out["kl_gate"]).cpu())
        return out

    def checkpoint_objects(self) -> dict:
        return {"gardo": self}

    def state_dict(self) -> dict:
        return {"reference": self.reference.state_dict(), "needs_reset": self.needs_reset,
                "last_reset": self.last_reset, "fraction": self.fraction, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.reference.load_state_dict(state["reference"])
        self.needs_reset, self.last_reset = bool(state["needs_reset"]), int(state["last_reset"])
        self.fraction, self.history = float(state["fraction"]), [float(h) for h in state["history"]]
