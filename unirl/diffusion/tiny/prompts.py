"""The tiny demo's prompts, "a <colour> <thing>", built in code so the demo needs no data file."""

from __future__ import annotations

# Prompts of the tiny demo: built in code, so the demo needs no data file. The toy model's text
# encoders are random, so the words matter only as distinct conditionings.
TINY_COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
TINY_THINGS = ["cat", "house", "tree", "car", "boat", "flower", "bird", "lamp"]


def tiny_prompts(split: str = "train") -> list[str]:
    """The tiny demo's prompts: 56 ``"a <colour> <thing>"`` prompts for ``train``, 8 held out for ``test``.

    >>> tiny_prompts("test")[:2]
    ['a red cat', 'a blue house']
    >>> len(tiny_prompts("train")), len(set(tiny_prompts("train")) & set(tiny_prompts("test")))
    (56, 0)
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pairs = [(c, t) for c in TINY_COLOURS for t in TINY_THINGS]  # 64
    held_out = {(TINY_COLOURS[i], TINY_THINGS[i]) for i in range(len(TINY_COLOURS))}  # the diagonal, 8
    chosen = [p for p in pairs if (p in held_out) == (split == "test")]
    if split == "test":
        chosen.sort(key=lambda p: TINY_COLOURS.index(p[0]))
    return [f"a {c} {t}" for c, t in chosen]
