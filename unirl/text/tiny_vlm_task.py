"""The tiny VLM's visual task: how many shapes are in a picture (1 to 3), drawn with PIL.

Each picture is 56x56 pixels (the tiny processor's size, so nothing is resized), a 2x2 grid of 28x28
cells on a grey background: ``count`` cells are filled squares, each a random shade of one of five
colours, and 300 random pixels of salt noise lie over the whole picture. A cell is exactly one merged
image token (4 patches of 14 pixels), so what the tiny model must read is which of its 4 image tokens
show a square. Train and held-out pictures come from different seeds: the 14 layouts of 1 to 3 filled
cells recur, the colours, shades and noise do not.

Why filled cells: with the first version's small jittered squares (12-16 pixels anywhere in their cell)
the frozen random vision tower's features separate the counts (a linear probe on them scores 1.0 on
held-out pictures) but are dominated by where each square's edges cut the patches; the tiny language
model did not learn the count from them even supervised (chance after 400 steps), while on filled
cells it does (held-out 0.27 -> 0.69 in 200 supervised steps). benchmarks/README.md has the figures.

The answer is written in GSM8K's format (``#### N``) so the demo runs the real ``gsm8k`` reward, as
the tiny text demo does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

QUESTION = "How many shapes?"
MAX_COUNT = 3
NOISE_PIXELS = 300
_COLOURS = [(230, 40, 40), (40, 200, 60), (40, 80, 230), (240, 200, 30), (200, 60, 220)]


def _shade(colour: tuple, rng: random.Random, spread: int = 25) -> tuple:
    return tuple(max(0, min(255, c + rng.randint(-spread, spread))) for c in colour)


def shapes_picture(count: int, rng: random.Random):
    """A 56x56 RGB picture with ``count`` filled 28x28 cells of random colours, and salt noise."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), _shade((128, 128, 128), rng))
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(4), count):
        x, y = 28 * (cell % 2), 28 * (cell // 2)
        draw.rectangle([x, y, x + 27, y + 27], fill=_shade(rng.choice(_COLOURS), rng))
    pixels = image.load()
    for _ in range(NOISE_PIXELS):
        pixels[rng.randrange(56), rng.randrange(56)] = tuple(rng.randrange(256) for _ in range(3))
    return image


def write_counting_task(directory: Path, split: str, n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"question", "answer", "images"}`` written to ``directory/<split>.jsonl`` with their
    pictures under ``directory/images/`` (paths relative to the jsonl's folder); returns the rows."""
    rng = random.Random(seed)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        count = rng.randint(1, MAX_COUNT)
        name = f"images/{split}_{i:04d}.png"
        shapes_picture(count, rng).save(directory / name)
        rows.append({"question": QUESTION, "answer": f"#### {count}", "images": [name]})
    with open(directory / f"{split}.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows
