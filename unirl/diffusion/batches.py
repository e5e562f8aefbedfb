"""The diffusion environment's ``sampler`` and ``scorer`` (one object: the rewards of a rollout's chunks are
queued while the next chunks sample, and collected by ``score``).

The rollout mode samples (``unirl.diffusion.rollout_mode``); each chunk of clean latents it finishes is decoded
and its rewards queued (``decode_and_queue``): in the reward pool for every chunk but the last, which ``score``
runs on the calling thread (nothing is left to sample while it scores). As they decode, the images' off-target
statistics are gathered (``unirl.diffusion.offtarget``, ``offtarget/*``: what shows reward hacking).

Shapes: N = B*G samples, latents ``[*latent]``.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future

import torch

from unirl.diffusion.offtarget import RolloutFigures
from unirl.diffusion.sampling import to_pil
from unirl.env import Rollout
from unirl.reward_set import concat_components


class DiffusionSampler:
    """Samples with the environment's rollout mode; scores them with its rewards (``env``: the
    ``DiffusionEnvironment`` that owns it)."""

    def __init__(self, env):
        self.env = env
        # (id of the rollout, its chunks' rewards: futures of the pool, or a call for the last chunk)
        self._pending: tuple[int, list] | None = None
        self._rollout_figures: dict[str, float] = {}
        self._offtarget: RolloutFigures | None = None  # this rollout's image statistics, gathered as it decodes

    @torch.no_grad()
    def rollout(self, rows: list[dict], group_size: int) -> Rollout:
        """The rollout mode's samples (``rollout_mode``); their rewards queued and the figures kept for ``score``."""
        self.env.forwards.take()  # count this rollout's transformer rows only
        off = self.env.cfg.offtarget  # this rollout's off-target image figures, gathered as its chunks decode
        self._offtarget = RolloutFigures(off.diversity_size) if off.enabled and off.every and (
            self.env.step % off.every == 0) else None
        rollout, futures, figures = self.env.mode.rollout(rows, group_size)
        self._rollout_figures = {"rollout/transformer_calls": float(self.env.forwards.take()), **figures}
        self._pending = (id(rollout), futures)
        return rollout

    def decode_and_queue(self, final: torch.Tensor, prompts: list[str], columns: dict[str, list], lo: int, hi: int,
                          *, last: bool, futures: list) -> list:
        """Decode a sampled chunk's clean latents ``final`` (samples ``lo:hi``) and queue its rewards: in the
        pool for every chunk but the last, which ``score`` runs on the calling thread (nothing is left to
        sample while it scores). Returns the chunk's images."""
        decoded = self.env.family.decode(self.env.pipe, final)  # [n, ..., 3, H, W] in [0, 1]
        if self._offtarget is not None:
            self._offtarget.add(decoded)
        chunk_images = to_pil(decoded)
        chunk = dict(prompts=prompts[lo:hi], columns={k: v[lo:hi] for k, v in columns.items()})
        if last:
            futures.append(functools.partial(self.env.rewards.components, chunk_images, **chunk))
        else:
            futures.append(self.env.rewards.submit(chunk_images, **chunk))
        return chunk_images

    def score(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        figures = dict(self._rollout_figures)
        if self._pending is not None and self._pending[0] == id(rollout):
            components = concat_components([f.result() if isinstance(f, Future) else f() for f in self._pending[1]])
            self._pending = None
            if self._offtarget is not None:  # the images this rollout decoded, in sampling order
                figures.update(self._offtarget.result(rollout.group_ids))
        else:  # a rollout not made by the last ``rollout`` call: score it inline
            components = self.env.rewards.components(rollout.samples, prompts=rollout.prompts, columns=rollout.columns)
        rollout.tensors.update({f"score/{k}": v for k, v in components.items()})  # for global metrics
        rewards, metrics = self.env.rewards.combine(components, rollout.group_ids)
        self.env.mode.scored(rollout, rewards)  # what the mode derives from the rewards (GARDO's gate)
        return rewards, {**metrics, **figures}


    def sync_weights(self) -> None:  # the policy samples itself: nothing to push
        pass

    def release_memory(self) -> None:
        pass

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        return {}
