"""The cost of the training rollouts' off-target figures (``unirl/diffusion/offtarget.py``): what
``RolloutFigures`` adds to a rollout, on random decoded images of two sizes, median of repeats.

    OMP_NUM_THREADS=1 python benchmarks/offtarget_cost.py

Sizes: ``tiny_colour``'s rollout (32 images of 32 x 32, groups of 8) and an SD3.5-M FlowGRPO step's
(48 images of 512 x 512, groups of 16: ``sd3_ocr.yaml`` scaled to one GPU). Compare with a step's time
(``time/step`` in a run's metrics.jsonl: about 0.7 s for tiny_colour on this CPU, 9.6 s on an H200 for
SD3.5-M). On a GPU the figures are computed where the decoder leaves the images.
"""

from __future__ import annotations

import statistics
import time

import torch

from unirl.diffusion.offtarget import RolloutFigures


def median_seconds(n: int, side: int, group: int, chunk: int, repeats: int = 7) -> float:
    images = torch.rand(n, 3, side, side)
    groups = torch.arange(n // group).repeat_interleave(group)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        figures = RolloutFigures(32)
        for lo in range(0, n, chunk):
            figures.add(images[lo:lo + chunk])
        figures.result(groups)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    for label, args in (("tiny_colour: 32 x 32 px, 32 images", (32, 32, 8, 32)),
                        ("SD3.5-M step: 512 x 512 px, 48 images", (48, 512, 16, 16))):
        print(f"{label}: {median_seconds(*args) * 1e3:.2f} ms a rollout")


if __name__ == "__main__":
    main()
