"""The LAION improved aesthetic predictor's MLP head (https://github.com/christophschuhmann/improved-aesthetic-predictor),
used by the ``aesthetic`` reward (``unirl/rewards/clip_rewards.py``). Apart from that file so that listing the
rewards imports no torch."""

from __future__ import annotations

import torch
from torch import nn


class AestheticHead(nn.Module):
    """The improved aesthetic predictor's MLP (its ``MLP`` class, state-dict keys ``layers.N.*``).

    The dropouts do nothing in eval mode; they are kept so that the layer indices, and thus the keys
    of the published weights, match.
    """

    def __init__(self, input_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_dim, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[n, input_dim] normalised image embeddings -> [n, 1] predicted ratings."""
        return self.layers(embeddings)
