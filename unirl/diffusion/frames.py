"""Videos as their frames: scoring a video with image rewards, and drawing videos on the evaluation grid.

A family with ``frames`` (Wan 2.1) decodes each sample to a list of PIL frames (``sampling.to_pil`` on
``[N, F, 3, H, W]``). The rewards stay image rewards: ``FrameRewards`` hands them every
``video.frame_stride``-th frame of every video as one batch of images (each frame with its video's
prompt and columns) and reduces each video's frame scores to one score with ``video.frame_reduce``. A
frame scored None (the reward does not apply) is left out of its video's reduction; a video none of
whose frames apply is None. FlowGRPO's video OCR reward does the same with OCR on every 4th frame and
the mean, except that it also leaves out frames scored 0.

Shapes: N videos, F frames each, K = ceil(F / stride) scored frames per video.
"""

from __future__ import annotations

import math
import textwrap
from concurrent.futures import Future
from pathlib import Path

import torch

from unirl.reward_set import RewardSet

REDUCTIONS = {"mean": torch.mean, "min": torch.amin, "max": torch.amax}


class FrameRewards:
    """A ``RewardSet`` over videos: the same ``components`` / ``submit`` / ``combine`` / ``close``, each
    reward scoring the videos' frames (see the module docstring)."""

    def __init__(self, rewards: RewardSet, *, stride: int = 1, reduce: str = "mean"):
        if stride < 1:
            raise ValueError(f"video.frame_stride must be >= 1, got {stride}")
        if reduce not in REDUCTIONS:
            raise ValueError(f"video.frame_reduce must be one of {sorted(REDUCTIONS)}, got {reduce!r}")
        self.rewards, self.stride, self.reduce = rewards, stride, reduce
        self.names = rewards.names

    def components(self, videos: list[list], *, prompts: list[str], columns: dict[str, list],
                   texts: dict[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
        """Each reward's scores [N] by metric name (NaN where it applies to no frame of the video).
        ``texts`` receives, per video, its scored frames' texts joined with `` | ``."""
        frames, prompts, columns, owner = self._frames(videos, prompts, columns)
        frame_texts: dict[str, list[str]] | None = {} if texts is not None else None
        scores = self.rewards.components(frames, prompts=prompts, columns=columns, texts=frame_texts)
        if texts is not None:
            for name, per_frame in frame_texts.items():
                texts[name] = [" | ".join(t for t, o in zip(per_frame, owner) if o == i) for i in range(len(videos))]
        return self._reduced(scores, len(videos))

    def submit(self, videos: list[list], *, prompts: list[str], columns: dict[str, list]) -> Future:
        """``components`` in the reward pool: the frames are scored there and reduced when they are done."""
        frames, prompts, columns, _ = self._frames(videos, prompts, columns)
        scored, out = self.rewards.submit(frames, prompts=prompts, columns=columns), Future()

        def reduce(done: Future) -> None:
            try:
                out.set_result(self._reduced(done.result(), len(videos)))
            except BaseException as e:  # re-raised by out.result(), like the pool's own future
                out.set_exception(e)

        scored.add_done_callback(reduce)
        return out

    def combine(self, components: dict[str, torch.Tensor], group_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return self.rewards.combine(components, group_ids)

    def close(self) -> None:
        self.rewards.close()

    def _frames(self, videos: list[list], prompts: list[str], columns: dict[str, list]):
        """The scored frames of all videos in order, with their videos' prompts and columns, and the
        index of each frame's video."""
        if len(prompts) != len(videos):
            raise ValueError(f"{len(videos)} videos but {len(prompts)} prompts")
        owner = [i for i, video in enumerate(videos) for _ in video[::self.stride]]  # [N * K]
        frames = [frame for video in videos for frame in video[::self.stride]]
        return (frames, [prompts[i] for i in owner], {k: [v[i] for i in owner] for k, v in columns.items()}, owner)

    def _reduced(self, scores: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, per_frame in scores.items():
            per_video = per_frame.view(n, -1)  # [N, K]: every video has the same number of frames
            applies = ~torch.isnan(per_video)
            reduced = [REDUCTIONS[self.reduce](row[ok]) if ok.any() else torch.tensor(math.nan, dtype=torch.float64)
                       for row, ok in zip(per_video, applies)]
            out[name] = torch.stack(reduced).double()  # [N] float64, as RewardSet.components keeps a reward's scores
        return out


def write_grid(samples: list, captions: list[str], path: Path, *, fps: int = 8):
    """Write the evaluation grid of ``samples`` (images, or videos as lists of frames) to ``path`` (a
    ``.png``) and return the PNG's image. Videos: the PNG shows their first frames, and an animated
    ``.gif`` beside it plays the grid frame by frame at ``fps``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not samples or not isinstance(samples[0], list):
        grid = image_grid(samples, captions)
        grid.save(path)
        return grid
    grids = [image_grid([video[f] for video in samples], captions) for f in range(len(samples[0]))]
    grids[0].save(path)
    grids[0].save(path.with_suffix(".gif"), save_all=True, append_images=grids[1:], duration=round(1000 / fps), loop=0)
    return grids[0]


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
