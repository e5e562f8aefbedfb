"""How a step's samples are cut for the trainer's passes: mini-batches (one optimizer step each) and
micro-batches (one forward/backward each, gradients accumulating). Pure functions of sample counts
and lengths, no model and no processes, so the planning is testable on its own.
"""

from __future__ import annotations

import torch


def num_mini_batches(prompts_per_step: int, group_size: int, mini_batch_size: int) -> int:
    """Optimizer steps per pass over a step's B*G samples."""
    return prompts_per_step * group_size // mini_batch_size


def plan_micro_batches(n: int, *, micro_batch_size: int, lengths: torch.Tensor | None = None,
                       token_budget: int | None = None) -> list[list[int]]:
    """The micro-batches of ``n`` samples as lists of sample indices.

    Without a token budget: ``micro_batch_size`` samples each, in order. With one (verl's dynamic
    batch size for padded batches): samples sorted by ``lengths`` [n] (longest first, stable) and
    packed while the micro-batch's sample count x its longest sample stays within the budget; a
    longer sample goes alone."""
    if token_budget is None:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
    chunks: list[list[int]] = []
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * int(lengths[chunks[-1][0]]) <= token_budget:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def split_to_count(chunks: list[list[int]], count: int) -> list[list[int]]:
    """``chunks`` split further until there are ``count`` of them (as many as the samples allow):
    the largest is halved each time, so its cost can only go down. With several processes every one
    runs as many micro-batches as the busiest, as FSDP's collective forwards need."""
    chunks = list(chunks)
    count = min(count, sum(len(c) for c in chunks))
    while len(chunks) < count:
        largest = max(range(len(chunks)), key=lambda c: len(chunks[c]))
        chunk = chunks.pop(largest)
        chunks[largest:largest] = [chunk[: len(chunk) // 2], chunk[len(chunk) // 2:]]
    return chunks


def scatter_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], n: int, width: int | None = None) -> torch.Tensor:
    """Rows ``[k, T_k, ...]`` of sub-batches (given as index tensors into n samples) put back in
    sample order: ``[n, width, ...]``, narrower parts right-padded with zeros (micro-batches
    trimmed to their own longest sample). ``width`` is the whole batch's T: a micro-batch is trimmed
    to its longest *trained* tokens, so when the batch's widest sample ends in masked tokens (a
    truncated response with ``mask_truncated_completions``) every part is narrower than the batch.
    None: the widest part's. 1-D parts ``[k]`` give ``[n]``."""
    first = parts[0][1]
    shape = [n] + [max(v.shape[d] for _, v in parts) for d in range(1, first.ndim)]
    if width is not None and first.ndim >= 2:
        if width < shape[1]:
            raise ValueError(f"scatter_rows: a part is {shape[1]} wide, more than the batch's width {width}")
        shape[1] = width
    out = first.new_zeros(shape)
    for idx, v in parts:
        if v.ndim >= 2:
            out[idx, : v.shape[1]] = v
        else:
            out[idx] = v
    return out
