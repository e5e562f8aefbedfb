"""A run naming hub repos when the hub cannot be reached (``unirl/hub.py``): one line naming each repo that is
not cached and the ways out, at once; from the cache offline when every repo is there. The hub here is an
address nothing listens on (``HF_ENDPOINT``), the cache an empty ``HF_HOME`` or one holding the tiny model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL = ["rollout.engine=hf", "rollout.max_new_tokens=4", "trainer.prompts_per_step=2", "trainer.group_size=2",
         "trainer.mini_batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0", "trainer.progress=false",
         "trainer.total_steps=1", "trainer.save_every=0"]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _offline_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))}
    return {**env, "HF_HOME": str(home), "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "OMP_NUM_THREADS": "1"}


def _train(tmp_path: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny", *SMALL, *overrides,
                           "--output-dir", str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_a_hub_model_and_data_set_not_cached_are_named_at_once_with_the_ways_out(tmp_path):
    env = _offline_env(tmp_path / "hf")
    start = time.monotonic()
    result = _train(tmp_path, env, "model.name_or_path=nobody/no-model", "data.train=nobody/no-data", "data.test=null")
    seconds = time.monotonic() - start
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = [x for x in result.stderr.splitlines() if x.startswith("unirl: ")][-1]
    assert ("unirl: data.train=nobody/no-data (a hub dataset, not in the local cache); model.name_or_path=nobody/no-model "
            "(a hub model, not in the local cache): the hub cannot be reached (http://127.0.0.1:") in line, line
    assert "Give a local path instead (data.train=/path/to/it)" in line and "HF_HUB_OFFLINE=1" in line
    assert "hf download nobody/no-data --repo-type dataset && hf download nobody/no-model" in line
    assert seconds < 60, seconds  # no retries: the whole command, imports included
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_repo_cached_goes_on_offline_and_bf16_on_a_cpu_is_said_at_start(tmp_path, tiny_lm_dir):
    """The tiny model as the hub cache holds a download (snapshots/<rev>, refs/main): one line says the run goes
    on offline, and it trains its step without waiting on the network."""
    snapshot = tmp_path / "hf" / "hub" / "models--someone--tiny" / "snapshots" / "0"
    shutil.copytree(tiny_lm_dir, snapshot)
    (tmp_path / "hf" / "hub" / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "hf" / "hub" / "models--someone--tiny" / "refs" / "main").write_text("0")
    env = {**_offline_env(tmp_path / "hf"), "CUDA_VISIBLE_DEVICES": ""}
    result = _train(tmp_path, env, "model.name_or_path=someone/tiny", f"data.train={tiny_lm_dir / 'train.jsonl'}",
                    f"data.test={tiny_lm_dir / 'test.jsonl'}", "model.dtype=bfloat16")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "someone/tiny is in the local cache, so the run goes on offline (HF_HUB_OFFLINE=1)" in out, out[-3000:]
    assert ("unirl: warning: this config expects a GPU (model.dtype=bfloat16) and torch sees none: it would run on the "
            "CPU, slowly") in out, out[-3000:]


def test_a_hub_that_answers_is_reachable_whatever_its_status(monkeypatch):
    from huggingface_hub import constants

    from unirl.hub import unreachable

    class Refuses(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(403)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        assert unreachable() is None
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
        assert "Connection refused" in unreachable()
    finally:
        server.shutdown()
        server.server_close()


def test_nothing_is_asked_when_hf_hub_offline_is_set(monkeypatch):
    from huggingface_hub import constants

    from unirl import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "unreachable", lambda: pytest.fail("the hub was asked"))
    hub.check_hub_access([hub.HubName("model.name_or_path", "a/b", "model", False)])
