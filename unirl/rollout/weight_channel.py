"""The weights' way from a trainer into the rollout server's process: a two-process gloo group of its own
(``torch.distributed.ProcessGroupGloo`` over a ``TCPStore`` the trainer opens), not the default process
group, so neither side's own distributed set-up is touched and a restarted trainer simply opens a new one.

A push: the trainer tells the server over HTTP which tensors follow (names, shapes, dtypes), then
broadcasts each from rank 0; the server receives them into fresh tensors and loads them into its engine.
Measured against one safetensors file over HTTP in benchmarks/README.md ("Weight push"): about 10x faster
on this CPU, with no serialisation copy on either side.
"""

from __future__ import annotations

import datetime

import torch


class WeightGroup:
    """The two-process gloo group and its store (kept alive together)."""

    def __init__(self, host: str, port: int, rank: int, timeout_s: float):
        """Rank 0 (the trainer) opens the store at ``host:port``, rank 1 (the server) joins it; blocks
        until both are in."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        self.group = dist.ProcessGroupGloo(self.store, rank, 2, timeout)

    def send(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast each tensor from rank 0, in order."""
        for _, tensor in weights:
            self.group.broadcast(tensor.detach().to("cpu").contiguous(), 0).wait()

    def receive(self, specs: list[dict]) -> list[tuple[str, torch.Tensor]]:
        """The tensors ``describe`` listed, received in order into fresh CPU tensors."""
        out = []
        for spec in specs:
            dtype = getattr(torch, spec["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"weights: {spec['name']} has an unknown dtype {spec['dtype']!r}")
            tensor = torch.empty(spec["shape"], dtype=dtype)
            self.group.broadcast(tensor, 0).wait()
            out.append((spec["name"], tensor))
        return out


def describe(weights: list[tuple[str, torch.Tensor]]) -> list[dict]:
    """What the receiver allocates: each tensor's name, shape and dtype."""
    return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in weights]


#: A served tensor's shape and dtype, as the server's checkpoint holds it.
ServedParams = dict[str, tuple[tuple[int, ...], torch.dtype]]

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def served_params(model_dir: str) -> ServedParams | None:
    """The served model's tensors (HF checkpoint names: what a trainer pushes) with their shapes and dtypes,
    read from the headers of ``model_dir``'s safetensors files (no tensor is loaded); None when it has none.
    A model with tied embeddings also takes ``lm_head.weight`` (a trainer's ``state_dict`` lists it; vLLM
    skips it) shaped as the embedding."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    params: ServedParams = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                params[name] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.uint8))
    config = Path(model_dir) / "config.json"
    tied = json.loads(config.read_text()).get("tie_word_embeddings", False) if config.is_file() else False
    embed = next((n for n in params if n.endswith("embed_tokens.weight")), None)
    if tied and embed is not None and "lm_head.weight" not in params:
        params["lm_head.weight"] = params[embed]
    return params


def check_specs(specs: list[dict], served: ServedParams, where: str) -> None:
    """A ValueError naming the first tensor of ``specs`` (``describe``'s) the served model does not hold as
    given: an unknown name, another shape, or a dtype that cannot be copied into it (an integer tensor for a
    floating parameter, or another integer type). Checked before anything is loaded, so a refused push changes
    nothing the server serves. ``where``: who says so (the server's URL on the trainer's side)."""
    for spec in specs:
        name, shape, dtype = spec.get("name"), spec.get("shape"), spec.get("dtype")
        if not isinstance(name, str) or name not in served:
            near = sorted(n for n in served if isinstance(name, str) and n.split(".")[-1] == name.split(".")[-1])[:3]
            raise ValueError(f"{where}: tensor {name!r} is not a parameter of the served model"
                             + (f" (did you mean {', '.join(near)}?)" if near else "")
                             + "; the trainer's model must be the one the server serves")
        want_shape, want_dtype = served[name]
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)) \
                or tuple(shape) != want_shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {shape!r}, the served model's is {list(want_shape)}")
        got = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(got, torch.dtype) or got.is_floating_point != want_dtype.is_floating_point \
                or (not got.is_floating_point and got != want_dtype):
            raise ValueError(f"{where}: tensor {name!r} has dtype {dtype!r}, the served model's is "
                             f"{str(want_dtype).removeprefix('torch.')} (a floating dtype converts)")
