"""A default run's console: the progress bar and unirl's own lines; the libraries' output in RUN/run.log.

The README's default tiny run (vLLM engine, progress bar on; tests/conftest.py's ``tiny_demo_run``), then
``unirl eval`` of its checkpoint from another directory with its saved ``config.yaml`` and two
rewards; and ``RunOutput``'s routing, line by line.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
vllm_needed = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e .[cpu])")


def _unirl(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "unirl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=env)


@pytest.fixture(scope="module")
def default_run(tiny_demo_run):
    return tiny_demo_run  # tests/conftest.py: the README's demo command (150 steps, the bar on), once a session


@vllm_needed
@pytest.mark.slow
def test_default_run_prints_a_start_line_the_bar_and_a_summary(default_run):
    run, proc = default_run
    # stdout: unirl's start line and its summary, nothing else.
    lines = proc.stdout.splitlines()
    assert lines[0] == f"unirl: training text with config tiny, model tiny -> {run}"
    assert lines[1].startswith("unirl: done, 150 steps in ") and lines[1].endswith(" s")
    summary = lines[2:]
    assert summary and all(line.startswith("  ") for line in summary), summary
    for name, *texts in (("reward/mean", "(first and last 10 steps)"), ("eval/accuracy", "(steps 0 -> 150)"),
                         ("checkpoint", f"{run}/checkpoints/step_000150"),
                         ("curves", f"{run}/metrics.jsonl (unirl plot {run})"), ("library log", f"{run}/run.log")):
        line = [line for line in summary if line.split("  ")[1] == name]
        assert len(line) == 1 and all(text in line[0] for text in texts), (name, summary)
    # Short lines: nothing but a path makes one longer than 80 characters.
    assert all(len(line.replace(str(run), "RUN")) <= 80 for line in lines[1:]), lines
    # stderr: the progress bar only (its redraws are carriage returns).
    bar = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert bar and all(line.startswith("train:") for line in bar), bar
    # What used to reach the console is in the log: vLLM's start-up warnings, torch's C-level NUMA
    # notice, vLLM's FutureWarnings. (Accelerate's tied-weights notice, "Removed shared tensor", came from
    # its save_state, which checkpoints no longer call: issue 27's pickle-free trainer state.)
    log = (run / "run.log").read_text()
    for text in ("WARNING vllm.", "NUMA binding", "FutureWarning"):
        assert text in log, text


@vllm_needed
@pytest.mark.slow
def test_eval_from_another_directory_prints_one_line_with_the_weighted_total(default_run, tmp_path):
    run, _ = default_run
    (tmp_path / "half.py").write_text("def half(samples, **kwargs):\n    return [0.5] * len(samples)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpt = run / "checkpoints" / "step_000150"
    # The run's saved config.yaml holds absolute paths, so it works from any directory; the rewards
    # as the command line's shorthand, the second one's weight by index.
    proc = _unirl("eval", "text", "--config", str(run / "config.yaml"), "--checkpoint", str(ckpt),
                  "--output-dir", str(tmp_path / "eval"), f"rewards=[gsm8k, {tmp_path / 'half.py'}:half]",
                  "rewards[1].weight=0.5", "rewards[0].kwargs={method: strict_normalized}", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.splitlines()) == 1 and proc.stdout.startswith(f"eval {ckpt}: 100 prompts x 1, accuracy ")
    # stderr: only unirl's line saying which config scored it (issue 37 item 18), no library output.
    assert proc.stderr.strip().splitlines() == [f"config: {run / 'config.yaml'} (the run's saved config)"], \
        proc.stderr[-2000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["reward/half"] == 0.5
    assert summary["reward"] == pytest.approx(summary["reward/gsm8k"] + 0.5 * 0.5, abs=1e-6)
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert all(s["reward"] == pytest.approx(s["reward/gsm8k"] + 0.25) for s in samples)
    # With two rewards an answer is right when the first (gsm8k) gives its full score, as a run's eval/accuracy
    # counts it (one function for both: unirl/text/held_out.py); greedy answers report no pass@k.
    assert summary["accuracy"] == pytest.approx(sum(s["reward/gsm8k"] >= 1 for s in samples) / len(samples))
    assert all(s["correct"] == (s["reward/gsm8k"] >= 1) for s in samples) and "pass@1" not in summary
    assert "WARNING vllm." in (tmp_path / "eval" / "eval.log").read_text()


def test_run_output_routes_library_output_to_the_log_and_the_users_warnings_to_the_console(tmp_path, capsys,
                                                                                          monkeypatch):
    from unirl.logs import RunOutput, from_library

    # The console's own warning printer (pytest records warnings otherwise): what a user's warning reaches.
    shown: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))

    library_file = "/venv/lib/python3.11/site-packages/vllm/engine.py"
    assert from_library(library_file) and not from_library("/home/me/my_rewards.py")
    before = {name: list(logging.getLogger(name).handlers) for name in ("vllm", "transformers")}
    with RunOutput(tmp_path, verbose=False) as output:
        logging.getLogger("vllm.worker").warning("libtcmalloc is not found")
        logging.getLogger("transformers.modeling_utils").warning("tied weights")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn_explicit("deprecated inside vLLM", FutureWarning, library_file, 3)
            warnings.warn_explicit("your prompt is empty", UserWarning, "/home/me/my_rewards.py", 7)

        def noisy():
            os.write(2, b"C-level notice on descriptor 2\n")
            print("printed during set-up")
            return 42

        assert output.quiet(noisy)() == 42
    err = capsys.readouterr().err
    log = (tmp_path / "run.log").read_text()
    for text in ("libtcmalloc is not found", "tied weights", "deprecated inside vLLM", "C-level notice on descriptor 2",
                 "printed during set-up"):
        assert text in log and text not in err, text
    assert shown == ["your prompt is empty"] and "your prompt is empty" not in log
    # Left as they were: the loggers have their own handlers again.
    assert {name: list(logging.getLogger(name).handlers) for name in before} == before


def test_verbose_redirects_nothing(tmp_path):
    from unirl.logs import RunOutput

    with RunOutput(tmp_path, verbose=True) as output:
        assert output.path is None and output.quiet(len) is len
    assert not (tmp_path / "run.log").exists()


def test_the_progress_bar_shows_each_steps_own_reward():
    """Issue 37 item 20: the bar drew its count before taking the step's reward, so the reward shown
    beside "3/3" was step 2's."""
    import io

    from tqdm import tqdm

    from unirl.config.schema import TrainerConfig
    from unirl.trainer.run_log import Progress

    progress = Progress(TrainerConfig(total_steps=3, progress=True), start=0, main=True)
    progress.bar.close()
    screen = io.StringIO()
    progress.bar = tqdm(total=3, file=screen, mininterval=0, desc="train")  # every update redrawn
    for step, reward in enumerate((0.125, 0.5, 0.875), 1):
        progress.update({"reward/mean": reward})
        last = screen.getvalue().split("\r")[-1]
        assert f"{step}/3" in last and f"reward={reward:.3f}" in last, last
    progress.close()


def test_the_end_of_run_summary_is_a_few_short_lines(tmp_path):
    """Issue 37 item 20: the summary was one 400-character line. Now one figure a line, names aligned."""
    from unirl.runner import TrainResult, end_line

    metrics = [{"step": s, "reward/mean": r} for s, r in enumerate((0.0, 0.25, 0.5, 1.0), 1)]
    evals = [{"step": 0, "eval/accuracy": 0.125, "eval/reward": 0.25}, {"step": 4, "eval/accuracy": 0.75, "eval/reward": 0.5}]
    result = TrainResult(metrics=metrics, evals=evals, run_dir=tmp_path, checkpoint=tmp_path / "checkpoints/step_000004",
                         config=None)
    lines = end_line(result, 46.2, tmp_path / "run.log").splitlines()
    assert lines == [
        "unirl: done, 4 steps in 46 s",
        "  reward/mean    0.125 -> 0.750 (first and last 2 steps)",
        "  eval/accuracy  0.125 -> 0.750 (steps 0 -> 4)",
        "  eval/reward    0.250 -> 0.500 (steps 0 -> 4)",
        f"  checkpoint     {tmp_path}/checkpoints/step_000004",
        f"  curves         {tmp_path}/metrics.jsonl (unirl plot {tmp_path})",
        f"  library log    {tmp_path}/run.log",
    ]
    no_checkpoint = TrainResult(metrics=metrics[:1], evals=evals[1:], run_dir=tmp_path, checkpoint=None, config=None)
    assert end_line(no_checkpoint, 1, None).splitlines()[1:] == [
        "  reward/mean    0.000 -> 0.000 (first and last 1 step)",
        "  eval/accuracy  0.750 (step 4)",
        "  eval/reward    0.500 (step 4)",
        "  checkpoint     none",
        f"  curves         {tmp_path}/metrics.jsonl (unirl plot {tmp_path})",
    ]
