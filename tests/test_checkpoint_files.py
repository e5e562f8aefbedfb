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
import re

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


class _Run:
    """What the checkpoint functions take: the backend (``trainer.strategy: ddp`` on one CPU process) and the
    named objects a trainer saves (``Trainer._state_objects``' names and order)."""

    def __init__(self, backend, objects):
        self.backend, self.objects = backend, objects


def _setup(lr: float = 1e-2, width: int = 4):
    from accelerate import Accelerator

    from unirl.config.schema import OptimConfig, TrainerConfig
    from unirl.trainer.backends import build_backend
    from unirl.trainer.optim import build_optimizer, build_scheduler

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    policy, critic = torch.nn.Linear(3, width), torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    cfg = OptimConfig(lr=lr, warmup_steps=3)
    opts = [build_optimizer(m, cfg) for m in (policy, critic)]
    scheds = [build_scheduler(o, cfg) for o in opts]
    prepared = acc.prepare(policy, opts[0], scheds[0], critic, opts[1], scheds[1])
    ema = _Shadow(policy)
    objects = {"policy": ("model", prepared[0]), "policy_optimizer": ("optimizer", prepared[1]),
               "critic": ("model", prepared[3]), "critic_optimizer": ("optimizer", prepared[4]),
               "ema": ("state", ema), "policy_scheduler": ("scheduler", prepared[2]),
               "critic_scheduler": ("scheduler", prepared[5])}
    return _Run(build_backend(acc, TrainerConfig()), objects), prepared, ema


def _save(run: _Run, env, path, step, loop_state, **kwargs):
    return checkpoints.save_checkpoint(run.backend, env, path, step, run.objects, loop_state, **kwargs)


def _resume(run: _Run, path, config=None):
    return checkpoints.resume(run.backend, path, run.objects, config)


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
    _save(acc, _Env(prepared[0]), tmp_path, 3, {"step": 3, "optimizer_steps": 3}, keep=2)
    saved, after_save = _snapshot(prepared, ema), _draws()
    _train(prepared, ema, 2)  # move everything away, then come back
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    state = _resume(acc, tmp_path)
    assert state == {"step": 3, "optimizer_steps": 3}
    _same(_snapshot(prepared, ema), saved)
    again = _draws()
    assert again[:2] == after_save[:2] and torch.equal(again[2], after_save[2])
    files = {p.name for p in (tmp_path / "checkpoints" / "step_000003" / "trainer_state").iterdir()}
    assert {"policy.safetensors", "critic.safetensors", "critic_optimizer.json", "critic_scheduler.safetensors",
            "ema.json", "rng_0.json", "loop.json"} <= files
    assert not [name for name in files if name.endswith((".pkl", ".bin", ".pt"))]


def test_resume_never_unpickles_a_planted_file(tmp_path, monkeypatch):
    """Every name Accelerate (or torch) would read a pickle from gets one that writes a file when
    unpickled; resume succeeds, the file is never written, and no unpickler runs at all."""
    acc, prepared, ema = _setup()
    _train(prepared, ema, 1)
    ckpt = _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
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
    assert _resume(acc, tmp_path)["step"] == 1
    assert not marker.exists()


def test_an_old_pickled_checkpoint_is_refused_naming_it(tmp_path):
    acc, prepared, ema = _setup()
    ckpt = _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    (ckpt / "trainer_state" / "optimizer.bin").write_bytes(b"\x80\x04N.")
    with pytest.raises(CheckpointError, match="older unirl with pickled state"):
        _resume(acc, tmp_path)


@pytest.mark.parametrize("damage", ["truncate_model", "truncate_optimizer", "rng_json", "rng_tensor", "loop_json"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(tmp_path, damage, capsys):
    acc, prepared, ema = _setup()
    env = _Env(prepared[0])
    _train(prepared, ema, 1)
    _save(acc, env, tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=None)
    first = _snapshot(prepared, ema)
    _train(prepared, ema, 1)
    ckpt = _save(acc, env, tmp_path, 2, {"step": 2, "optimizer_steps": 2}, keep=None)
    state = ckpt / "trainer_state"
    file = {"truncate_model": state / "critic.safetensors", "truncate_optimizer": state / "policy_optimizer.safetensors",
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
    assert _resume(acc, tmp_path)["step"] == 1
    _same(_snapshot(prepared, ema), first)
    out = capsys.readouterr().out
    assert f"skipping {ckpt}" in out and file.stem in out


def test_no_readable_checkpoint_is_one_error_naming_each_file(tmp_path):
    acc, prepared, ema = _setup()
    ckpt = _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    (ckpt / "trainer_state" / "policy_optimizer.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointError, match=r"no checkpoint .* can be read: .*policy_optimizer\.safetensors"):
        _resume(acc, tmp_path)


def test_a_changed_learning_rate_is_refused_naming_the_key(tmp_path):
    acc, prepared, ema = _setup(lr=1e-2)
    config = {"model": {"lora": {"enabled": True}}, "optim": {"lr": 1e-2, "max_grad_norm": 1.0},
              "trainer": {"total_steps": 2}}
    _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2,
                                config=config)
    # total_steps and max_grad_norm are the run's to change; the learning rate is the optimizer's.
    ok = {**config, "optim": {"lr": 1e-2, "max_grad_norm": 0.5}, "trainer": {"total_steps": 4}}
    assert _resume(acc, tmp_path, ok)["step"] == 1
    with pytest.raises(CheckpointError, match=r"optim\.lr: 0\.01 in the checkpoint, 0\.02 now"):
        _resume(acc, tmp_path, {"optim": {"lr": 2e-2}, "trainer": {"total_steps": 4}})
    with pytest.raises(CheckpointError, match=r"model\.lora\.enabled: True in the checkpoint, False now"):
        _resume(acc, tmp_path, {**config, "model": {"lora": {"enabled": False}}})


def test_optimizer_settings_from_elsewhere_are_caught_after_loading(tmp_path):
    """A second optimizer configured outside an ``optim`` section: the restored param groups differ
    from the configured ones, and the resume is refused rather than silently keeping the old lr."""
    acc, prepared, ema = _setup(lr=1e-2)
    _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    acc2, prepared2, ema2 = _setup(lr=3e-2)
    with pytest.raises(CheckpointError, match=r"policy_optimizer was saved with \{'lr': 0\.01"):
        _resume(acc2, tmp_path)


def test_a_model_of_another_shape_is_one_clear_error(tmp_path):
    acc, prepared, ema = _setup(width=4)
    _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    acc2, prepared2, ema2 = _setup(width=6)
    with pytest.raises(CheckpointError, match=r"policy\.safetensors does not fit this run's policy"):
        _resume(acc2, tmp_path)


def _safetensors_full_disk():
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("error", [lambda: OSError(errno.ENOSPC, "No space left on device"), _safetensors_full_disk])
def test_a_full_disk_says_so_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch, error):
    import safetensors.torch

    acc, prepared, ema = _setup()
    _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2)
    real = safetensors.torch.save_file

    def full_disk(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        with open(filename, "r+b") as f:  # what a full disk leaves: part of the file
            f.truncate(8)
        raise error()  # as torch / the OS, or as safetensors reports it

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(CheckpointError) as info:
        _save(acc, _Env(prepared[0]), tmp_path, 2, {"step": 2, "optimizer_steps": 2}, keep=2)
    message = str(info.value)
    assert "no space left on device" in message and ".tmp_step_000002" in message
    assert "the last checkpoint is" in message and "step_000001" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


def test_resume_without_a_checkpoint_drops_the_old_rows(tmp_path):
    acc, prepared, ema = _setup()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n')
    assert _resume(acc, tmp_path) is None
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_torn_last_metrics_row_is_dropped_and_a_torn_middle_row_named(tmp_path):
    acc, prepared, ema = _setup()
    _save(acc, _Env(prepared[0]), tmp_path, 2, {"step": 2, "optimizer_steps": 2}, keep=2)
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "rew')
    assert _resume(acc, tmp_path)["step"] == 2
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    log.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(CheckpointError, match=rf"{log}:2: not a JSON row"):
        _resume(acc, tmp_path)


# ---------------------------------------------------------------- links out of the run (issue 37 item 2)
def test_a_checkpoint_linked_out_of_the_run_is_not_resumed_and_pruning_spares_what_it_did_not_write(tmp_path, capsys):
    acc, prepared, ema = _setup()
    env = _Env(prepared[0])
    run, other = tmp_path / "run", tmp_path / "other"
    _train(prepared, ema, 1)
    _save(acc, env, other, 5, {"step": 5, "optimizer_steps": 5}, keep=None)  # another run's
    _train(prepared, ema, 1)
    _save(acc, env, run, 1, {"step": 1, "optimizer_steps": 1}, keep=None)
    ours = _snapshot(prepared, ema)
    link = run / "checkpoints" / "step_000005"
    link.symlink_to(other / "checkpoints" / "step_000005", target_is_directory=True)
    backup = run / "checkpoints" / "step_000001_backup"  # a copy a person made, under a name save never gives
    backup.mkdir()
    (backup / "notes.txt").write_text("keep me")
    _train(prepared, ema, 1)
    assert _resume(acc, run)["step"] == 1  # not the other run's step 5 through the link
    _same(_snapshot(prepared, ema), ours)
    out = capsys.readouterr().out
    assert f"skipping {link}: {link} is a link to {(other / 'checkpoints' / 'step_000005').resolve()}, outside" in out
    for step in (2, 3, 4):  # keep 2: prunes step 1 and 2 of this run, nothing else
        _save(acc, env, run, step, {"step": step, "optimizer_steps": step}, keep=2)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_000001_backup", "step_000003", "step_000004", "step_000005"]
    assert link.is_symlink() and (other / "checkpoints" / "step_000005" / "trainer_state" / "loop.json").exists()
    assert (backup / "notes.txt").read_text() == "keep me"


def test_a_checkpoints_folder_linked_out_of_the_run_is_refused_and_left_alone(tmp_path):
    acc, prepared, ema = _setup()
    env = _Env(prepared[0])
    other = tmp_path / "other"
    for step in (1, 2):
        _save(acc, env, other, step, {"step": step, "optimizer_steps": step}, keep=None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(other / "checkpoints", target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"checkpoints: .*run/checkpoints is a link to .*other/checkpoints, outside"):
        _resume(acc, run)
    with pytest.raises(CheckpointError, match="outside the run directory"):
        _save(acc, env, run, 3, {"step": 3, "optimizer_steps": 3}, keep=1)
    assert sorted(p.name for p in (other / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


# ------------------------------------------------------------ tampered metadata (issue 37 item 3)
def _edit_json(file, change):
    plain = json.loads(file.read_text())
    file.write_text(json.dumps(change(plain)))


def _swap_moments(plain):
    items = plain["state"]["__items__"]  # [[param index, {"step", "exp_avg", "exp_avg_sq"}], ...]
    items[0][1]["exp_avg"], items[1][1]["exp_avg"] = items[1][1]["exp_avg"], items[0][1]["exp_avg"]
    return plain


TAMPERED = {  # name: (file, its change, what the skip line must say)
    "step_string": ("loop.json", lambda p: {**p, "step": "2"}, "loop.json: step must be a whole number, got '2'"),
    "step_float": ("loop.json", lambda p: {**p, "step": 3.7}, "loop.json: step must be a whole number, got 3.7"),
    "step_negative": ("loop.json", lambda p: {**p, "step": -5}, "loop.json: step must be between 0 and 2**53, got -5"),
    "step_huge": ("loop.json", lambda p: {**p, "step": 10**30}, "loop.json: step must be between 0 and 2**53"),
    "step_other": ("loop.json", lambda p: {**p, "step": 7}, "loop.json: step is 7, but the checkpoint is step_000002"),
    "optimizer_steps": ("loop.json", lambda p: {**p, "optimizer_steps": 10**30}, "loop.json: optimizer_steps must be"),
    "kl_ctrl": ("loop.json", lambda p: {**p, "kl_ctrl": {"value": "0.1"}}, "loop.json: kl_ctrl.value must be a finite"),
    "swapped_tensors": ("critic_optimizer.json", _swap_moments,
                        "critic_optimizer.json: parameter 0's 'exp_avg' has shape (5,), the parameter (5, 3)"),
    "scheduler": ("policy_scheduler.json", lambda p: {**p, "last_epoch": "1"}, "policy_scheduler.json: last_epoch must be a count"),
}


@pytest.mark.parametrize("case", [*TAMPERED, "rng_1e999", "deep_json", "config_deep"])
def test_tampered_metadata_is_named_and_the_checkpoint_before_is_resumed(tmp_path, case, capsys):
    acc, prepared, ema = _setup()
    env = _Env(prepared[0])
    _train(prepared, ema, 1)
    _save(acc, env, tmp_path, 1, {"step": 1, "optimizer_steps": 1, "kl_ctrl": {"value": 0.1}},
                                keep=None, config={"optim": {"lr": 1e-2}})
    first = _snapshot(prepared, ema)
    _train(prepared, ema, 1)
    ckpt = _save(acc, env, tmp_path, 2, {"step": 2, "optimizer_steps": 2, "kl_ctrl": {"value": 0.1}},
                                       keep=None, config={"optim": {"lr": 1e-2}})
    state = ckpt / "trainer_state"
    if case in TAMPERED:
        name, change, said = TAMPERED[case]
        _edit_json(state / name, change)
    elif case == "rng_1e999":  # the python RNG state's first word, as a number no float can hold
        text = (state / "rng_0.json").read_text()
        (state / "rng_0.json").write_text(re.sub(r'("python": \{"__tuple__": \[3, \{"__tuple__": \[)\d+', r"\g<1>1e999", text))
        assert "1e999" in (state / "rng_0.json").read_text()
        said = "rng_0.json: cannot be read (the number 1e999 is too large for a float)"
    elif case == "deep_json":
        (state / "rng_0.json").write_text("[" * 200_000 + "]" * 200_000)
        said = "rng_0.json: cannot be read (nested too deeply"
    else:
        (state / "config.json").write_text('{"a": ' * 200_000 + "1" + "}" * 200_000)
        said = "config.json: cannot be read (nested too deeply"
    _train(prepared, ema, 1)
    assert _resume(acc, tmp_path, {"optim": {"lr": 1e-2}})["step"] == 1
    _same(_snapshot(prepared, ema), first)
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume: skipping")]
    assert len(skipped) == 1 and skipped[0].startswith(f"resume: skipping {ckpt}: {state}/") and said in skipped[0], skipped


# ------------------------------------------------------------- resume semantics (issue 37 item 11)
def _algo_config(estimator: str, **critic) -> dict:
    return {"algo": {"adv_estimator": estimator}, "optim": {"lr": 1e-2}, "trainer": {"ppo_epochs": 1, "total_steps": 4},
            "critic": {"name_or_path": None, "cliprange_value": 0.5, "ppo_epochs": None, "optim": {"lr": 1e-5},
                       **critic}}


@pytest.mark.parametrize("now, said", [
    (_algo_config("grpo"), "algo.adv_estimator: 'gae' in the checkpoint (it trains a critic), 'grpo' now (no critic)"),
    (_algo_config("gae", cliprange_value=0.2), "critic.cliprange_value: 0.5 in the checkpoint, 0.2 now"),
    (_algo_config("gae", ppo_epochs=2), "critic.ppo_epochs: 1 in the checkpoint, 2 now"),
    (_algo_config("gae", name_or_path="other-critic"), "critic.name_or_path: None in the checkpoint, 'other-critic' now"),
])
def test_a_ppo_checkpoint_refuses_another_critic_setting_naming_old_and_new(tmp_path, now, said):
    acc, prepared, ema = _setup()
    _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2,
                                config=_algo_config("gae"))
    with pytest.raises(CheckpointError) as info:
        _resume(acc, tmp_path, now)
    assert str(info.value).startswith(f"resume: {said}; ") and "\n" not in str(info.value)
    # The same number of critic passes spelled out (null: the trainer's ppo_epochs) and the run's length are no change.
    assert _resume(acc, tmp_path, {**_algo_config("gae", ppo_epochs=1), "trainer": {"ppo_epochs": 1,
                                                                                              "total_steps": 8}})["step"] == 1


def test_a_grpo_checkpoint_resumed_as_ppo_names_the_estimator_not_a_critic_setting_it_never_had(tmp_path):
    acc, prepared, ema = _setup()
    _save(acc, _Env(prepared[0]), tmp_path, 1, {"step": 1, "optimizer_steps": 1}, keep=2,
                                config=_algo_config("grpo"))
    ppo = _algo_config("gae", optim={"lr": 1e-3})  # a PPO config's own critic learning rate
    with pytest.raises(CheckpointError, match=r"^resume: algo\.adv_estimator: 'grpo' in the checkpoint \(no critic\), "
                                              r"'gae' now \(it trains a critic\); ") as info:
        _resume(acc, tmp_path, ppo)
    assert "critic.optim.lr" not in str(info.value)
    # Without a critic on either side its unused settings may change.
    assert _resume(acc, tmp_path, _algo_config("grpo", cliprange_value=0.3, optim={"lr": 1e-3}))["step"] == 1


def test_a_checkpoint_with_the_numbered_names_of_earlier_versions_still_resumes(tmp_path):
    """Before the named objects, a checkpoint's files were numbered by Accelerate's preparation and
    registration order (model_0 the policy, model_1 the critic, optimizer_<i> theirs, custom_<i> the
    environment's objects then the schedules); such a checkpoint resumes bit for bit, each file read into
    the object it was written from."""
    run, prepared, ema = _setup()
    _train(prepared, ema, 2)
    ckpt = _save(run, _Env(prepared[0]), tmp_path, 2, {"step": 2, "optimizer_steps": 2}, keep=2)
    saved = _snapshot(prepared, ema)
    stems = checkpoints.legacy_stems(run.objects)
    assert stems == {"policy": "model_0", "policy_optimizer": "optimizer_0", "critic": "model_1",
                     "critic_optimizer": "optimizer_1", "ema": "custom_0", "policy_scheduler": "custom_1",
                     "critic_scheduler": "custom_2"}
    state = ckpt / "trainer_state"
    for name, old in stems.items():
        for file in state.glob(f"{name}.*"):
            file.rename(state / (old + file.suffix))
    assert not any(state.glob("policy*"))
    _train(prepared, ema, 2)  # move everything away
    assert _resume(run, tmp_path)["step"] == 2
    _same(_snapshot(prepared, ema), saved)
