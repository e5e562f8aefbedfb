"""Several processes as one run: how they are launched and how per-process tensors become global.

The loop keeps each process's own samples and gathers only what a global figure needs (rewards,
group ids and masks for the advantages, statistics for logging). One process: every function here
returns its input unchanged.
"""

from __future__ import annotations

import os

import torch


class LaunchError(RuntimeError):
    """The processes were launched in a way that cannot work (the message says how to launch)."""


def cpu_processes() -> bool:
    """Whether to run as CPU processes over gloo: asked for (``ACCELERATE_USE_CPU``), or several
    processes were launched (``torchrun``/``accelerate launch --multi_gpu``) on a machine without
    CUDA, where Accelerate would otherwise leave each process alone in a world of one."""
    from accelerate.utils import str_to_bool

    asked = str_to_bool(os.environ.get("ACCELERATE_USE_CPU", "false"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if asked and world == 1 and "MASTER_PORT" in os.environ and "RANK" not in os.environ:
        # `accelerate launch --cpu --num_processes N` without MPI starts a single process.
        raise LaunchError(
            "accelerate launch --cpu started one process (several CPU processes need mpirun there); "
            "launch N CPU processes with `torchrun --nproc_per_node N -m unirl.cli train ...` instead"
        )
    return asked or (world > 1 and not torch.cuda.is_available())


def gather_rows(accelerator, t: torch.Tensor) -> torch.Tensor:
    """A per-sample tensor ``[n, ...]`` of every process, concatenated in rank order (on CPU).

    The row counts may differ between processes, and a second dim of different widths (text
    responses) is right-padded with zeros. One process: ``t`` itself."""
    acc = accelerator
    if acc.num_processes == 1:
        return t
    dtype = t.dtype
    x = t.to(acc.device, torch.long if dtype == torch.bool else dtype)
    sizes = acc.gather(torch.tensor([x.shape[0]], device=acc.device)).tolist()  # [world]
    if x.ndim >= 2:
        x = acc.pad_across_processes(x, dim=1)
    x = acc.pad_across_processes(x, dim=0)
    full = acc.gather(x).cpu()
    rows = full.shape[0] // acc.num_processes
    return torch.cat([full[r * rows:r * rows + n] for r, n in enumerate(sizes)]).to(dtype)


def sum_over_processes(accelerator, value: float) -> float:
    """``value`` summed over the processes (itself with one)."""
    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(t, reduction="sum"))
