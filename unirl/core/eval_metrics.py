"""Held-out figures from n answers per prompt: avg@k and pass@k with the unbiased estimator.

Legend: P prompts, n answers to each. ``correct`` [P, n] says which answers are right (the text
environment counts an answer right when it gets its reward's full score, ``unirl/text/held_out.py``).

* ``avg@n``: the mean correctness over all P * n answers, the expected accuracy of one sampled answer
  (verl's ``mean@N`` of a 0/1 score; with n = 1 greedy answers, the accuracy).
* ``pass@k``: the chance that at least one of k answers drawn without replacement from a prompt's n is
  right, ``1 - C(n - c, k) / C(n, k)`` with c right (Chen et al. 2021, https://arxiv.org/abs/2107.03374,
  the unbiased estimator), averaged over prompts; pass@1 equals avg@n.
"""

from __future__ import annotations

import math

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples with c correct (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)``.

    >>> pass_at_k(4, 0, 1), pass_at_k(4, 4, 2), round(pass_at_k(4, 1, 2), 4)
    (0.0, 1.0, 0.5)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct: torch.Tensor, k: int) -> torch.Tensor:
    """pass@k averaged over prompts, a 0-dim float64 tensor; ``correct`` [P, n] boolean, 1 <= k <= n.

    Per prompt with c right, ``C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)`` (Chen et al.'s
    numerically stable form): a factor is 0 when some i equals k, i.e. when n - c < k, so pass@k is 1 there."""
    if correct.ndim != 2:
        raise ValueError(f"correct must be [prompts, answers], got shape {tuple(correct.shape)}")
    n = correct.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} answers per prompt")
    c = correct.sum(dim=-1)  # [P]
    i = torch.arange(1, n + 1, dtype=torch.float64, device=correct.device)  # [n]
    in_product = i.unsqueeze(0) > (n - c).unsqueeze(-1)  # [P, n]: i in (n - c, n]
    none_right = torch.where(in_product, 1.0 - k / i, 1.0).prod(dim=-1)  # [P]
    return (1.0 - none_right).mean()


def avg_at_k(correct: torch.Tensor) -> torch.Tensor:
    """avg@n: the mean correctness over all answers, a 0-dim float64 tensor; ``correct`` [P, n] boolean."""
    return correct.to(torch.float64).mean()
