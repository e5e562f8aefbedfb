"""Training state on disk as tensors and plain data only, read back without unpickling.

A nested state (an optimizer's or scheduler's ``state_dict``, an EMA, RNG states) is written as two
files: ``<stem>.safetensors`` with its tensors and ``<stem>.json`` with everything else (dicts,
lists, tuples, numbers, strings, None), where each tensor is a reference into the safetensors file.
Neither format can run code when read, whatever a library would do with a pickle. Anything that is
not one of these types is refused when saving, with the path of the value, rather than pickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


class StateFileError(OSError):
    """A state file that cannot be read back (missing, truncated, corrupt, or not ours)."""


# A sharded tensor (a DTensor, FSDP2's ``Shard(dim)``) is saved as this process's rows and their place in the
# whole; unirl/trainer/sharded_state.py merges the pieces of several processes.
@dataclass
class Piece:
    """One process's rows of a sharded tensor: ``data`` (a tensor, or a ``TensorRef``) holds rows
    ``offset ...`` along ``dim`` of a whole of ``shape``."""
    data: Any
    dim: int
    offset: int
    shape: tuple[int, ...]


def chunk_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``n`` that process ``rank`` of ``world`` holds (``torch.chunk``'s split)."""
    size = -(-n // world) if n else 0
    start = min(rank * size, n)
    return start, min(start + size, n)


def shard_layout(t, path: str = "tensor") -> tuple[int, int]:
    """``(dim, offset)`` of a DTensor sharded ``Shard(dim)`` over a 1-D mesh: where its rows start."""
    from torch.distributed.tensor import Shard

    placements = t.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard):
        raise TypeError(f"{path}: a DTensor placed {placements} cannot be saved (unirl writes FSDP2's Shard(dim) "
                        f"over one mesh dimension)")
    dim = placements[0].dim
    mesh = t.device_mesh
    start, stop = chunk_range(t.shape[dim], mesh.size(), mesh.get_local_rank())
    if t.to_local().shape[dim] != stop - start:
        raise TypeError(f"{path}: local rows {t.to_local().shape[dim]} are not torch.chunk's {stop - start}")
    return dim, start


def save_state(state: Any, stem: Path) -> None:
    """Write ``state`` to ``<stem>.safetensors`` and ``<stem>.json``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    plain = _encode(state, tensors, "state")
    save_file(tensors, str(stem) + ".safetensors")
    Path(str(stem) + ".json").write_text(json.dumps(plain))


def load_state(stem: Path) -> Any:
    """Read back what ``save_state`` wrote (tensors on the CPU); ``StateFileError`` names the file
    that cannot be read."""
    from safetensors.torch import load_file

    tensor_file, json_file = Path(str(stem) + ".safetensors"), Path(str(stem) + ".json")
    try:
        tensors = load_file(str(tensor_file))
    except Exception as e:  # safetensors' own error type, or OSError
        raise StateFileError(f"{tensor_file}: cannot be read ({_first_line(e)})") from e
    plain = read_json(json_file)
    try:
        return _decode(plain, tensors)
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:  # OverflowError: Infinity as an int
        raise StateFileError(f"{json_file}: cannot be read ({_first_line(e)})") from e


def read_json(file: Path) -> Any:
    """A JSON file of a checkpoint, read strictly: ``StateFileError`` naming the file when it is missing,
    not JSON, nested deeper than Python can follow, or holds a number too large for a float (``1e999``
    would read as inf; a NaN or inf we wrote is spelled ``NaN`` / ``Infinity`` and still reads back)."""
    try:
        return json.loads(Path(file).read_text(), parse_float=_finite_float)
    except RecursionError:
        raise StateFileError(f"{file}: cannot be read (nested too deeply to be a checkpoint's file)") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise StateFileError(f"{file}: cannot be read ({_first_line(e)})") from e


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is too large for a float")
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# A JSON object of ours is tagged by one of these keys; a dict whose keys are all strings and none of
# them a tag is written as a plain JSON object.
_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__items__", "__npscalar__", "__shard__")


def _encode(value: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _is_dtensor(value):  # FSDP2: this process's rows, and where they sit in the whole (unirl.trainer.sharded_state)
        dim, offset = shard_layout(value, path)
        key = str(len(tensors))
        tensors[key] = value.to_local().detach().to("cpu", copy=True).contiguous()
        return {"__shard__": key, "dim": dim, "offset": offset, "shape": list(value.shape)}
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        # A copy on the CPU, contiguous and owning its memory (safetensors refuses shared storage).
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        key = str(len(tensors))
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value).astype(np.int64 if value.dtype.kind in "iub" else
                                                                          np.float64))
        return {"__ndarray__": key, "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return {"__npscalar__": value.item(), "dtype": value.dtype.str}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: _encode(v, tensors, f"{path}.{k}") for k, v in value.items()}
        return {"__items__": [[_encode(k, tensors, f"{path} key"), _encode(v, tensors, f"{path}[{k!r}]")]
                              for k, v in value.items()]}
    raise TypeError(f"{path}: a {type(value).__name__} cannot be saved as tensors and plain data (it would need "
                    f"pickle); state_dict() should return tensors, numbers, strings, lists and dicts")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__shard__" in value:
        return Piece(tensors[value["__shard__"]], int(value["dim"]), int(value["offset"]), tuple(map(int, value["shape"])))
    if "__ndarray__" in value:
        return tensors[value["__ndarray__"]].numpy().astype(np.dtype(value["dtype"]))
    if "__npscalar__" in value:
        return np.dtype(value["dtype"]).type(value["__npscalar__"])
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def decode_lazily(plain: Any, tensors: Any) -> Any:
    """``plain`` (a state's JSON) with each tensor reference replaced by ``tensors[key]`` (any mapping:
    the sharded reader passes references that read rows on demand)."""
    return _decode(plain, tensors)
