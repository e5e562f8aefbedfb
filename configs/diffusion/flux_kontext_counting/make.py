"""How the files beside this script were made (run from the repository root; deterministic).

The 320 counting rows of GenEval's metadata (``unirl://geneval/test_metadata.jsonl``), each turned into an
edit of a plain background: ``"a photo of three apples"`` -> ``"add three apples"``, its GenEval fields
kept for the ``geneval`` reward, and ``image`` one of 8 solid 512 px backgrounds (PALETTE's colours) in turn. Every 8th row is
held out for evaluation.
"""

import json
from pathlib import Path

from PIL import Image

from unirl.data.paths import bundled_path
from unirl.rewards.image import PALETTE

here = Path(__file__).resolve().parent
for name, rgb in PALETTE.items():
    Image.new("RGB", (512, 512), rgb).save(here / f"{name}.png", optimize=True)
rows = [json.loads(line) for line in bundled_path("geneval/test_metadata.jsonl").read_text().splitlines() if line.strip()]
edits = []
for i, row in enumerate(r for r in rows if r["tag"] == "counting"):
    prompt = "add " + row["prompt"].removeprefix("a photo of ")
    colour = list(PALETTE)[(i + i // 8) % len(PALETTE)]  # cycles within both splits
    edits.append({**row, "prompt": prompt, "image": f"{colour}.png"})
for split, part in (("train", [e for i, e in enumerate(edits) if i % 8]), ("test", edits[::8])):
    (here / f"{split}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in part))
