"""A reward that hangs or exits does not hang or silently end the run.

``rewards[i].timeout_s`` stops a run whose reward call takes too long, naming the reward; a second
SIGTERM stops a run at once even while a diffusion worker thread waits on a hung reward (the first
asks for a clean stop after the step, which a hung step never reaches); a reward calling
``sys.exit(0)`` is an error naming it, not a silent exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unirl.rewards.registry import RewardError
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet

from machine import repo_env

REPO = Path(__file__).resolve().parents[1]


def _reward_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "bad_reward.py"
    path.write_text("import pathlib, sys, time\n\n\ndef reward(samples, **kwargs):\n" + body)
    return f"{path}:reward"


def test_a_reward_over_its_timeout_is_an_error_naming_it(tmp_path):
    spec = _reward_file(tmp_path, "    time.sleep(600)\n    return [1.0] * len(samples)\n")
    for workers in (0, 1):  # inline, and in the worker thread a diffusion run scores in
        rewards = RewardSet([RewardConfig(name=spec, timeout_s=0.2)], workers=workers)
        with pytest.raises(RewardError, match=r"reward '.*bad_reward\.py:reward': no answer after 0\.2 s"):
            rewards.submit(["a", "b"], prompts=["p", "q"], columns={}).result()
        rewards.close()


def test_a_reward_within_its_timeout_scores_as_without(tmp_path):
    spec = _reward_file(tmp_path, "    return [float(len(s)) for s in samples]\n")
    timed = RewardSet([RewardConfig(name=spec, timeout_s=30)]).components(["ab", "c"], prompts=["p", "q"], columns={})
    plain = RewardSet([RewardConfig(name=spec)]).components(["ab", "c"], prompts=["p", "q"], columns={})
    assert [v.tolist() for v in timed.values()] == [v.tolist() for v in plain.values()] == [[2.0, 1.0]]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_calling_sys_exit_is_an_error_naming_it(tmp_path, workers):
    spec = _reward_file(tmp_path, "    sys.exit(0)\n")
    rewards = RewardSet([RewardConfig(name=spec)], workers=workers)
    with pytest.raises(RewardError, match=r"bad_reward\.py:reward' called sys\.exit\(0\)"):
        rewards.submit(["a"], prompts=["p"], columns={}).result()
    rewards.close()


@pytest.mark.slow
def test_a_second_sigterm_stops_a_run_hung_in_a_reward_worker(tmp_path):
    marker = tmp_path / "called"
    spec = _reward_file(tmp_path, f"    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(3600)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unirl.cli", "train", "diffusion", "--config", "tiny", "--output-dir",
         str(tmp_path / "run"), "trainer.progress=false", "trainer.eval_every=0", "trainer.reward_workers=1",
         f"rewards.0.name={spec}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        while not marker.exists():  # the reward is called (in the worker thread) and hangs
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # asks for a stop after the step, which never ends
        time.sleep(1)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # stops at once
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert "unirl: SIGTERM received; stopping after this step" in stderr
    assert "unirl: stopped at once by a second SIGTERM" in stderr


def test_sigterm_during_start_up_is_one_line_and_the_signals_status(tmp_path):
    """Before the first step (here: a reward file whose import hangs, read by the checks before any
    model loads; likewise a slow vLLM start) SIGTERM used to kill the run without a word."""
    marker = tmp_path / "importing"
    path = tmp_path / "slow_import.py"
    path.write_text(f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(3600)\n\n\n"
                    "def reward(samples, **kwargs):\n    return [0.0] * len(samples)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(tmp_path / "run"),
         "rollout.engine=hf", f"rewards.0.name={path}:reward"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == ("unirl: stopped by SIGTERM during start-up, before any step; nothing was "
                                               "trained or saved by this run")


def test_a_hung_tool_times_out_naming_it_and_the_process_still_exits(tmp_path):
    """A synchronous tool that never returns: its call times out naming the tool, and the process
    exits at once after the run (the worker threads were a pool's, joined at exit: "done", then never
    an exit)."""
    script = tmp_path / "hung.py"
    script.write_text(
        "import threading\n"
        "from unirl.tools.calling import ToolCall, ToolRunner\n"
        "def hang(q):\n"
        "    threading.Event().wait()\n"
        "runner = ToolRunner({'lookup': hang}, timeout_s=0.3)\n"
        "result = runner.run([ToolCall('lookup', {'q': 'x'})])[0]\n"
        "print(result.error)\n"
        "print('still running:', runner.still_running())\n"
        "runner.close()\n"
        "print('done')\n")
    env = repo_env()
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit after the run ended (a hung tool's thread kept it alive)")
    assert out.returncode == 0, out.stderr
    assert "tool 'lookup' timed out after 0.3 s" in out.stdout
    assert "still running: ['lookup']" in out.stdout and out.stdout.rstrip().endswith("done")
    assert "tool calls still running at the end, not waited for: lookup" in out.stderr
    assert time.monotonic() - start < 60
