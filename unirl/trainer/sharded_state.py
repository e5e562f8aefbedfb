"""Sharded training state (``trainer.strategy: fsdp2``) on disk without pickle, and back on any number
of processes.

Each process writes its own part of a state (a model's ``state_dict``, an optimizer's, an EMA's) with
``unirl.trainer.state_files``'s format: ``<stem>.rank<r>of<W>.safetensors`` with its tensors and
``<stem>.rank<r>of<W>.json`` with the rest, where a sharded tensor (a DTensor, ``Shard(dim)`` over the
processes) is this process's rows plus its place in the whole::

    {"__shard__": "<key>", "dim": 0, "offset": 13, "shape": [25, 64]}

Reading needs no collective and no pickle: a process takes, from every file whose rows overlap them,
only the rows its own shard of the current run needs (``safetensors``' slices, so no process reads
the whole model), or the whole tensor where the current run holds it whole. So a state written by N
processes loads on M (a 2-process FSDP2 checkpoint on one process, under DDP, or the reverse).
FSDP2 splits a dimension of n rows as ``torch.chunk`` does: ceil(n / W) rows a process, the last
ones fewer or none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unirl.trainer.state_files import Piece, StateFileError, chunk_range, decode_lazily, read_json, save_state


@dataclass
class TensorRef:
    """A tensor in a safetensors file, read when needed."""
    file: Path
    key: str

    def read(self, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        from safetensors import safe_open

        try:
            with safe_open(str(self.file), framework="pt") as f:
                if start is None:
                    return f.get_tensor(self.key)
                part = f.get_slice(self.key)
                return part[tuple([slice(None)] * dim + [slice(start, stop)])]
        except Exception as e:  # safetensors' error type: truncated, corrupt, a key missing
            raise StateFileError(f"{self.file}: cannot read tensor {self.key} ({str(e).strip()[:200]})") from e


@dataclass
class Sharded:
    """A tensor written in pieces by several processes."""
    pieces: list[Piece]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.pieces[0].shape


# ===================================================================== write
def save_shards(state: Any, stem: Path, rank: int, world: int) -> None:
    """This process's part of ``state`` as ``<stem>.rank<rank>of<world>.{safetensors,json}``."""
    save_state(state, Path(f"{stem}.rank{rank}of{world}"))


def has_shards(stem: Path) -> bool:
    return any(stem.parent.glob(f"{stem.name}.rank*of*.json"))


# ====================================================================== read
_RANK = re.compile(r"\.rank(\d+)of(\d+)\.json$")


def read_shards(stem: Path) -> Any:
    """The state written by ``save_shards`` on every process, merged: a ``Sharded`` for each sharded
    tensor, a ``TensorRef`` for each other tensor (rank 0's); nothing is read yet but the JSON.
    ``StateFileError`` names a missing or unreadable file."""
    found = {}
    for file in stem.parent.glob(f"{stem.name}.rank*of*.json"):
        m = _RANK.search(file.name)
        if m and file.name == f"{stem.name}.rank{m.group(1)}of{m.group(2)}.json":
            found[(int(m.group(1)), int(m.group(2)))] = file
    worlds = {w for _, w in found}
    if len(worlds) != 1:
        raise StateFileError(f"{stem}.rank*: {'no files' if not worlds else f'written by worlds of {sorted(worlds)}'}")
    (world,) = worlds
    missing = [r for r in range(world) if (r, world) not in found]
    if missing:
        raise StateFileError(f"{stem}.rank{missing[0]}of{world}.json: missing (written by {world} processes)")
    trees = []
    for rank in range(world):
        base = Path(f"{stem}.rank{rank}of{world}")
        tensors = _Refs(Path(str(base) + ".safetensors"))
        try:
            trees.append(decode_lazily(read_json(Path(str(base) + ".json")), tensors))
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise StateFileError(f"{base}.json: cannot be read ({e})") from e
    return _merge(trees, str(stem))


class _Refs(dict):
    def __init__(self, file: Path):
        super().__init__()
        self.file = file

    def __getitem__(self, key: str) -> TensorRef:
        return TensorRef(self.file, key)


def _merge(trees: list, where: str) -> Any:
    first = trees[0]
    if isinstance(first, Piece):
        if not all(isinstance(t, Piece) and t.shape == first.shape and t.dim == first.dim for t in trees):
            raise StateFileError(f"{where}: the processes' pieces of one tensor disagree")
        pieces = sorted(trees, key=lambda p: p.offset)
        return Sharded(pieces)
    if isinstance(first, dict):
        if any(not isinstance(t, dict) or t.keys() != first.keys() for t in trees):
            raise StateFileError(f"{where}: the processes' files hold different states")
        return {k: _merge([t[k] for t in trees], f"{where}[{k!r}]") for k in first}
    if isinstance(first, (list, tuple)):
        merged = [_merge([t[i] for t in trees], f"{where}[{i}]") for i in range(len(first))]
        return type(first)(merged) if isinstance(first, tuple) else merged
    return first


def _read_rows(leaf: Sharded | TensorRef | torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` along ``dim`` of a saved tensor, reading only the pieces that hold them."""
    if isinstance(leaf, torch.Tensor):
        return leaf.narrow(dim, start, stop - start)
    if isinstance(leaf, TensorRef):
        return leaf.read(dim, start, stop)
    parts = []
    for piece in leaf.pieces:
        lo = max(start, piece.offset)
        length = _piece_rows(piece)
        hi = min(stop, piece.offset + length)
        if lo < hi:
            parts.append(_read_rows(piece.data, piece.dim, lo - piece.offset, hi - piece.offset))
    if not parts:
        shape = list(leaf.shape)
        shape[dim] = 0
        return torch.empty(shape)
    return torch.cat(parts, dim=dim)


def _piece_rows(piece: Piece) -> int:
    from safetensors import safe_open

    if isinstance(piece.data, torch.Tensor):
        return piece.data.shape[piece.dim]
    with safe_open(str(piece.data.file), framework="pt") as f:
        return f.get_slice(piece.data.key).get_shape()[piece.dim]


def is_saved_tensor(leaf: Any) -> bool:
    return isinstance(leaf, (Sharded, TensorRef, torch.Tensor))


def saved_shape(leaf: Any) -> tuple[int, ...]:
    from safetensors import safe_open

    if isinstance(leaf, Sharded):
        return tuple(leaf.shape)
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape)
    with safe_open(str(leaf.file), framework="pt") as f:
        return tuple(f.get_slice(leaf.key).get_shape())


def materialise(leaf: Any, like: Any = None) -> Any:
    """A saved tensor as the current run holds ``like``: a DTensor of this process's rows when ``like`` is
    one (same global shape), else the whole tensor. Anything else is returned as it is."""
    from torch.distributed.tensor import DTensor, Shard

    if not is_saved_tensor(leaf):
        return leaf
    if isinstance(like, DTensor) and saved_shape(leaf) == tuple(like.shape):
        (placement,) = like.placements  # FSDP2's Shard(dim) over one mesh dimension (shard_layout's check)
        if not isinstance(placement, Shard):
            raise TypeError(f"a DTensor placed {like.placements} cannot be loaded into")
        mesh = like.device_mesh
        start, stop = chunk_range(like.shape[placement.dim], mesh.size(), mesh.get_local_rank())
        local = _read_rows(leaf, placement.dim, start, stop).to(like.device, like.dtype)
        return DTensor.from_local(local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
    if isinstance(leaf, Sharded):
        return _read_rows(leaf, leaf.pieces[0].dim, 0, leaf.shape[leaf.pieces[0].dim])
    return leaf.read() if isinstance(leaf, TensorRef) else leaf


def materialise_tree(tree: Any, like: Any = None) -> Any:
    """``materialise`` over a nested state, ``like`` the current object's state of the same structure
    (where it has a value for a leaf)."""
    if isinstance(tree, dict):
        return {k: materialise_tree(v, like.get(k) if isinstance(like, dict) else None) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [materialise_tree(v, like[i] if isinstance(like, (list, tuple)) and i < len(like) else None)
                 for i, v in enumerate(tree)]
        return type(tree)(items) if isinstance(tree, tuple) else items
    return materialise(tree, like)


# ============================================================ into the objects
def load_model_shards(model: torch.nn.Module, stem: Path) -> None:
    """Copy a saved state (sharded, from any number of processes) into ``model``'s parameters and
    buffers in place, each process reading only its rows. Raises ``ValueError`` naming a key or shape
    that does not fit."""
    from torch.distributed.tensor import DTensor

    from unirl.sharding import resharded

    tree = read_shards(stem)
    current = resharded(model).state_dict()
    missing, unexpected = sorted(set(current) - set(tree)), sorted(set(tree) - set(current))
    if missing or unexpected:
        raise ValueError(f"keys differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, target in current.items():
            if saved_shape(tree[name]) != tuple(target.shape):
                raise ValueError(f"{name}: saved shape {saved_shape(tree[name])}, this model's {tuple(target.shape)}")
            value = materialise(tree[name], target)
            if isinstance(target, DTensor):
                target.to_local().copy_(value.to_local())
            else:
                target.copy_(value)


def optimizer_like(optimizer) -> dict:
    """A template of an optimizer's state: each parameter (by its index in ``param_groups``) for every
    state tensor of its shape, so sharded moments come back as DTensors placed like their parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]

    class _Each(dict):
        def __init__(self, param):
            super().__init__()
            self.param = param

        def get(self, key, default=None):
            return self.param

    return {"state": {i: _Each(p) for i, p in enumerate(params)}}


def load_optimizer_shards(stem: Path, optimizer) -> Any:
    """The saved optimizer state (``optimizer.state_dict()`` form) resharded for this run."""
    tree = read_shards(stem)
    if not isinstance(tree, dict) or not isinstance(tree.get("state"), dict):
        raise StateFileError(f"{stem}.rank*: not an optimizer's state (no 'state' mapping)")
    like = optimizer_like(optimizer)["state"]
    state = {k: materialise_tree(v, like.get(k)) for k, v in tree["state"].items()}
    return {**{k: materialise_tree(v) for k, v in tree.items() if k != "state"}, "state": state}
