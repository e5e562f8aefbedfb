"""The reward server against a hostile or careless client, and its client against a restart.

The server's ``--kwargs`` win (a request naming one is refused), bodies have a size limit and an
arrival timeout, a shared token guards every path but ``/health``, SIGTERM ends it even while a
reward call hangs, and the client keeps retrying through a server restart.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from unirl.rewards.registry import RewardError
from unirl.rewards.remote import RemoteReward, make_server

from machine import repo_env

REPO = Path(__file__).resolve().parents[1]
REWARD = '''
import pathlib, time

def scaled(samples, *, prompts=None, correct_score=1.0, **kwargs):
    return [correct_score * len(s) for s in samples]

def hang(samples, *, marker, **kwargs):
    pathlib.Path(marker).touch()
    time.sleep(3600)
'''


@pytest.fixture
def serve(tmp_path):
    """Start a server of ``scaled`` (or ``fn``) in a thread with the given settings; stop them all."""
    (tmp_path / "guarded.py").write_text(REWARD)
    servers = []

    def start(kwargs=None, fn="scaled", port=0, **settings):
        server = make_server(f"{tmp_path / 'guarded.py'}:{fn}", "127.0.0.1", port, kwargs, **settings)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/score", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_servers_kwargs_win_and_a_request_naming_one_is_refused(serve):
    url, _ = serve({"correct_score": 2.0})
    assert RemoteReward(url)(["ab"], prompts=["p"]) == [4.0]
    body = json.dumps({"samples": ["ab"], "prompts": ["p"], "columns": {"correct_score": [1000]}}).encode()
    status, answer = _post(url, body)
    assert status == 400 and "'correct_score' are settings of this server" in answer["error"]
    with pytest.raises(RewardError, match="HTTP 400: request column"):
        RemoteReward(url)(["ab"], prompts=["p"], correct_score=[1000])


def test_a_body_over_the_limit_is_refused(serve):
    url, _ = serve(max_body_mb=1 / 1024)  # 1 KiB
    small = json.dumps({"samples": ["ab"], "prompts": ["p"]}).encode()
    assert _post(url, small) == (200, {"scores": [2.0]})
    status, answer = _post(url, json.dumps({"samples": ["x" * 4096], "prompts": ["p"]}).encode())
    assert status == 413 and "over the server's limit of 1024" in answer["error"]


def test_a_slow_sender_is_cut_off(serve):
    url, server = serve(body_timeout_s=0.5)
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"samples\": [")  # and nothing more
        answer = sock.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in answer


def test_a_shared_token_guards_the_server(serve, monkeypatch):
    url, _ = serve(token="s3cret")
    body = json.dumps({"samples": ["ab"], "prompts": ["p"]}).encode()
    assert _post(url, body)[0] == 401
    assert _post(url, body, {"Authorization": "Bearer wrong"})[0] == 401
    with pytest.raises(RewardError, match="HTTP 401: missing or wrong token"):
        RemoteReward(url, retry_for=0)(["ab"], prompts=["p"])
    assert RemoteReward(url, token="s3cret")(["ab"], prompts=["p"]) == [2.0]
    monkeypatch.setenv("UNIRL_REWARD_TOKEN", "s3cret")  # the client's default
    assert RemoteReward(url)(["ab"], prompts=["p"]) == [2.0]
    with urllib.request.urlopen(url + "/health", timeout=30) as response:  # open, for load balancers
        assert response.status == 200


def test_the_client_outlasts_a_server_restart(serve):
    url, server = serve()
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    restarted = threading.Timer(2.0, lambda: serve(port=port))  # down for about 2 s
    restarted.start()
    try:
        assert RemoteReward(url, backoff=0.2, retry_for=60)(["abc"], prompts=["p"]) == [3.0]
    finally:
        restarted.join()
    with pytest.raises(RewardError, match=r"unreachable: 1 attempt\(s\)"):  # retry_for=0: one attempt
        RemoteReward("http://127.0.0.1:9", retry_for=0)(["abc"], prompts=["p"])


def test_serve_reward_exits_on_sigterm_while_a_call_hangs(tmp_path):
    (tmp_path / "guarded.py").write_text(REWARD)
    marker = tmp_path / "called"
    proc = subprocess.Popen(
        [sys.executable, "-m", "unirl.cli", "serve-reward", f"{tmp_path / 'guarded.py'}:hang", "--port", "0",
         "--grace-s", "0.5", "--kwargs", json.dumps({"marker": str(marker)})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=repo_env())
    try:
        url = proc.stdout.readline().split(" at ")[1].strip()
        body = json.dumps({"samples": ["a"]}).encode()

        def send():
            with pytest.raises(OSError):  # the server goes away without answering
                urllib.request.urlopen(url + "/score", data=body)

        client = threading.Thread(target=send, daemon=True)
        client.start()
        while not marker.exists():
            assert proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # Ended by the signal after the grace period (uvicorn re-raises it once the server stopped), not hung.
    assert proc.returncode == -signal.SIGTERM, stderr
    assert "timeout graceful shutdown exceeded" in stderr


def test_a_port_out_of_range_is_one_line(capsys):
    from unirl.cli import main

    assert main(["serve-reward", "gsm8k", "--port", "70000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["unirl serve-reward: port must be in 0..65535 (0 picks a free one), got 70000"]


# ------------------------------------------------------------------ serve-tool: the same guards (issue 37 item 7)
TOOL = '''
def scaled(query, factor=1):
    return query * factor
'''


@pytest.fixture
def serve_tool(tmp_path):
    from unirl.tools.remote import make_tool_server

    (tmp_path / "guarded_tool.py").write_text(TOOL)
    servers = []

    def start(kwargs=None, **settings):
        server = make_tool_server(f"{tmp_path / 'guarded_tool.py'}:scaled", "127.0.0.1", 0, kwargs, **settings)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _call(url: str, arguments: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    body = arguments if isinstance(arguments, bytes) else json.dumps({"arguments": arguments}).encode()
    request = urllib.request.Request(url + "/call", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_serve_tool_kwargs_win_over_a_requests_arguments(serve_tool):
    url, _ = serve_tool({"factor": 2})
    assert _call(url, {"query": "ab"}) == (200, {"text": "abab"})
    status, answer = _call(url, {"query": "ab", "factor": 1000})
    assert status == 400 and "request argument(s) 'factor' are settings of this server (serve-tool --kwargs)" in answer["error"]


def test_serve_tool_refuses_a_body_over_the_limit_and_a_slow_body(serve_tool):
    url, server = serve_tool(max_body_mb=1 / 1024, body_timeout_s=0.5)
    assert _call(url, {"query": "x" * 100})[0] == 200
    status, answer = _call(url, {"query": "x" * 4096})
    assert status == 413 and "over the server's limit of 1024" in answer["error"] and "serve-tool --max-body-mb" in answer["error"]
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        sock.sendall(b"POST /call HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"arguments\": {")  # and nothing more
        answer = sock.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in answer


def test_serve_tool_with_a_token_refuses_requests_without_it(serve_tool, monkeypatch):
    from unirl.tools.remote_client import RemoteTool

    url, _ = serve_tool(token="s3cret")
    assert _call(url, {"query": "ab"})[0] == 401
    assert _call(url, {"query": "ab"}, {"Authorization": "Bearer wrong"})[0] == 401
    with pytest.raises(RewardError, match="HTTP 401: missing or wrong token"):
        RemoteTool(url, retry_for=0)(query="ab")
    assert RemoteTool(url, token="s3cret")(query="ab") == "ab"
    monkeypatch.setenv("UNIRL_REWARD_TOKEN", "s3cret")
    assert RemoteTool(url)(query="ab") == "ab"
    with urllib.request.urlopen(url + "/health", timeout=30) as response:
        assert response.status == 200


def test_in_process_a_calls_arguments_cannot_replace_the_configs_kwargs(tmp_path):
    from unirl.tools import ToolError, load_tool
    from unirl.tools.calling import ToolCall, ToolRunner

    (tmp_path / "guarded_tool.py").write_text(TOOL)
    tool = load_tool(f"{tmp_path / 'guarded_tool.py'}:scaled", factor=2)
    assert tool(query="ab") == "abab"
    with pytest.raises(ToolError, match="argument\\(s\\) 'factor' are settings of tool 'scaled' from the config"):
        tool(query="ab", factor=1000)
    runner = ToolRunner({"scaled": tool}, timeout_s=5)
    result = runner.run([ToolCall("scaled", {"query": "ab", "factor": 1000})])[0]
    runner.close()
    assert result.error is not None and "'factor' are settings of tool 'scaled'" in result.text
