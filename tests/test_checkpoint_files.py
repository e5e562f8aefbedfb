"""The trainer state on disk: tensors and JSON only, read back without unpickling, bit for bit.

A real ``Accelerator`` on the CPU prepares two small models (a policy and a critic, each with its
optimizer and schedule) and an EMA-like registered object; the checkpoint round trip, the planted
pickles, the fallback past a damaged checkpoint, the refused settings and a full disk are checked
on them directly (seconds, no model download).
"""

from __future__ import annotations

import errno
import json
import pickle
import random

import numpy as np
import pytest
import torch

from unirl.trainer import checkpoints
from unirl.trainer.checkpoints import CheckpointError
from unirl.trainer.state_files import load_state, save_state


class _Shadow:
    """An EMA's shape: a list of tensors behind state_dict / load_state_dict."""

    def __init__(self, module):
        self.shadow = [p.detach().clone() for p in module.parameters()]

    def state_dict(self):
        return {"shadow": list(self.shadow)}

    def load_state_dict(self, state):
        for s, v in zip(self.shadow, state["shadow"], strict=True):
            s.copy_(v)


class _Env:
    """What save_checkpoint asks of an environment: the policy in its library's format."""

    def __init__(self, model):
        self.model = model

    def save_pretrained(self, directory):
        from safetensors.torch import save_model

        save_model(self.model, str(directory / "model.safetensors"))


def _setup(lr: float = 1e-2, width: int = 4):
    from accelerate import Accelerator

    from unirl.trainer.optim import build_optimizer, build_scheduler
    from unirl.schema import OptimConfig

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    policy, critic = torch.nn.Linear(3, width), torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    cfg = OptimConfig(lr=lr, warmup_steps=3)
    opts = [build_optimizer(m, cfg) for m in (policy, critic)]
    scheds = [build_scheduler(o, cfg) for o in opts]
    prepared = acc.prepare(policy, opts[0], scheds[0], critic, opts[1], scheds[1])
    ema = _Shadow(policy)
    acc.register_for_checkpointing(ema)
    return acc, prepared, ema


def _train(prepared, ema, steps: int):
    policy, opt, sched, critic, copt, csched = prepared
    for _ in range(steps):
        x = torch.randn(8, 3)
        (policy(x).pow(2).mean() + critic(x).pow(2).mean()).backward()
        for o, s in ((opt, sched), (copt, csched)):
            o.step()
            s.step()
            o.zero_grad()
        for s, p in zip(ema.shadow, policy.parameters()):
            s.mul_(0.5).add_(p.detach(), alpha=0.5)


def _snapshot(prepared, ema):
    policy, opt, sched, critic, copt, csched = prepared
    return {"params": [p.detach().clone() for m in (policy, critic) for p in m.parameters()],
            "opt": [repr(o.state_dict()) for o in (opt, copt)], "sched": [s.state_dict() for s in (sched, csched)],
            "ema": [s.clone() for s in ema.shadow]}


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert a["opt"] == b["opt"] and a["sched"] == b["sched"]
    assert all(torch.equal(x, y) for x, y in zip(a["ema"], b["ema"], strict=True))


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_state_files_round_trip_types_exactly(tmp_path):
    state = {"a": (1, 2.5, None, "x", [True, {"k": torch.arange(3)}]), 3: torch.tensor(1.5, dtype=torch.bfloat16),
             "np": np.arange(4, dtype=np.uint32), "nan": float("nan"), "__tensor__": "not a tag"}
    save_state(state, tmp_path / "s")
    back = load_state(tmp_path / "s")
    assert back["a"][:4] == (1, 2.5, None, "x") and isinstance(back["a"], tuple)
    assert torch.equal(back["a"][4][1]["k"], torch.arange(3)) and back[3].dtype == torch.bfloat16
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3]
    assert back["nan"] != back["nan"] and back["__tensor__"] == "not a tag"
    with pytest.raises(TypeError, match=r"state\.f: a function cannot be saved"):
        save_state({"f": lambda: 0}, tmp_path / "t")


def test_resume_restores_every_model_optimizer_schedule_ema_and_rng_bit_for_bit(tmp_path):
    acc, prepared, ema = _setup()
    _train(prepared, ema, 3)
    checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 3, {"step": 3, "optimizer_steps": 3}, keep=2)
    saved, after_save = _snapshot(prepared, ema), _draws()
    _train(prepared, ema, 2)  # move everything away, then come back
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    state = checkpoints.resume(acc, tmp_path)
    assert state == {"step": 3, "optimizer_steps": 3}
    _same(_snapshot(prepared, ema), saved)
    again = _draws()
    assert again[:2] == after_save[:2] and torch.equal(again[2], after_save[2])
    files = {p.name for p in (tmp_path / "checkpoints" / "step_000003" / "trainer_state").iterdir()}
    assert {"model_0.safetensors", "model_1.safetensors", "optimizer_1.json", "scheduler_1.safetensors",
            "custom_0.json", "rng_0.json", "loop.json"} <= files
    assert not [name for name in files if name.endswith((".pkl", ".bin", ".pt"))]


def test_resume_never_unpickles_a_planted_file(tmp_path, monkeypatch):
    """Every name Accelerate (or torch) would read a pickle from gets one that writes a file when
    unpickled; resume succeeds, the file is never written, and no unpickler runs at all."""
    acc, prepared, ema = _setup()
    _train(prepared, ema, 1)
    ckpt = checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Payload())
    state_dir = ckpt / "trainer_state"
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "optimizer_1.bin",
                 "scheduler.bin", "scheduler_1.bin", "scaler.pt", "pytorch_model.bin", "sampler.bin"):
        (state_dir / name).write_bytes(payload)
    (ckpt / "pytorch_model.bin").write_bytes(payload)
    pickle.loads(payload)  # the payload works: it writes the marker ...
    assert marker.exists()
    marker.unlink()  # ... which is removed again before resuming

    def refuse(*args, **kwargs):
        raise AssertionError("resume unpickled something")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    for name in ("optimizer.bin", "optimizer_1.bin", "scheduler.bin", "scheduler_1.bin", "sampler.bin"):
        (state_dir / name).unlink()  # the old format's marker files are refused outright (next test)
    assert checkpoints.resume(acc, tmp_path)["step"] == 1
    assert not marker.exists()


def test_an_old_pickled_checkpoint_is_refused_naming_it(tmp_path):
    acc, prepared, ema = _setup()
    ckpt = checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    (ckpt / "trainer_state" / "optimizer.bin").write_bytes(b"\x80\x04N.")
    with pytest.raises(CheckpointError, match="older unirl with pickled state"):
        checkpoints.resume(acc, tmp_path)


@pytest.mark.parametrize("damage", ["truncate_model", "truncate_optimizer", "rng_json", "rng_tensor", "loop_json"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(tmp_path, damage, capsys):
    acc, prepared, ema = _setup()
    env = _Env(prepared[0])
    _train(prepared, ema, 1)
    checkpoints.save_checkpoint(acc, env, tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=None)
    first = _snapshot(prepared, ema)
    _train(prepared, ema, 1)
    ckpt = checkpoints.save_checkpoint(acc, env, tmp_path, 2, {"step": 2, "optimizer_steps": 2}, keep=None)
    state = ckpt / "trainer_state"
    file = {"truncate_model": state / "model_1.safetensors", "truncate_optimizer": state / "optimizer_0.safetensors",
            "rng_json": state / "rng_0.json", "rng_tensor": state / "rng_0.safetensors",
            "loop_json": state / "loop.json"}[damage]
    if damage == "rng_json":  # valid JSON, wrong content: a python RNG state of the wrong length
        plain = json.loads(file.read_text())
        plain["python"]["__tuple__"][1]["__tuple__"] = plain["python"]["__tuple__"][1]["__tuple__"][:10]
        file.write_text(json.dumps(plain))
    elif damage == "rng_tensor":  # the torch generator state replaced by one of the wrong size
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(file))
        save_file({k: v[:7] if v.dtype == torch.uint8 else v for k, v in tensors.items()}, str(file))
    else:
        file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])
    _train(prepared, ema, 1)
    assert checkpoints.resume(acc, tmp_path)["step"] == 1
    _same(_snapshot(prepared, ema), first)
    out = capsys.readouterr().out
    assert f"skipping {ckpt}" in out and file.stem in out


def test_no_readable_checkpoint_is_one_error_naming_each_file(tmp_path):
    acc, prepared, ema = _setup()
    ckpt = checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    (ckpt / "trainer_state" / "optimizer_0.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointError, match=r"no checkpoint .* can be read: .*optimizer_0\.safetensors"):
        checkpoints.resume(acc, tmp_path)


def test_a_changed_learning_rate_is_refused_naming_the_key(tmp_path):
    acc, prepared, ema = _setup(lr=1e-2)
    config = {"model": {"lora": {"enabled": True}}, "optim": {"lr": 1e-2, "max_grad_norm": 1.0},
              "trainer": {"total_steps": 2}}
    checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2,
                                config=config)
    # total_steps and max_grad_norm are the run's to change; the learning rate is the optimizer's.
    ok = {**config, "optim": {"lr": 1e-2, "max_grad_norm": 0.5}, "trainer": {"total_steps": 4}}
    assert checkpoints.resume(acc, tmp_path, ok)["step"] == 1
    with pytest.raises(CheckpointError, match=r"optim\.lr: 0\.01 in the checkpoint, 0\.02 now"):
        checkpoints.resume(acc, tmp_path, {"optim": {"lr": 2e-2}, "trainer": {"total_steps": 4}})
    with pytest.raises(CheckpointError, match=r"model\.lora\.enabled: True in the checkpoint, False now"):
        checkpoints.resume(acc, tmp_path, {**config, "model": {"lora": {"enabled": False}}})


def test_optimizer_settings_from_elsewhere_are_caught_after_loading(tmp_path):
    """A second optimizer configured outside an ``optim`` section: the restored param groups differ
    from the configured ones, and the resume is refused rather than silently keeping the old lr."""
    acc, prepared, ema = _setup(lr=1e-2)
    checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    acc2, prepared2, ema2 = _setup(lr=3e-2)
    with pytest.raises(CheckpointError, match=r"optimizer 0 was saved with \{'lr': 0\.01"):
        checkpoints.resume(acc2, tmp_path)


def test_a_model_of_another_shape_is_one_clear_error(tmp_path):
    acc, prepared, ema = _setup(width=4)
    checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    acc2, prepared2, ema2 = _setup(width=6)
    with pytest.raises(CheckpointError, match=r"model_0\.safetensors does not fit this run's model 0"):
        checkpoints.resume(acc2, tmp_path)


def _safetensors_full_disk():
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("error", [lambda: OSError(errno.ENOSPC, "No space left on device"), _safetensors_full_disk])
def test_a_full_disk_says_so_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch, error):
    import safetensors.torch

    acc, prepared, ema = _setup()
    checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    real = safetensors.torch.save_file

    def full_disk(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        with open(filename, "r+b") as f:  # what a full disk leaves: part of the file
            f.truncate(8)
        raise error()  # as torch / the OS, or as safetensors reports it

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(CheckpointError) as info:
        checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 2, {"step": 2, "optimizer_steps": 2}, keep=2)
    message = str(info.value)
    assert "no space left on device" in message and ".tmp_step_000002" in message
    assert "the last checkpoint is" in message and "step_000001" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


def test_resume_without_a_checkpoint_drops_the_old_rows(tmp_path):
    acc, prepared, ema = _setup()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n')
    assert checkpoints.resume(acc, tmp_path) is None
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_torn_last_metrics_row_is_dropped_and_a_torn_middle_row_named(tmp_path):
    acc, prepared, ema = _setup()
    checkpoints.save_checkpoint(acc, _Env(prepared[0]), tmp_path, 2, {"step": 2, "optimizer_steps": 2}, keep=2)
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "rew')
    assert checkpoints.resume(acc, tmp_path)["step"] == 2
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    log.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(CheckpointError, match=rf"{log}:2: not a JSON row"):
        checkpoints.resume(acc, tmp_path)
