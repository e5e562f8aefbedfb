"""The ``Backend`` contract and what every backend shares (single process, or DDP through Accelerate).

A backend is built once per run on the run's ``Accelerator`` (``build_backend``) and answers:

* layout: ``shard`` a model (before its optimizer sees its parameters) and ``prepare`` it with its optimizer;
* a micro-batch's gradients: ``hold_gradients`` (accumulate without reducing: DDP's ``no_sync``),
  ``holds_back`` (whether a backward reduces, so all but the mini-batch's last must be held), ``backward``;
* an optimizer step: ``clip_and_step`` (clip the gradient norm, step unless it is not finite, schedule,
  zero; returns the norm), the same for the actor and the critic;
* the full state as named tensors (``full_state``: the weight sync and the export, in an engine's format);
* checkpoints: ``save_model`` / ``load_model`` and ``save_object`` / ``load_object`` (optimizers, schedules,
  an EMA ...) under a stem the checkpoint names (``unirl.trainer.checkpoints``);
* several processes: ``reduce_sum`` and ``gather_rows``.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from unirl.registry import Registry


class Backend:
    """Whole models on every process (one process, or DDP); ``fsdp2`` overrides the layout."""

    #: The ``trainer.strategy`` name; whether it shards models (settings that need whole models refuse it).
    name = "base"
    shards = False

    def __init__(self, accelerator, trainer_cfg):
        self.accelerator, self.cfg = accelerator, trainer_cfg

    # ------------------------------------------------------------ processes
    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.num_processes == 1 else self.accelerator.reduce(tensor, reduction="sum")

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        from unirl.trainer.distributed import gather_rows

        return gather_rows(self.accelerator, t)

    # ------------------------------------------------------------ layout
    def shard(self, model: torch.nn.Module, what: str = "model") -> torch.nn.Module:
        """Lay ``model`` out over the processes before its optimizer is built (whole models: as it is)."""
        return model

    def prepare(self, model: torch.nn.Module, optimizer):
        """``(model, optimizer)`` ready to train (Accelerate's ``prepare``: DDP with several processes)."""
        return self.accelerator.prepare(model, optimizer)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.accelerator.unwrap_model(model)

    def is_sharded(self, model: torch.nn.Module) -> bool:
        return False

    # ------------------------------------------------------------ gradients and steps
    def holds_back(self, model: torch.nn.Module) -> bool:
        """Whether a backward reduces gradients over processes, so all but a mini-batch's last must hold
        them (one process: nothing to hold, and Accelerate's ``no_sync`` costs ~0.1 ms a piece)."""
        return self.num_processes > 1

    @contextlib.contextmanager
    def hold_gradients(self, model: torch.nn.Module) -> Iterator[None]:
        """Gradients accumulate on this process without being reduced (DDP's ``no_sync``)."""
        with self.accelerator.no_sync(model):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss`` is this process's share of the global mini-batch's loss; DDP's gradient average divides
        by the number of processes again, so the backward scales it back."""
        self.accelerator.backward(loss * self.num_processes if self.num_processes > 1 else loss)

    def grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` and return their total norm before clipping."""
        return float(self.accelerator.clip_grad_norm_(model.parameters(), max_norm))

    def clip_and_step(self, model: torch.nn.Module, optimizer, scheduler, max_norm: float | None,
                      what: str = "policy") -> float:
        """Clip the gradient norm (``max_norm``; None: no clipping), step the optimizer unless the norm is
        not finite (the step is skipped with one line), step the schedule, zero the gradients; the norm."""
        norm = float("nan")
        if max_norm is not None:
            norm = self.grad_norm(model, max_norm)
        if math.isfinite(norm) or max_norm is None:
            optimizer.step()
        else:
            self.accelerator.print(f"{what}: non-finite grad norm {norm}; optimizer step skipped")
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    # ------------------------------------------------------------ the full state
    def full_state(self, model: torch.nn.Module, fmt: str, bucket_mb: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The model's weights as buckets of named tensors in ``fmt`` (``unirl.rollout.weights.policy_weights``:
        ``hf_checkpoint`` or ``module_state``), for the weight sync and the export."""
        from unirl.rollout.weights import policy_weights

        return policy_weights(self.unwrap(model), fmt, bucket_mb)

    # ------------------------------------------------------------ checkpoints
    def save_model(self, model: torch.nn.Module, stem: Path) -> None:
        """``<stem>.safetensors`` with the whole model (the main process writes)."""
        from safetensors.torch import save_model

        if self.accelerator.is_main_process:
            save_model(self.unwrap(model), str(stem.with_name(stem.name + ".safetensors")))

    def save_object(self, obj: Any, stem: Path) -> None:
        """``<stem>.{safetensors,json}`` with ``obj.state_dict()`` (the main process writes)."""
        from unirl.trainer.state_files import save_state

        if self.accelerator.is_main_process:
            save_state(obj.state_dict(), stem)

    def load_model(self, model: torch.nn.Module, stem: Path) -> None:
        """What ``save_model`` wrote, or an FSDP2 run's shards (any number of processes) into the whole model."""
        from safetensors.torch import load_model

        from unirl.trainer.checkpoints import ModelMismatch
        from unirl.trainer.sharded_state import has_shards, load_model_shards
        from unirl.trainer.state_files import StateFileError

        if has_shards(stem):
            try:
                load_model_shards(model, stem)
            except ValueError as e:
                raise ModelMismatch(f"{stem}.rank*: does not fit this run's {stem.name} (was it saved with other "
                                    f"model settings, e.g. model.lora.enabled?): {str(e)[:300]}") from e
            return
        file = stem.with_name(stem.name + ".safetensors")
        try:
            load_model(self.unwrap(model), str(file))
        except RuntimeError as e:  # strict loading: the keys or shapes differ
            raise ModelMismatch(f"{file} does not fit this run's {stem.name} (was it saved with other model settings, "
                                f"e.g. model.lora.enabled?): {str(e).strip().splitlines()[0][:300]}") from e
        except Exception as e:  # safetensors' error type: a truncated or corrupt file
            raise StateFileError(f"{file}: cannot be read ({str(e).strip()[:200]})") from e

    def load_object(self, obj: Any, stem: Path, kind: str) -> Any:
        """The state ``save_object`` wrote for ``obj`` (or an FSDP2 run's shards of it, re-sharded for this
        run); ``kind`` is ``optimizer`` for an optimizer (its shards re-sharded by parameter)."""
        from unirl.trainer.sharded_state import has_shards, load_optimizer_shards, materialise_tree, read_shards
        from unirl.trainer.state_files import load_state

        if not has_shards(stem):
            return load_state(stem)
        if kind == "optimizer":
            return load_optimizer_shards(stem, obj)
        return materialise_tree(read_shards(stem), obj.state_dict())


#: The registered backends by ``trainer.strategy`` name (``unirl.trainer.backends`` builds and checks them).
BACKENDS: Registry[Callable[..., Backend]] = Registry("training backend")


def register_backend(name: str):
    """Register a ``Backend`` class (built as ``cls(accelerator, trainer_cfg)``) as ``trainer.strategy: name``."""
    return BACKENDS.register(name)
