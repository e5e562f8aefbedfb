"""Off-target figures of a diffusion run, logged by default so that reward hacking shows (``offtarget/*``).

A reward that rises while the images degrade is the known failure of diffusion RL: FlowGRPO's faces turn
to grids (flow_grpo #233), VideoAlign drives Wan to over-exposure (DanceGRPO #41), DiffusionNFT blurs
without its KL (Flow-Factory #225), the group's images collapse to one. None of that moves the trained
reward; these figures move with it:

* on every ``offtarget.every``-th training rollout (the images the reward scored; a few operations per
  pixel, measured in docs/diffusion.md): ``offtarget/brightness`` (mean luma), ``offtarget/dark_frac`` and
  ``offtarget/blown_frac`` (the share of pixels near black / near white), ``offtarget/diversity`` (the mean
  RMS distance between two images of the same prompt's group, on images pooled to at most
  ``offtarget.diversity_size`` pixels a side: a group that collapsed to one image scores 0);
* at each held-out evaluation (prompts never trained on, the EMA weights' ODE images):
  ``offtarget/eval/reward`` (the held-out total reward, ``eval/reward``), ``offtarget/eval/reward/<name>``
  for each reward of ``offtarget.rewards`` (registered rewards the run does not optimise), and
  ``offtarget/eval/brightness`` / ``dark_frac`` / ``blown_frac`` / ``diversity`` (the last across prompts:
  every prompt drawing one image scores 0).

Luma is Rec. 601's ``0.299 R + 0.587 G + 0.114 B`` on [0, 1] images; a pixel is dark below ``DARK`` and
blown out above ``BLOWN``. Shapes: N images ``[N, ..., 3, H, W]`` (videos ``[N, F, 3, H, W]``), values in [0, 1].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Rec. 601 luma weights of R, G, B.
LUMA = (0.299, 0.587, 0.114)
#: A pixel darker than this luma counts as dark (about 13 of 255), brighter than ``BLOWN`` as blown out.
DARK = 0.05
BLOWN = 0.95


def luma(images: torch.Tensor) -> torch.Tensor:
    """``[N, ..., H, W]`` luma of ``[N, ..., 3, H, W]`` RGB images in [0, 1]."""
    if images.ndim < 4 or images.shape[-3] != 3:
        raise ValueError(f"images must be [N, ..., 3, H, W] RGB, got shape {tuple(images.shape)}")
    weights = torch.tensor(LUMA, dtype=torch.float32, device=images.device).view(3, 1, 1)
    return (images.float() * weights).sum(dim=-3)


def image_statistics(images: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per image [N]: ``brightness`` (mean luma), ``dark_frac`` and ``blown_frac`` (shares of its pixels, over
    all frames of a video, with luma below ``DARK`` / above ``BLOWN``)."""
    y = luma(images).flatten(1)  # [N, pixels]
    return {"brightness": y.mean(dim=1), "dark_frac": (y < DARK).float().mean(dim=1),
            "blown_frac": (y > BLOWN).float().mean(dim=1)}


def pooled(images: torch.Tensor, size: int) -> torch.Tensor:
    """``[N, D]``: each image (every frame of a video) area-averaged to at most ``size`` pixels a side and
    flattened, the input of ``diversity``: the distance between two 512-pixel images on 32 x 32 averages
    costs 1/256 of the full one and still tells one picture from another."""
    n, h, w = images.shape[0], images.shape[-2], images.shape[-1]
    flat = images.float().reshape(-1, 3, h, w)  # [N * frames, 3, H, W]
    if max(h, w) > size:
        flat = F.adaptive_avg_pool2d(flat, (min(h, size), min(w, size)))
    return flat.reshape(n, -1)


def diversity(features: torch.Tensor, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over groups (of two or more images) of the mean RMS distance ``sqrt(mean((a - b)^2))`` between
    two different images of the group, 0-dim; ``features`` [N, D] (``pooled``), ``group_ids`` [N] (None: one
    group). NaN when no group has two images."""
    group_ids = torch.zeros(features.shape[0], dtype=torch.long) if group_ids is None else group_ids.cpu()
    per_group = []
    for g in group_ids.unique():
        members = features[(group_ids == g).to(features.device)]  # [G, D]
        k = members.shape[0]
        if k < 2:
            continue
        dist = torch.cdist(members.double(), members.double()) / members.shape[1] ** 0.5  # [G, G] RMS distances
        per_group.append(dist.sum() / (k * (k - 1)))  # the diagonal is 0: the mean over ordered pairs i != j
    if not per_group:
        return torch.tensor(float("nan"))
    return torch.stack(per_group).mean().float()


class RolloutFigures:
    """The training rollout's off-target figures, gathered chunk by chunk as the sampler decodes them
    (``add``: the chunk's per-image statistics and pooled images, a few operations per pixel while the
    decoded tensor is at hand) and summarised once the rollout is scored (``result``)."""

    def __init__(self, diversity_size: int):
        self.size = diversity_size
        self.parts: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []

    def add(self, images: torch.Tensor) -> None:
        with torch.no_grad():
            self.parts.append(({k: v.cpu() for k, v in image_statistics(images).items()},
                               pooled(images, self.size).cpu()))

    def result(self, group_ids: torch.Tensor) -> dict[str, float]:
        """``offtarget/<figure>`` over the rollout's images (in sampling order, ``group_ids`` [N])."""
        if not self.parts:
            return {}
        stats = {k: torch.cat([p[0][k] for p in self.parts]) for k in self.parts[0][0]}
        out = {f"offtarget/{k}": v.mean().item() for k, v in stats.items()}
        out["offtarget/diversity"] = diversity(torch.cat([p[1] for p in self.parts]), group_ids).item()
        return out


def pil_to_tensor(images: list) -> torch.Tensor:
    """``[N, 3, H, W]`` in [0, 1] from PIL images (videos: lists of frames, ``[N, F, 3, H, W]``)."""
    import numpy as np

    if images and isinstance(images[0], (list, tuple)):
        return torch.stack([pil_to_tensor(list(video)) for video in images])
    arrays = np.stack([np.asarray(image.convert("RGB"), dtype=np.uint8) for image in images])  # [N, H, W, 3]
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255.0


def evaluation_parts(env, images: list, rows: list[dict]) -> list[tuple[dict[str, float], torch.Tensor]]:
    """Per held-out image (PIL, or a video's frames): its ``offtarget/eval/*`` values (image statistics, and
    the ``offtarget.rewards`` scores) and its pooled pixels [D], to be gathered from every process with the
    evaluation's own scores (``unirl.diffusion.held_out``)."""
    if not images:
        return []
    tensor = pil_to_tensor(images)  # [n, ..., 3, H, W]
    values = {f"offtarget/eval/{k}": v for k, v in image_statistics(tensor).items()}
    if env.offtarget_rewards is not None:
        columns = {c: [row.get(c) for row in rows] for c in rows[0] if c != "prompt"}
        scores = env.offtarget_rewards.components(images, prompts=[row["prompt"] for row in rows], columns=columns)
        values.update({f"offtarget/eval/reward/{name}": v.float() for name, v in scores.items()})
    features = pooled(tensor, env.cfg.offtarget.diversity_size)  # [n, D]
    return [({k: float(v[j]) for k, v in values.items()}, features[j]) for j in range(len(images))]


def evaluation_figures(parts: list[tuple[dict[str, float], torch.Tensor]]) -> dict[str, float]:
    """The ``offtarget/eval/*`` means over every held-out image's ``evaluation_parts`` (a reward's NaN, where
    it does not apply, left out), and ``offtarget/eval/diversity`` across the prompts."""
    if not parts:
        return {}
    out = {name: torch.tensor([p[0][name] for p in parts]).nanmean().item() for name in parts[0][0]}
    out["offtarget/eval/diversity"] = diversity(torch.stack([p[1] for p in parts])).item()
    return out
