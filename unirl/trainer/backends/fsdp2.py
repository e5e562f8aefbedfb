"""FSDP2 (``trainer.strategy: fsdp2``, the ``fsdp2`` backend): the trained models sharded over the processes by
unirl itself.

PyTorch's ``torch.distributed.fsdp.fully_shard`` is applied to each transformer block (the classes a
model lists in ``_no_split_modules``: transformers' decoder layers, diffusers' transformer blocks) and
then to the root, as verl's ``apply_fsdp2`` and torchtitan do. Each parameter becomes a DTensor holding
its process's rows (``Shard(0)``); a block's parameters are all-gathered just before its forward and
backward and freed after, and its gradients are reduce-scattered (averaged over the processes, as
DDP's all-reduce averages them), so each process keeps 1/N of the parameters, gradients and AdamW
state. unirl drives it (not Accelerate's FSDP plugin, which applies FSDP only on accelerators), so the
same code runs over gloo on CPUs and NCCL on GPUs, with one process too (a world of one).

On a GPU with ``trainer.mixed_precision: bf16``, the blocks compute in bfloat16 and reduce gradients in
float32 (``MixedPrecisionPolicy``); on the CPU and otherwise, no policy: parameters, compute and
reduction in the model's dtype (float32 runs match DDP to 1e-5, ``tests/test_fsdp.py``).
``trainer.fsdp.offload: params`` adds torch's ``CPUOffloadPolicy``. A PEFT model's wrapped model is the
root (its ``generate`` calls that model past the wrapper). The sharded model is not given to
Accelerate's ``prepare`` (on CPU processes it would wrap it in DDP): only its optimizer is.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from unirl.sharding import fsdp_unit, full, gathered_state, is_sharded, resharded  # noqa: F401 (also the trainer's names)
from unirl.trainer.backends.base import Backend, register_backend


@register_backend("fsdp2")
class FSDP2Backend(Backend):
    """Each trained model sharded block by block (``shard``); gradients reduce-scattered in the mini-batch's
    last backward; the gradient norm gathered over the shards; checkpoints written as each process's shards
    (``unirl.trainer.sharded_state``: any number of processes reads them back)."""

    name = "fsdp2"
    shards = True
    #: fp16's loss scaler does not unscale DTensor shards.
    refuses_mixed_precision = {"fp16": "use bf16 (FSDP2's mixed-precision policy) or no"}

    def __init__(self, accelerator, trainer_cfg):
        super().__init__(accelerator, trainer_cfg)
        ensure_process_group(accelerator)

    def shard(self, model: torch.nn.Module, what: str = "model") -> torch.nn.Module:
        return shard(model, self.accelerator, mixed_precision=self.cfg.mixed_precision, offload=self.cfg.fsdp.offload,
                     what=what)

    def prepare(self, model: torch.nn.Module, optimizer):
        return prepare(self.accelerator, model, optimizer)

    def is_sharded(self, model: torch.nn.Module) -> bool:
        return is_sharded(self.unwrap(model))

    def holds_back(self, model: torch.nn.Module) -> bool:
        return True  # the shards' gradients are reduce-scattered in a backward, even in a world of one

    @contextlib.contextmanager
    def hold_gradients(self, model: torch.nn.Module) -> Iterator[None]:
        with hold_gradients(self.accelerator, model):
            yield

    def grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        return float(full(self.accelerator.clip_grad_norm_(model.parameters(), max_norm)))

    def save_model(self, model: torch.nn.Module, stem: Path) -> None:
        """Every process writes its shards (``<stem>.rank<r>of<W>.*``)."""
        from unirl.trainer.sharded_state import save_shards

        save_shards(resharded(model).state_dict(), stem, self.accelerator.process_index, self.num_processes)

    def save_object(self, obj: Any, stem: Path) -> None:
        """Every process writes its part of ``obj``'s state (an optimizer's shards, an EMA's; plain numbers whole)."""
        from unirl.trainer.sharded_state import save_shards

        save_shards(obj.state_dict(), stem, self.accelerator.process_index, self.num_processes)

    def load_model(self, model: torch.nn.Module, stem: Path) -> None:
        from unirl.trainer.checkpoints import CheckpointError
        from unirl.trainer.sharded_state import has_shards

        if not has_shards(stem):
            raise CheckpointError(f"{stem}.safetensors: written by a run holding whole models (trainer.strategy=ddp), "
                                  f"which an FSDP2 run does not read; resume with trainer.strategy=ddp")
        super().load_model(model, stem)


def ensure_process_group(accelerator) -> None:
    """A process group for ``fully_shard``: torchrun's (Accelerate set it up), or a world of one when a
    single process runs without a launcher (a store in memory: no port, no rendezvous)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def device_mesh(accelerator):
    """The 1-D mesh of all processes that every sharded model uses."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(accelerator.device.type, (dist.get_world_size(),))


def block_classes(model: torch.nn.Module) -> set[str]:
    """The class names of ``model``'s transformer blocks: every ``_no_split_modules`` its submodules
    declare (a PEFT wrapper's base model, a token-classification critic, a diffusers transformer)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard(model: torch.nn.Module, accelerator, *, mixed_precision: str = "no", offload: str = "none",
          what: str = "model") -> torch.nn.Module:
    """``fully_shard`` each transformer block of ``model`` and then its root; returns ``model`` (the same
    object, now an ``FSDPModule``). A model without declared blocks is refused: sharding only the root
    would gather the whole model at every forward, which is DDP's memory with FSDP's traffic."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if is_sharded(model):
        return model
    blocks = block_classes(model)
    if not blocks:
        raise ValueError(f"trainer.strategy=fsdp2: the {what} ({type(model).__name__}) declares no transformer "
                         f"blocks (_no_split_modules), so unirl cannot shard it block by block; use trainer.strategy=ddp")
    model.to(accelerator.device)  # with offload, fully_shard moves the shards to the host
    kwargs = {"mesh": device_mesh(accelerator)}
    if accelerator.device.type != "cpu" and mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload == "params":  # shards, gradients and AdamW state in host memory (pinned for fast copies on GPUs)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=accelerator.device.type == "cuda")
    found = [m for m in model.modules() if m is not model and type(m).__name__ in blocks]
    if not found:
        raise ValueError(f"trainer.strategy=fsdp2: none of the {what}'s blocks ({', '.join(sorted(blocks))}) is "
                         f"among its modules; use trainer.strategy=ddp")
    for block in found:
        fully_shard(block, **kwargs)
    # A PEFT wrapper's generate() calls the wrapped model directly, past the wrapper's forward: the
    # wrapped model (which holds every parameter) is the root, so it gathers whichever way it is called.
    fully_shard(model.get_base_model() if hasattr(model, "get_base_model") else model, **kwargs)
    return model


@contextlib.contextmanager
def hold_gradients(accelerator, model: torch.nn.Module) -> Iterator[None]:
    """Gradients accumulate on this process without being reduced (DDP's ``no_sync``; FSDP2 keeps
    them unsharded until the backward outside this block reduce-scatters their sum)."""
    if not is_sharded(model):
        with accelerator.no_sync(model):
            yield
        return
    unit = fsdp_unit(model)
    unit.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        unit.set_requires_gradient_sync(True)


def prepare(accelerator, model: torch.nn.Module, optimizer):
    """A sharded model is not given to Accelerate (on CPU processes it would wrap it in DDP): only its
    optimizer is prepared."""
    if not is_sharded(model):
        return accelerator.prepare(model, optimizer)
    return model, accelerator.prepare_optimizer(optimizer)
