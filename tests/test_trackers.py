"""Trackers that work: tensorboard and wandb (offline) get what metrics.jsonl gets, under the run dir.

Each tracker is exercised by a real tiny run (tensorboard's in this process, through ``unirl.train``, the
CLI's own path; wandb's through the CLI, as its offline service is a process of its own); a tracker that is
not installed (or not known) is a config error, before any model loads, that says what to install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import unirl
from unirl.config import ConfigError, load_config
from unirl.text.config import TextConfig

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
RUN = ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.total_steps=2", "trainer.prompts_per_step=2",
       "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "trainer.eval_every=2",
       "data.eval_size=4", "trainer.progress=false"]


def _train(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(out), *RUN, *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def _metric_keys(out: Path) -> set[str]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {k for row in rows for k in row if k != "step"}


def test_unknown_or_missing_tracker_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match=r"trainer.*log_with: unknown tracker 'mlflow'; choose from wandb, tensorboard"):
        load_config(TextConfig, {"trainer": {"log_with": ["mlflow"]}})
    import unirl.config.schema

    monkeypatch.setitem(unirl.config.schema.TRACKERS, "wandb", ("wandb_is_not_installed_here", "wandb"))
    with pytest.raises(ConfigError, match=r"trainer.*log_with: wandb is not installed; run `pip install wandb`"):
        load_config(TextConfig, {"trainer": {"log_with": ["wandb"]}})


def test_tensorboard_gets_the_metrics_and_the_eval_answers(tmp_path, tiny_lm_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    unirl.train("text", "tiny", [*RUN, "trainer.log_with=[tensorboard]"], output_dir=out, progress=False)
    event_files = list(out.rglob("events.out.tfevents.*"))
    assert event_files and all(out in f.parents for f in event_files)
    acc = EventAccumulator(str(event_files[0].parent), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    scalars = set(acc.Tags()["scalars"])
    assert scalars == _metric_keys(out)
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 2]
    text = [t for t in acc.Tags()["tensors"] if t.startswith("eval/samples")]
    assert text, acc.Tags()
    assert [e.step for e in acc.Tensors("samples/completions/text_summary")] == [1, 2]  # each step's samples


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline ``.wandb`` file. It is a LevelDB-style log (a 7-byte
    ``:W&B`` header, then 32 KiB blocks of chunks with a 7-byte header: checksum, length, type
    full/first/middle/last) of ``wandb_internal_pb2.Record`` protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.HasField("history"):
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.requires("wandb", why="the wandb tracker, in the test extra")
def test_wandb_offline_gets_the_metrics_and_the_eval_table(tmp_path, tiny_lm_dir):
    out = tmp_path / "run"
    result = _train(out, "trainer.log_with=[wandb]", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    rows = _wandb_history(files[0])
    # A table is logged as its fields (eval/samples/path, .../nrows, ...); samples/completions: each step's samples
    tables = ("eval/samples", "samples/completions")
    logged = {next((t for t in tables if k.startswith(t + "/")), k) for row in rows for k in row if not k.startswith("_")}
    assert logged == _metric_keys(out) | set(tables)
    by_step = {row["_step"]: row for row in rows}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in metrics:
        for key, value in row.items():
            if key != "step":
                assert by_step[row["step"]][key] == pytest.approx(value), (row["step"], key)
    assert len(list((out / "wandb").glob("offline-run-*/files/media/table/eval/samples_*.table.json"))) == 2


def test_tensorboard_gets_the_diffusion_eval_grid(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    unirl.train("diffusion", "tiny", ["trainer.total_steps=2", "trainer.eval_every=2", "trainer.log_with=[tensorboard]"],
                output_dir=out, progress=False)
    events = list(out.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[0].parent), size_guidance={"images": 0, "scalars": 0}).Reload()
    assert set(acc.Tags()["scalars"]) == _metric_keys(out)
    grids = acc.Images("eval/grid")
    assert [g.step for g in grids] == [0, 2] and grids[0].width > 100


def test_wandb_without_a_login_is_a_preflight_problem_saying_the_ways_out(tmp_path, monkeypatch):
    """It was a 49-line ``[rank0]:`` traceback once the model had loaded."""
    from unirl.preflight import preflight

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = load_config(TextConfig, {"trainer": {"log_with": ["wandb"]}, "output_dir": str(tmp_path / "run")})
    problems = [p for p in preflight(cfg, "text").problems if "wandb" in p]
    assert problems == [f"trainer.log_with: wandb has no login on this machine (no WANDB_API_KEY, no api.wandb.ai entry "
                        f"in {tmp_path / 'netrc'}): run `wandb login` once, or set WANDB_MODE=offline to write the run "
                        f"under the run directory (`wandb sync` uploads it later)"]
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    (tmp_path / "netrc").chmod(0o600)
    assert not [p for p in preflight(cfg, "text").problems if "wandb" in p]
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert not [p for p in preflight(cfg, "text").problems if "wandb" in p]
