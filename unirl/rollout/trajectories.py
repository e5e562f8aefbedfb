"""Token trajectories as a text rollout's tensors: what an environment's episodes (``unirl/agents/episodes.py``)
and an agent's recorded sessions (``unirl/rollout/sessions.py``) both become.

A trajectory is a prompt (token ids) and a response: every token after the prompt, the generated ones
(trained, ``loss_mask`` 1, with the engine's log-prob and the weight version that sampled them) and the
ones the policy was shown between its turns (observations, tool results, the agent's next message:
``loss_mask`` 0, never trained, version -1).

Shapes: N trajectories, P prompt tokens (left-padded), R response tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: generated (trained), 0: shown to the policy
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 where not generated
    versions: list[int] = field(default_factory=list)  # optimizer steps of the sampling weights, -1 where not generated


def padded(trajectories: list, pad: int, *, trained: list[bool] | None = None) -> dict[str, torch.Tensor]:
    """``prompt_ids`` / ``prompt_mask`` [N, P] (left-padded), ``response_ids`` [N, R], ``response_attention_mask``
    [N, R] (1 on every response token), ``response_mask`` [N, R] (the loss mask: 1 on generated tokens, and
    0 on every token of a trajectory whose ``trained`` is False), ``engine_logp`` [N, R] float and
    ``token_version`` [N, R] long (-1 off the generated tokens), or no ``token_version`` when no trajectory
    carries a version (the batch's version then stands for every token). ``trajectories``: anything with
    ``Trajectory``'s fields (``unirl.agents.runner.EpisodeTrace`` is one)."""
    N = len(trajectories)
    P = max(len(t.prompt_ids) for t in trajectories)
    R = max(1, max(len(t.ids) for t in trajectories))
    out = {"prompt_ids": torch.full((N, P), pad, dtype=torch.long), "prompt_mask": torch.zeros((N, P), dtype=torch.long),
           "response_ids": torch.full((N, R), pad, dtype=torch.long),
           "response_attention_mask": torch.zeros((N, R)), "response_mask": torch.zeros((N, R)),
           "engine_logp": torch.zeros((N, R)), "token_version": torch.full((N, R), -1, dtype=torch.long)}
    for n, t in enumerate(trajectories):
        p, L = t.prompt_ids, len(t.ids)
        out["prompt_ids"][n, P - len(p):] = torch.tensor(p, dtype=torch.long)
        out["prompt_mask"][n, P - len(p):] = 1
        if not L:
            continue
        out["response_ids"][n, :L] = torch.tensor(t.ids, dtype=torch.long)
        out["response_attention_mask"][n, :L] = 1
        if trained is None or trained[n]:
            out["response_mask"][n, :L] = torch.tensor(t.loss_mask, dtype=torch.float32)
        out["engine_logp"][n, :L] = torch.tensor(t.logprobs, dtype=torch.float32)
        if t.versions:
            out["token_version"][n, :L] = torch.tensor(t.versions, dtype=torch.long)
    if not (out["token_version"] >= 0).any():
        del out["token_version"]
    return out
