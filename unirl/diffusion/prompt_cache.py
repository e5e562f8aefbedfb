"""Prompt embeddings kept across steps (``sampling.prompt_cache_size``): the frozen text encoders' output for a
prompt is the same every time it is drawn, so a bounded cache returns it instead of running the encoders again
(issue 49: a step that does not recompute what it has; verl-omni and Flow-Factory precompute them per dataset).

Exact by construction: a prompt's entry is its encoding alone (a batch of one row, ``encode([row])``), and a
hit returns those tensors, so every call gives, row for row, bit for bit what encoding that row alone gives
(tested). Without the cache the environment encodes a step's rows in one batch, which on a CPU differs from
one-row encodings in the last bits (matrix kernels depend on the batch size: ~2e-7 on the toy SD3): the cache
is off by default so the runs of existing configs keep their numbers. Only the transformer trains, so the
encoders' output never goes stale; the cache holds at most ``size`` prompts and drops the least recently used.

Shapes: n rows, each entry ``{key: [1, ...]}`` as the family's ``encode`` returns for one row.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch


class PromptCache:
    """The encodings of at most ``size`` rows, by ``(prompt, image)``; ``hits`` and ``misses`` count rows."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"sampling.prompt_cache_size must be >= 1 to cache (0 turns it off), got {size}")
        self.size = size
        self.entries: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0

    def encode(self, rows: list[dict], encode_rows: Callable[[list[dict]], dict[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
        """``{key: [n, ...]}`` for ``rows``: each row's cached encoding, or ``encode_rows([row])`` for a row not
        cached (then kept, the least recently used entry dropped past ``size``)."""
        parts = []
        for row in rows:
            key = (row["prompt"], row.get("image"))
            entry = self.entries.get(key)
            if entry is None:
                self.misses += 1
                entry = encode_rows([row])  # each [1, ...]: the row alone, as every later hit returns it
                self.entries[key] = entry
                if len(self.entries) > self.size:
                    self.entries.popitem(last=False)
            else:
                self.hits += 1
                self.entries.move_to_end(key)
            parts.append(entry)
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}  # [n, ...]
