"""A checkpoint's in-flight batches (``source.max_staleness >= 1``: ``trainer_state/source.{json,safetensors}``)
damaged or edited as a disk or a user could (issue 51): each is one line at resume naming the file, what is wrong
and how to keep the checkpoint anyway, and resume falls back to the checkpoint before (exact); never a traceback,
an error some steps later, or batches sampled again without a word. Deleting both files is the way to keep the
checkpoint: its batches are then sampled again, said in one line.

A threaded source runs for real here, over a produce function that writes text rollouts as the text sampler
does (N=4 samples, P=3 prompt and R=5 response tokens); the checkpoints are the trainer's own files, resumed
by ``unirl.trainer.checkpoints.resume`` (seconds, no model). Two gloo processes under ``torchrun``
(``tests/in_flight_processes.py``, a few seconds) each save and resume their own batches; a checkpoint of another
number of processes is one line with the same way out."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from unirl.env import Rollout
from unirl.rollout.sources import ThreadedSource
from unirl.trainer import checkpoints
from unirl.trainer.checkpoints import CheckpointError
from unirl.trainer.state_files import load_state, save_state

K, TOTAL, VOCAB = 2, 8, 50


def produce(batch: int, times=None, stop=None):
    g = torch.Generator().manual_seed(batch)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0  # a sample that ended early: padding after it
    rollout = Rollout(
        tensors={"prompt_ids": torch.randint(0, VOCAB, (4, 3), generator=g), "prompt_mask": torch.ones(4, 3, dtype=torch.long),
                 "response_ids": torch.randint(0, VOCAB, (4, 5), generator=g), "response_mask": mask,
                 "finished": torch.tensor([True, True, False, True]), "score/gsm8k": torch.rand(4, generator=g)},
        group_ids=torch.tensor([0, 0, 1, 1]), prompts=["1+1=?"] * 2 + ["2+2=?"] * 2,
        samples=[f"#### {batch}"] * 4, columns={"answer": ["2", "2", "4", "4"]},
        engine_logp=-torch.rand(4, 5, generator=g) * mask)
    return rollout, torch.rand(4, generator=g), {"reward/gsm8k": 0.5}, None


def source() -> ThreadedSource:
    return ThreadedSource(K, TOTAL, produce, lambda snapshot: None, vocab_size=VOCAB)


class _Env:
    def __init__(self, model):
        self.model = model

    def save_pretrained(self, directory):
        from safetensors.torch import save_model

        save_model(self.model, str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run that trained 3 steps with k=2 (one optimizer step a step), checkpointed after steps 2 and 3;
    returns its folder, its backend and policy, and the batches each checkpoint holds."""
    from accelerate import Accelerator

    from unirl.config.schema import TrainerConfig
    from unirl.trainer.backends import build_backend

    backend, policy = build_backend(Accelerator(cpu=True), TrainerConfig()), torch.nn.Linear(2, 2)
    path, rollouts, held = tmp_path_factory.mktemp("run"), source(), {}
    rollouts.start(0, 0, snapshot=0)
    for step in range(3):
        if rollouts.needs_weights(step):
            rollouts.publish(step, step, step)
        rollouts.get(step, step)
        if step + 1 >= 2:
            objects = {"policy": ("model", policy), "source": ("state", rollouts)}
            checkpoints.save_checkpoint(backend, _Env(policy), path, step + 1, objects,
                                        {"step": step + 1, "optimizer_steps": step + 1}, keep=None)
            held[step + 1] = sorted(rollouts._ready)
    rollouts.close()
    return path, backend, policy, held


def _resume(path, backend, policy):
    fresh = source()
    state = checkpoints.resume(backend, path, {"policy": ("model", policy), "source": ("state", fresh)})
    return state, fresh


def _copy(run, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(run[0], path)
    return path, path / "checkpoints" / "step_000003" / "trainer_state" / "source"


def test_the_checkpoints_hold_the_drained_batches_and_resume_to_them(run, tmp_path):
    path, _ = _copy(run, tmp_path)
    assert run[3] == {2: [2, 3], 3: [3, 4]}  # after step s: batches s .. s+k-1
    state, fresh = _resume(path, run[1], run[2])
    assert state["step"] == 3 and sorted(fresh._ready) == [3, 4]
    assert [fresh._ready[b].version for b in (3, 4)] == [1, 2]  # max(0, b - k)


def _edit(stem, change):
    state = load_state(stem)
    change(state)
    save_state(state, stem)


def _batch(state, i=0):
    return state["batches"][i]


def _tensors(state, i=0):
    return state["batches"][i]["rollout"]["tensors"]


def _loop(state, i=0):
    return state["batches"][i]["rollout"]["loop"]


def _set(mapping, key, value):
    mapping[key] = value


def _nan_logp(state):
    _loop(state)["engine_logp"][0, 0] = float("nan")


def _id(value):
    def change(state):
        _tensors(state, 1)["response_ids"][2, 4] = value
    return change


EDITS = {
    "a missing key": (lambda s: _batch(s).pop("version"), "source.json: batch 3 lacks 'version'"),
    "a missing tensor": (lambda s: _tensors(s).pop("response_mask"), "batch 3's tensors lacks 'response_mask'"),
    "a tensor of another shape": (lambda s: _set(_loop(s), "engine_logp", torch.zeros(4, 4)),
                                  "batch 3's engine_logp has shape [4, 4], not [4, 5]"),
    "a tensor of another dtype": (lambda s: _set(_tensors(s), "response_ids", _tensors(s)["response_ids"].float()),
                                  "batch 3's response_ids must be torch.int64, got torch.float32"),
    "an extra's rows": (lambda s: _set(_tensors(s), "finished", torch.ones(3, dtype=torch.bool)),
                        "batch 3's finished has shape [3], not [4, ...]"),
    "a mask that is not 0/1": (lambda s: _set(_tensors(s), "response_mask", _tensors(s)["response_mask"] * 2),
                               "batch 3's response_mask holds values other than 0 and 1"),
    "an id past the vocabulary": (_id(VOCAB), f"batch 4's response_ids hold token id {VOCAB}, outside the policy's "
                                              f"vocabulary 0..{VOCAB - 1}"),
    "a negative id": (_id(-3), "batch 4's response_ids hold token id -3"),
    "NaN log-probs": (_nan_logp, "batch 3's engine_logp holds NaN or inf at sampled tokens"),
    "samples of another count": (lambda s: _batch(s)["rollout"]["samples"].pop(), "batch 3's samples must be a list of 4"),
    "weights newer than the checkpoint": (lambda s: _set(_batch(s, 1), "version", 3),
                                          "batch 4 claims the weights after step 3, newer than this checkpoint's step 3"),
    "weights older than the bound": (lambda s: _set(_batch(s, 1), "version", 1),
                                     "batch 4 claims the weights after step 1, older than source.max_staleness=2 "
                                     "allows (at least 2)"),
    "more optimizer steps than the checkpoint": (
        lambda s: (_set(_batch(s), "optimizer_steps", 9), _set(_loop(s), "policy_version", torch.full((4,), 9))),
        "batch 3 claims weights of 9 optimizer steps, more than this checkpoint's 3"),
    "a policy_version that is not the batch's": (lambda s: _set(_loop(s), "policy_version", torch.full((4,), 2)),
                                                 "batch 3's policy_version is not its optimizer_steps (1)"),
    "a batch missing": (lambda s: s["batches"].pop(), "holds batches [3], where the producer had finished [3, 4] "
                                                      "after step 3 with source.max_staleness=2: batch 4 is missing"),
    "a batch too many": (lambda s: s["batches"].append({**_batch(s, 1), "batch": 5}),
                         "holds batches [3, 4, 5], where the producer had finished [3, 4]"),
    "a batch twice": (lambda s: s["batches"].append(_batch(s, 1)), "batch 4 is there twice"),
    "batches not a list": (lambda s: _set(s, "batches", {"3": 1}), "'batches' must be a list of the batches sampled ahead"),
    "a batch index of another type": (lambda s: _set(_batch(s), "batch", "3"),
                                      "batches[0]'s batch must be a whole number >= 0, got str '3'"),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_an_edited_batch_is_one_line_and_resume_takes_the_checkpoint_before(run, tmp_path, capsys, name):
    path, stem = _copy(run, tmp_path)
    change, message = EDITS[name]
    _edit(stem, change)
    state, fresh = _resume(path, run[1], run[2])
    assert state["step"] == 2 and sorted(fresh._ready) == [2, 3]  # the checkpoint before, whole
    _one_skip_line(capsys.readouterr().out, f"{stem}.json: ", message)


def _one_skip_line(out: str, file: str, message: str) -> None:
    lines = [line for line in out.splitlines() if line.startswith("resume: skipping")]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert file in lines[0] and message in lines[0], lines[0]
    assert lines[0].endswith("delete its source.json and source.safetensors and the batches are sampled again "
                             "(not exact, docs/async.md)"), lines[0]


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_a_truncated_file_is_one_line(run, tmp_path, capsys, suffix):
    path, stem = _copy(run, tmp_path)
    file = stem.with_name(stem.name + suffix)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    state, _ = _resume(path, run[1], run[2])
    assert state["step"] == 2
    _one_skip_line(capsys.readouterr().out, f"{file}: cannot be read", "")


def test_one_file_deleted_is_damage_and_both_deleted_sample_the_batches_again(run, tmp_path, capsys):
    path, stem = _copy(run, tmp_path)
    stem.with_name("source.safetensors").unlink()
    assert _resume(path, run[1], run[2])[0]["step"] == 2
    _one_skip_line(capsys.readouterr().out, f"{stem}.safetensors: cannot be read", "")

    stem.with_name("source.json").unlink()
    state, fresh = _resume(path, run[1], run[2])
    out = capsys.readouterr().out
    assert state["step"] == 3 and fresh._ready == {} and "skipping" not in out
    assert f"resume: {stem}.json and .safetensors are deleted: the batches in flight at step 3 are sampled again" in out
    fresh.start(3, 3, snapshot=3)  # the producer samples them again, with the checkpoint's weights
    try:
        batch, _ = fresh.get(3, 3)
    finally:
        fresh.close()
    assert batch.version == 3


def test_with_no_checkpoint_before_resume_stops_with_the_reason(run, tmp_path):
    path, stem = _copy(run, tmp_path)
    shutil.rmtree(path / "checkpoints" / "step_000002")
    _edit(stem, _nan_logp)
    with pytest.raises(CheckpointError, match=r"can be read: .*source\.json: batch 3's engine_logp holds NaN .* delete "
                                              r"its source\.json and source\.safetensors"):
        _resume(path, run[1], run[2])


def test_a_checkpoint_of_an_earlier_version_without_total_steps_still_resumes(run, tmp_path):
    """Checkpoints written before ``total_steps`` was saved: the batches must still start at the step."""
    path, stem = _copy(run, tmp_path)
    plain = json.loads(stem.with_name("source.json").read_text())
    del plain["total_steps"]
    stem.with_name("source.json").write_text(json.dumps(plain))
    state, fresh = _resume(path, run[1], run[2])
    assert state["step"] == 3 and sorted(fresh._ready) == [3, 4]


# ------------------------------------------------------------ several processes
# Each process runs its own producer on its own share of the prompts, so each saves and resumes its own batches
# (``source.rank<r>of<W>.*``); earlier versions saved the main process's only, which every process then trained on.
@pytest.fixture(scope="module")
def two(run, tmp_path_factory):
    """``tests/in_flight_processes.py`` on 2 gloo processes (its batch b is batch b + 100 * rank here), which
    also resumes a copy of the one-process ``run``; returns its run folder and each process's record."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    work = tmp_path_factory.mktemp("two")
    shutil.copytree(run[0], work / "one")
    script = Path(__file__).with_name("in_flight_processes.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           "--work", str(work / "run"), "--out", str(work / "out"), "--other", str(work / "one")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return work / "run", [json.loads((work / f"out.rank{r}.json").read_text()) for r in (0, 1)]


def test_each_process_saves_and_resumes_its_own_batches(two):
    path, records = two
    state = path / "checkpoints" / "step_000003" / "trainer_state"
    assert sorted(f.name for f in state.glob("source*")) == [f"source.rank{r}of2.{ext}" for r in (0, 1)
                                                            for ext in ("json", "safetensors")]
    for rank, record in enumerate(records):
        assert record["step"] == 3 and sorted(record["held"]) == ["3", "4"]
        assert record["held"] == {str(b): [f"#### {b + 100 * rank}"] * 4 for b in (3, 4)}  # its own share's
        assert record["resumed"] == record["held"], rank  # not the main process's batches


def test_another_number_of_processes_is_one_line_with_the_way_out(two, run, tmp_path, capsys):
    path, records = two
    hint = "and the batches are sampled again (not exact, docs/async.md)"
    for record in records:  # the one-process run resumed on 2: every process refuses both its checkpoints
        assert "source.json: in-flight batches of 1 process(es), this run has 2; batches already sampled cannot be " \
               f"split again over another number of processes; to resume from this checkpoint anyway, delete its " \
               f"source.json and source.safetensors {hint}" in record["other"], record["other"]
    copy = tmp_path / "run"
    shutil.copytree(path, copy)
    with pytest.raises(CheckpointError, match=r"step_000003/trainer_state/source\.rank\*of2\.json: in-flight batches "
                                              r"of 2 process\(es\), this run has 1; .* delete its source\.rank\*\.json "
                                              r"and source\.rank\*\.safetensors \(every process's\) and the batches"):
        _resume(copy, run[1], run[2])
    stem = copy / "checkpoints" / "step_000003" / "trainer_state" / "source"
    for f in stem.parent.glob("source.rank*"):  # the way out: every process's files deleted
        f.unlink()
    capsys.readouterr()
    state, fresh = _resume(copy, run[1], run[2])
    assert state["step"] == 3 and fresh._ready == {}
    assert f"resume: {stem}.json and .safetensors are deleted: the batches in flight at step 3 are sampled " \
           f"again" in capsys.readouterr().out


def test_an_earlier_versions_checkpoint_of_several_processes_is_refused(two, run, tmp_path):
    """Earlier versions wrote the main process's batches as ``source.*`` whatever the number of processes."""
    path, _ = two
    copy = tmp_path / "run"
    shutil.copytree(path, copy)
    stem = copy / "checkpoints" / "step_000003" / "trainer_state" / "source"
    save_state(load_state(stem.with_name("source.rank0of2")), stem)
    for f in stem.parent.glob("source.rank*"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"step_000003/trainer_state/source\.json: holds the main process's "
                                              r"in-flight batches only \(an earlier unirl saved no other's; written by "
                                              r"2 processes\); to resume from this checkpoint anyway, delete its "
                                              r"source\.json and source\.safetensors"):
        _resume(copy, run[1], run[2])


def test_a_one_process_fsdp2_checkpoint_of_an_earlier_version_still_resumes(run, tmp_path):
    """Earlier versions wrote an FSDP2 run's source as its shards: ``source.rank0of1.*`` on one process."""
    path, stem = _copy(run, tmp_path)
    for ext in ("json", "safetensors"):
        stem.with_name(f"source.{ext}").rename(stem.with_name(f"source.rank0of1.{ext}"))
    state, fresh = _resume(path, run[1], run[2])
    assert state["step"] == 3 and sorted(fresh._ready) == [3, 4]
