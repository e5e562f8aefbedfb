"""Which groups carry a learning signal. Pure functions over tensors.

DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476, section 3.2; verl's
``algorithm.filter_groups``) drops the groups whose samples all got the same value of a chosen metric
(all solved or all failed): their group-relative advantages are zero, so they only dilute the batch.
"""

from __future__ import annotations

import torch


def nonconstant_groups(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] bool: True for the samples of the groups whose ``values`` are not all equal.

    As verl's filter (which keeps a group when the std of its metric is > 0, or when it has a single
    sample), a group of one sample is kept. NaN (a reward that does not apply) is ignored; a group
    with no value at all is constant.

    Args:
        values: [N] the metric of each sample (a raw reward component).
        group_ids: [N] integer group of each sample.
    """
    if values.ndim != 1 or group_ids.shape != values.shape:
        raise ValueError(f"values and group_ids must be [N] each, got {tuple(values.shape)} and {tuple(group_ids.shape)}")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)  # [K], [N]
    # Compared in the values' own precision (float64 stays float64): groups that differ below float32's
    # resolution vary too. Integer and boolean values are exact in float64.
    v = values if values.is_floating_point() else values.double()
    known = ~torch.isnan(v)  # [N]
    k = len(uniq)
    highest = torch.full((k,), -torch.inf, dtype=v.dtype, device=v.device).scatter_reduce(
        0, inverse[known], v[known], reduce="amax")  # [K]
    lowest = torch.full((k,), torch.inf, dtype=v.dtype, device=v.device).scatter_reduce(
        0, inverse[known], v[known], reduce="amin")  # [K]
    sizes = torch.zeros(k, dtype=torch.long, device=v.device).index_add_(0, inverse, torch.ones_like(inverse))  # [K]
    varies = (highest > lowest) | (sizes == 1)  # [K]
    return varies[inverse]
