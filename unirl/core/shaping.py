"""Reward shaping by response length. Pure functions over tensors.

DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, section 3.4; verl's DAPO reward
manager, ``reward_model.overlong_buffer``): a response that runs into the last ``buffer`` tokens before
the maximum length loses reward linearly, from 0 at ``max_length - buffer`` tokens to ``factor`` at
``max_length``, so the policy learns to finish before it is cut off::

    penalty = min(0, -(length - (max_length - buffer)) / buffer * factor)
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, *, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """The penalty [N] (<= 0) added to each response's reward.

    Args:
        lengths: [N] response lengths in tokens.
        max_length: the maximum response length (``rollout.max_new_tokens``).
        buffer: the last ``buffer`` tokens that are penalised, 1 <= buffer <= max_length.
        factor: the penalty at ``max_length`` (verl's ``penalty_factor``).
    """
    if not 1 <= buffer <= max_length:
        raise ValueError(f"buffer must be in [1, max_length={max_length}], got {buffer}")
    expected = max_length - buffer
    return (-(lengths.float() - expected) / buffer * factor).clamp(max=0.0)
