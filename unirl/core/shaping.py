"""Reward shaping by response length. Pure functions over tensors.

DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, section 3.4; verl's DAPO reward
manager, ``reward_model.overlong_buffer``): a response that runs into the last ``buffer`` tokens before
the maximum length loses reward linearly, from 0 at ``max_length - buffer`` tokens to ``factor`` at
``max_length``, so the policy learns to finish before it is cut off::

    penalty = max(-factor, min(0, -(length - (max_length - buffer)) / buffer * factor))

The bound at ``-factor`` changes nothing where verl's formula applies (its responses never pass its
``max_response_length``); it holds the penalty where a length may pass ``max_length``: a multi-turn
response, whose observations count in its length as they do in verl's attention mask.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, *, max_length: int | torch.Tensor, buffer: int,
                     factor: float = 1.0) -> torch.Tensor:
    """The penalty [N] (in [-factor, 0]) added to each response's reward.

    Args:
        lengths: [N] response lengths in tokens.
        max_length: the maximum response length (``rollout.max_new_tokens``), or [N] one per response
            (a multi-turn response's room under ``rollout.max_total_tokens``).
        buffer: the last ``buffer`` tokens that are penalised, 1 <= buffer <= max_length (checked for an int).
        factor: the penalty at ``max_length`` (verl's ``penalty_factor``), >= 0.
    """
    if not isinstance(max_length, torch.Tensor) and not 1 <= buffer <= max_length:
        raise ValueError(f"buffer must be in [1, max_length={max_length}], got {buffer}")
    if buffer < 1 or factor < 0:
        raise ValueError(f"buffer must be >= 1 and factor >= 0, got {buffer}, {factor}")
    expected = max_length - buffer  # [] or [N]
    return (-(lengths.float() - expected) / buffer * factor).clamp(min=-factor, max=0.0)
