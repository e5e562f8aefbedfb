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
