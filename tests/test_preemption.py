"""A preempted run loses nothing: SIGTERM to a real CLI run, then ``trainer.resume=true``.

SIGTERM (SLURM, spot instances) lets the current step finish, writes a checkpoint, closes the
engines and exits 143 with one line naming the checkpoint. A run killed outright (SIGKILL, no
chance to save) resumes from its last periodic checkpoint, and the metrics it logged after that
checkpoint are dropped first, so every step is logged exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
ARGS = ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.prompts_per_step=2", "trainer.group_size=4",
        "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.progress=false"]


def _start(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(out), *ARGS, *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(_steps(out)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach its steps in time"
        time.sleep(0.2)


def _resume(out: Path, total: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(out), *ARGS,
           "trainer.resume=true", f"trainer.total_steps={total}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path, tiny_lm_dir):
    out = tmp_path / "run"
    proc = _start(out, "trainer.total_steps=500", "trainer.save_every=0")
    _wait_for_steps(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    last = _steps(out)[-1]
    assert 3 <= last < 500
    checkpoint = out / "checkpoints" / f"step_{last:06d}"
    lines = [line for line in stderr.splitlines() if line.startswith("unirl: stopped by SIGTERM")]
    assert lines == [f"unirl: stopped by SIGTERM after step {last}; checkpoint {checkpoint}; resume with the same "
                     f"command plus trainer.resume=true (--output-dir {out})"], stderr[-2000:]
    assert "Traceback" not in stderr
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "trainer_state" / "loop.json").exists()
    assert json.loads((checkpoint / "trainer_state" / "loop.json").read_text())["step"] == last

    resumed = _resume(out, last + 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(out) == list(range(1, last + 3))  # nothing lost, nothing logged twice


def test_a_killed_run_resumes_from_its_last_checkpoint_and_logs_each_step_once(tmp_path, tiny_lm_dir):
    out = tmp_path / "run"
    proc = _start(out, "trainer.total_steps=500", "trainer.save_every=3", "trainer.keep_checkpoints=null")
    _wait_for_steps(proc, out, 5)
    while _steps(out)[-1] % 3 != 1:  # just after a step past a checkpoint: the next one is 2 steps away
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no chance to save
    proc.communicate(timeout=60)
    logged = _steps(out)
    saved = max(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    assert logged[-1] > saved >= 3

    resumed = _resume(out, saved + 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(out) == list(range(1, saved + 3))


def test_sigterm_to_the_launcher_of_two_processes_is_one_line_and_143(tmp_path, tiny_lm_dir):
    """``python -m unirl.launch`` (torchrun's arguments): SIGTERM to the launcher reaches both processes, which
    stop after the same step with a checkpoint; rank 0 alone prints the stop lines, and the launcher exits 143
    with one line (torchrun exits 1 with its SignalException's traceback)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "unirl.launch", "--standalone", "--nproc_per_node", "2", "-m", "unirl.cli", "train",
           "text", "--config", "tiny", "--output-dir", str(out), *ARGS, "trainer.total_steps=500", "trainer.save_every=0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    _wait_for_steps(proc, out, 2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    said = stdout + stderr
    assert proc.returncode == 143 and "Traceback" not in said, said[-3000:]
    last = _steps(out)[-1]
    checkpoint = out / "checkpoints" / f"step_{last:06d}"
    assert (checkpoint / "trainer_state" / "loop.json").exists()
    assert said.count("unirl: SIGTERM received; stopping after this step") == 1, said[-3000:]
    assert said.count(f"unirl: stopped by SIGTERM after step {last}; checkpoint {checkpoint}") == 1, said[-3000:]
    assert stderr.splitlines()[-1] == ("unirl: the launcher got SIGTERM and passed it on; its processes stopped after "
                                       "their step (rank 0's line above names the checkpoint)")
    assert "death signal" not in said  # torchrun's own notices, one per process, stay at ERROR
