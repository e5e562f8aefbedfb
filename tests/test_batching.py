"""Micro-batch planning as pure functions (no model, no processes)."""

from __future__ import annotations

import pytest
import torch

from unirl.trainer.micro_batches import num_mini_batches, plan_micro_batches, scatter_rows, split_to_count


def test_fixed_size_micro_batches_in_order():
    assert plan_micro_batches(7, micro_batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert plan_micro_batches(4, micro_batch_size=4) == [[0, 1, 2, 3]]


def test_token_budget_packs_longest_first_within_the_budget():
    lengths = torch.tensor([5, 9, 3, 9, 2, 4])
    # Longest first: 9 (1), 9 (3) -> 2 x 9 = 18 <= 20; then 5 (0): 3 x 9 = 27 > 20, new chunk;
    # 4 (5): 2 x 5 = 10; 3 (2): 3 x 5 = 15; 2 (4): 4 x 5 = 20 <= 20.
    chunks = plan_micro_batches(6, micro_batch_size=1, lengths=lengths, token_budget=20)
    assert chunks == [[1, 3], [0, 5, 2, 4]]
    for chunk in chunks:
        assert len(chunk) * max(int(lengths[i]) for i in chunk) <= 20
    # A sample longer than the budget goes alone.
    assert plan_micro_batches(2, micro_batch_size=1, lengths=torch.tensor([50, 1]), token_budget=10) == [[0], [1]]


def test_split_to_count_halves_the_largest_and_keeps_every_sample():
    chunks = split_to_count([[0, 1, 2, 3], [4]], 4)
    assert chunks == [[0], [1], [2, 3], [4]]
    assert sorted(i for c in chunks for i in c) == list(range(5))
    assert split_to_count([[0], [1]], 5) == [[0], [1]]  # never more chunks than samples


def test_num_mini_batches_and_scatter_rows():
    assert num_mini_batches(4, 8, 16) == 2
    parts = [(torch.tensor([2, 0]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])), (torch.tensor([1]), torch.tensor([[5.0]]))]
    assert scatter_rows(parts, 3).tolist() == [[3.0, 4.0], [5.0, 0.0], [1.0, 2.0]]
    assert scatter_rows([(torch.tensor([1, 0]), torch.tensor([7, 8]))], 2).tolist() == [8, 7]


def test_scatter_rows_pads_to_the_batch_width():
    parts = [(torch.tensor([1]), torch.tensor([[1.0, 2.0]])), (torch.tensor([0]), torch.tensor([[3.0]]))]
    assert scatter_rows(parts, 2, width=4).tolist() == [[3.0, 0.0, 0.0, 0.0], [1.0, 2.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="width"):
        scatter_rows(parts, 2, width=1)
