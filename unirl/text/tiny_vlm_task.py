"""The tiny VLM's visual task: how many shapes are in a picture (1 to 3), drawn with PIL.

Each picture is 56x56 pixels (the tiny processor's size, so nothing is resized): ``count`` filled
squares of random colours in distinct cells of a 2x2 grid on a grey background. The answer is written in
GSM8K's format (``#### N``) so the demo runs the real ``gsm8k`` reward, as the tiny text demo does.
Train and held-out pictures come from different seeds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

QUESTION = "How many shapes?"
MAX_COUNT = 3
_COLOURS = [(230, 40, 40), (40, 200, 60), (40, 80, 230), (240, 200, 30), (200, 60, 220)]


def shapes_picture(count: int, rng: random.Random):
    """A 56x56 RGB picture with ``count`` squares (in distinct 28x28 cells, jittered)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(4), count):
        x, y = 28 * (cell % 2) + rng.randint(2, 8), 28 * (cell // 2) + rng.randint(2, 8)
        side = rng.randint(12, 16)
        draw.rectangle([x, y, x + side, y + side], fill=rng.choice(_COLOURS))
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
