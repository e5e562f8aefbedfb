"""Checkpoints of a run: ``<run>/checkpoints/step_N/`` and resuming from the latest.

A checkpoint holds the policy as its library saves it (``env.save_pretrained``: HF
``save_pretrained``, a LoRA adapter, a diffusers transformer) and ``trainer_state/``, each object under
its own name (the trainer's ``state_objects``: name -> (kind, object)):

    loop.json                     the loop's counters
    config.json                   the run's resolved config (a resume compares its own with it)
    policy.safetensors            each trained model by name (``critic.safetensors`` with PPO); an FSDP2
                                  run's shards as ``policy.rank<r>of<W>.*`` (``unirl.trainer.sharded_state``)
    policy_optimizer.{safetensors,json}, policy_scheduler.{...}   theirs (``critic_optimizer`` ...)
    ema.{...}, old_policy.{...}, source.{...}   the environment's objects (an EMA, NFT's old policy) and the
                                  batch source's in-flight batches: each process's own, ``source.rank<r>of<W>.*``
                                  on W > 1 processes (``unirl.trainer.source_state``)
    scaler.{...}                  fp16's gradient scaler
    rng_<process>.{...}           each process's python, numpy, torch (and CUDA) RNG states

How each is written and read is the backend's (``unirl.trainer.backends``: whole, or each process's shards).
Checkpoints of earlier versions, whose files were numbered by Accelerate's preparation and registration
order (``model_0``, ``optimizer_0``, ``custom_0`` ...), still resume: ``legacy_stems`` gives each named
object its old file.

Only tensors (safetensors) and plain data (JSON) are written, and nothing is unpickled when a run
resumes (``unirl.trainer.state_files``): Accelerate's ``save_state`` pickles the optimizer, the RNG states
and registered objects and loads them with ``torch.load(weights_only=False)``, which runs whatever
code a crafted file holds. Everything is written under a temporary name and renamed, so a crash
never leaves a half checkpoint that resume would pick; a resume that finds the latest checkpoint
unreadable, edited out of range or linked out of the run falls back to the one before, and pruning
removes only checkpoints the run wrote (never a link or a folder under another name).
"""

from __future__ import annotations

import errno
import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unirl.env import StateError
from unirl.trainer.resume_checks import (check_loop_state, check_optimizer, check_scheduler, critic_changes, link_message,
                                 link_out_of, links_out, set_rng_states, trains_a_critic)
from unirl.trainer.source_state import read_source, resample_hint, save_source
from unirl.trainer.state_files import StateFileError, load_state, read_json, save_state


class CheckpointError(OSError):
    """A checkpoint that cannot be written or resumed from; the message names the file and what to do."""


class ModelMismatch(CheckpointError, StateFileError):
    """A checkpoint's model that does not fit this run's (other keys or shapes). Resume skips it and tries the
    one before, as for a damaged file: a file with a key missing is damage when the checkpoint before fits,
    and another model setting fails every checkpoint, which the final error lists."""


#: Optimizer settings that its restored ``param_groups`` carry: resuming with another value would
#: silently keep the saved one (while config.yaml claimed the new), so the change is refused. A key
#: matches under any ``optim`` section (``optim.lr``, ``critic.optim.lr``); any ``lora`` key changes
#: the model's shape.
OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay")


_STEP = re.compile(r"step_(\d{6,})")  # the names save_checkpoint gives: step_000042


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's finished checkpoints (``step_<N>``, links among them), oldest first by step number."""
    found = [(int(m.group(1)), p) for p in (Path(run_dir) / "checkpoints").glob("step_*") if (m := _STEP.fullmatch(p.name))]
    return [path for _, path in sorted(found)]


def _step_of(checkpoint: Path) -> int:
    return int(_STEP.fullmatch(checkpoint.name).group(1))


def _written_here(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is one save_checkpoint wrote: a directory, not a link, whose
    ``trainer_state/loop.json`` (not a link either) holds its own step. Pruning removes nothing else."""
    loop = checkpoint / "trainer_state" / "loop.json"
    if checkpoint.is_symlink() or not checkpoint.is_dir() or loop.is_symlink() or (checkpoint / "trainer_state").is_symlink():
        return False
    try:
        return read_json(loop).get("step") == _step_of(checkpoint)
    except (StateFileError, AttributeError):
        return False


def _check_root(run_dir: Path) -> None:
    """``<run>/checkpoints`` must not lead out of the run: resume would read, and pruning delete, another
    run's checkpoints."""
    root = Path(run_dir) / "checkpoints"
    if links_out(root, run_dir):
        raise CheckpointError(f"checkpoints: {link_message(root)}; unirl writes, resumes and prunes checkpoints only "
                              f"inside the run directory (to keep them on another disk, put the run there: --output-dir)")


def last_checkpoint_hint(run_dir: Path) -> str:
    """What a crash leaves behind, for error messages."""
    steps = checkpoint_dirs(run_dir)
    if not steps:
        return "no checkpoint was written yet"
    return f"the last checkpoint is {steps[-1]} (resume with trainer.resume=true)"


def check_supported(accelerator) -> None:
    """Fail at setup, not at the first save, where the trainer state cannot be written."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise CheckpointError(
            f"checkpoints: Accelerate's {accelerator.distributed_type.value} plugin shards the state in ways unirl's "
            f"pickle-free checkpoints do not read; shard with trainer.strategy=fsdp2 instead (unirl applies FSDP2 "
            f"itself and writes each process's shards), without an Accelerate FSDP/DeepSpeed config")


# ===================================================================== save
def save_checkpoint(backend, env, run_dir: Path, step: int, objects: dict[str, tuple[str, Any]],
                    loop_state: dict[str, Any], keep: int | None, config: dict[str, Any] | None = None) -> Path:
    """Write ``checkpoints/step_<step>/`` (the policy and ``trainer_state/``) on every process (the main
    process writes the shared state, each process its RNG states), then keep the newest ``keep``.

    A failed write (a full disk) removes the partial ``.tmp_step_N`` and says why, naming the last
    complete checkpoint. ``objects``: name -> (kind, object), kind ``model``, ``optimizer``, ``scheduler`` or
    ``state`` (anything with ``state_dict`` / ``load_state_dict``)."""
    accelerator = backend.accelerator
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    _check_root(run_dir)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()  # the directory exists before any process writes into it
    try:
        env.save_pretrained(tmp)
        save_trainer_state(backend, tmp / "trainer_state", objects, loop_state, config or {})
    except Exception as e:  # OSError, or safetensors' own error type ("... (os error 28)") for a full disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {final} failed: {_why(e)}; removed the partial {tmp.name}; "
                              f"{last_checkpoint_hint(run_dir)}") from e
    accelerator.wait_for_everyone()  # every process's files (its shards, its RNG states) are in before the rename
    if accelerator.is_main_process:
        if final.is_symlink():  # removing the link deletes nothing it points to
            print(f"checkpoints: {final} was a link to {final.resolve()}; replaced by this run's checkpoint")
            final.unlink()
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _prune(run_dir, keep)
    accelerator.wait_for_everyone()
    return final


def _why(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left" in text or "os error 28" in text:
        return f"no space left on device ({text})"
    return text


def _prune(run_dir: Path, keep: int | None) -> None:
    """Keep the newest ``keep`` checkpoints this run wrote (``_written_here``); links, copies under
    other names and anything else in the folder are neither counted nor touched."""
    if keep is None:
        return
    for old in [c for c in checkpoint_dirs(run_dir) if _written_here(c)][:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def save_trainer_state(backend, directory: Path, objects: dict[str, tuple[str, Any]], loop_state: dict[str, Any],
                       config: dict[str, Any]) -> None:
    """Every named object (through the backend: whole, or each process's shards), the gradient scaler and
    each process's RNG states, as safetensors + JSON (see the module docstring)."""
    accelerator = backend.accelerator
    check_supported(accelerator)
    if accelerator.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    for name, (kind, obj) in objects.items():
        if kind == "model":
            backend.save_model(obj, directory / name)
        elif name == "source":  # each process's own batches sampled ahead (unirl.trainer.source_state)
            save_source(accelerator, obj, directory / name)
        else:
            backend.save_object(obj, directory / name)
    if accelerator.is_main_process:
        if accelerator.scaler is not None:
            save_state(accelerator.scaler.state_dict(), directory / "scaler")
        (directory / "config.json").write_text(json.dumps(config, default=str))
        (directory / "loop.json").write_text(json.dumps(loop_state))
    save_state(_rng_states(), directory / f"rng_{accelerator.process_index}")


def legacy_stems(objects: dict[str, tuple[str, Any]]) -> dict[str, str]:
    """Each object's file in a checkpoint of an earlier version, which numbered them by Accelerate's
    preparation and registration order: the models and optimizers as prepared (``model_<i>``,
    ``optimizer_<i>``: the policy's, then the critic's), every other object as registered (``custom_<i>``:
    the environment's, the policy's schedule, the critic's, the batch source). ``objects`` is in that order."""
    counts = {"model": 0, "optimizer": 0, "custom": 0}
    out = {}
    for name, (kind, _) in objects.items():
        group = kind if kind in ("model", "optimizer") else "custom"
        out[name] = f"{group}_{counts[group]}"
        counts[group] += 1
    return out


def _rng_states() -> dict[str, Any]:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


# =================================================================== resume
def resume(backend, run_dir: Path, objects: dict[str, tuple[str, Any]],
           config: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Load the latest readable checkpoint's ``trainer_state`` into the prepared objects and return its
    ``loop.json`` (None when there is no checkpoint yet). The logs' rows of steps after it (all rows,
    without a checkpoint) are dropped, so every step appears once.

    A checkpoint with an unreadable file (truncated, corrupt), a field out of type or range, or a link
    out of the run directory (``unirl.trainer.resume_checks``) is skipped with one line naming the file and
    field, and the one before it is tried; every process takes the same one. A ``checkpoints`` folder
    that is itself a link out of the run is refused. A run whose config
    changes a setting the state carries (``optim.*``, ``model.lora.*``) is refused, naming it."""
    accelerator = backend.accelerator
    run_dir = Path(run_dir)
    _check_root(run_dir)
    steps = checkpoint_dirs(run_dir)
    state = None
    if not steps:
        accelerator.print(f"resume: no checkpoint in {run_dir / 'checkpoints'}; starting at step 0")
    problems = []
    for checkpoint in reversed(steps):
        error = None
        try:
            if (link := link_out_of(checkpoint, run_dir)) is not None:
                raise StateFileError(link_message(link))
            check_config(checkpoint / "trainer_state", config)
            state = load_trainer_state(backend, checkpoint / "trainer_state", objects, step=_step_of(checkpoint))
        except StateFileError as e:
            error = e
        if _everyone_ok(accelerator, error is None):
            break
        state = None
        problems.append(str(error or f"{checkpoint}: unreadable on another process"))
        accelerator.print(f"resume: skipping {checkpoint}: {problems[-1]}")
    if steps and state is None:
        raise CheckpointError(f"resume: no checkpoint in {run_dir / 'checkpoints'} can be read: {'; '.join(problems)}")
    if accelerator.is_main_process:
        for name in ("metrics.jsonl", "eval_samples.jsonl", "samples.jsonl"):
            drop_rows_after(run_dir / name, state["step"] if state else -1)
    accelerator.wait_for_everyone()
    if state is not None:
        accelerator.print(f"resumed from {checkpoint} (step {state['step']})")
    return state


def _everyone_ok(accelerator, ok: bool) -> bool:
    if accelerator.num_processes == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], device=accelerator.device)
    return int(accelerator.reduce(flag, reduction="sum")) == 0


def check_config(directory: Path, config: dict[str, Any] | None) -> None:
    """Refuse a resume whose config changes a value the restored state would silently override."""
    saved_file = directory / "config.json"
    if config is None or not saved_file.exists():
        return
    saved = read_json(saved_file)
    if not isinstance(saved, dict):
        raise StateFileError(f"{saved_file}: not a JSON object (the run's config)")
    old, new = _flat(saved), _flat(json.loads(json.dumps(config, default=str)))  # tuples as JSON lists, as saved
    critic = critic_changes(old, new)
    if critic:
        raise CheckpointError(
            f"resume: {'; '.join(critic)}; the checkpoint's critic (or its absence) was trained with the saved "
            f"settings. Resume with them, or start a new run (another --output-dir)")
    # Keys in both only: a field added since the checkpoint was written (or a run without a config) is no change;
    # the critic's only when there is one (a GRPO run's config carries critic defaults it never used).
    used = (lambda k: True) if trains_a_critic(old) else (lambda k: not k.startswith("critic."))
    changed = [k for k in sorted(set(old) & set(new)) if _state_bearing(k) and used(k) and old[k] != new[k]]
    if changed:
        what = ", ".join(f"{k}: {old[k]!r} in the checkpoint, {new[k]!r} now" for k in changed)
        raise CheckpointError(
            f"resume: {what}; the checkpoint's state (optimizer, model, batches in flight) carries the saved value, so "
            f"the change would be ignored. Resume with the saved value, or start a new run (another --output-dir)")


def _state_bearing(key: str) -> bool:
    parts = key.split(".")
    # source.max_staleness: the batches in flight were saved for that schedule (unirl.rollout.sources)
    return "lora" in parts or ("optim" in parts[:-1] and parts[-1] in OPTIMIZER_KEYS) or key == "source.max_staleness"


def _optimizer_settings(objects: dict[str, tuple[str, Any]]) -> dict[str, list[dict]]:
    """Each optimizer's settings per parameter group (the learning rate before any schedule), by name."""
    return {name: [{k: group.get("initial_lr", group["lr"]) if k == "lr" else group.get(k) for k in OPTIMIZER_KEYS}
                   for group in obj.param_groups] for name, (kind, obj) in objects.items() if kind == "optimizer"}


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_trainer_state(backend, directory: Path, objects: dict[str, tuple[str, Any]], *, step: int) -> dict[str, Any]:
    """Load what ``save_trainer_state`` wrote into the named objects (or, for a checkpoint of an earlier
    version, their numbered files: ``legacy_stems``); returns ``loop.json``, every field checked
    (``unirl.trainer.resume_checks``; ``step``: the checkpoint's, which loop.json must hold).

    Raises ``StateFileError`` naming an unreadable file, ``CheckpointError`` for a checkpoint that does
    not fit this run (another model shape, a different number of models)."""
    accelerator = backend.accelerator
    check_supported(accelerator)
    if not (directory / "loop.json").exists() or (directory / "optimizer.bin").exists():
        if any(directory.glob("*.pkl")) or (directory / "optimizer.bin").exists():
            raise CheckpointError(f"{directory}: written by an older unirl with pickled state (Accelerate's save_state), "
                                  f"which resume does not unpickle; start a new run from its weights instead")
        raise StateFileError(f"{directory / 'loop.json'}: missing")
    loop_file = directory / "loop.json"
    loop_state = read_json(loop_file)
    check_loop_state(loop_state, loop_file, step)
    stems = legacy_stems(objects) if _uses_legacy_names(directory, objects) else {name: name for name in objects}
    configured, read = _optimizer_settings(objects), {}  # read: the source's stem this process read
    for name, (kind, obj) in objects.items():
        stem = directory / stems[name]
        if kind == "model":
            backend.load_model(obj, stem)
            continue
        if name == "source":  # each process's batches sampled ahead: their own rule (docs/async.md)
            read[name] = _load_source(accelerator, obj, stem, step)
            continue
        _load_into(obj, backend.load_object(obj, stem, kind), stem)
        if kind == "optimizer":
            check_optimizer(obj, stem)
        else:  # a schedule (the loop's own); other objects pass
            check_scheduler(obj, stem)
    for name, (kind, obj) in objects.items():  # what an object took, against loop.json's counters
        if hasattr(obj, "check_resumed"):
            try:
                obj.check_resumed(loop_state)
            except StateError as e:
                stem = directory / stems[name]
                hint = resample_hint(stem) if name == "source" else ""
                raise StateFileError(f"{read.get(name, stem)}.json: {e}{hint}") from None
    for name, saved in _optimizer_settings(objects).items():
        if configured[name] != saved:  # a setting outside an ``optim`` section, which check_config cannot name
            raise CheckpointError(f"resume: {name} was saved with {saved[0]}, this run configures "
                                  f"{configured[name][0]}; the restored state would silently keep the saved settings")
    if accelerator.scaler is not None:
        _load_into(accelerator.scaler, load_state(directory / "scaler"), directory / "scaler")
    written_by = len(list(directory.glob("rng_*.json")))
    if written_by != accelerator.num_processes:  # re-sharded: no process's random stream continues
        accelerator.print(f"resume: {directory} was written by {written_by} process(es), this run has "
                          f"{accelerator.num_processes}: weights and optimizer state re-sharded, random states "
                          f"not restored (sampling differs from an uninterrupted run)")
        return loop_state
    stem = directory / f"rng_{accelerator.process_index}"
    set_rng_states(load_state(stem), stem)
    return loop_state


def _uses_legacy_names(directory: Path, objects: dict[str, tuple[str, Any]]) -> bool:
    """Whether ``directory`` was written with the numbered names of earlier versions (``model_0`` ...) and not
    this version's names; a checkpoint with neither for the policy is read with this version's (and then
    fails naming the missing file)."""
    first_model = next((name for name, (kind, _) in objects.items() if kind == "model"), None)
    if first_model is None:
        return False
    named = any(directory.glob(f"{first_model}.safetensors")) or any(directory.glob(f"{first_model}.rank*"))
    numbered = any(directory.glob("model_0.safetensors")) or any(directory.glob("model_0.rank*"))
    return numbered and not named


def _load_source(accelerator, source, stem: Path, step: int) -> Path:
    """This process's in-flight batches (``unirl.trainer.source_state``); returns the stem read. Any damage is a
    ``StateFileError`` (resume then takes the checkpoint before, exactly) that says how to keep this checkpoint
    instead: delete the source files, and the batches are sampled again with its weights, said in one line (not
    exact: the uninterrupted run's were sampled with older weights). Never resampled without a word (issue 51)."""
    own, state = read_source(accelerator, stem, step)
    if state is None:
        source.load_state_dict(None)
        return own
    try:
        _load_into(source, state, own)
    except StateFileError as e:
        raise StateFileError(f"{e}{resample_hint(stem)}") from None
    return own


def _load_into(obj, state: Any, stem: Path) -> None:
    try:
        obj.load_state_dict(state)
    except StateError as e:  # the object said what is wrong in its state
        raise StateFileError(f"{stem}.json: {e}") from None
    except (KeyError, ValueError, RuntimeError, TypeError, IndexError, OverflowError, AttributeError) as e:
        raise StateFileError(f"{stem}.json: does not fit {type(obj).__name__} ({_why(e)})") from e


# ===================================================================== logs
def drop_rows_after(path: Path, step: int) -> None:
    """Rewrite a JSONL log without the rows of steps after ``step`` (logged after the checkpoint a
    run resumes from), so that every step appears once. A torn last line (a crash or a full disk
    mid-write) is dropped with the rows after the checkpoint; a torn line elsewhere is an error naming
    it. Written to a temporary file and renamed."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines):
                print(f"resume: dropping the torn last line of {path} (line {number})")
                continue
            raise CheckpointError(f"{path}:{number}: not a JSON row ({line.strip()[:80]!r}); fix or remove the line "
                                  f"and resume again") from None
        if row.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
