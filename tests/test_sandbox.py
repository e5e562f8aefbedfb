"""The code sandbox (unirl/agents/sandbox.py): a passing and a failing program, and each escape contained —
an infinite loop (CPU time), a sleeper (wall clock), a fork bomb (processes; nothing left running), a huge
allocation (memory), a write outside the scratch folder, a network connection, endless output (file
size), a program leaving before its tests; ``unirl sandbox run`` and the ``python_code`` environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from unirl.agents.code_env import PythonCode, program_of
from unirl.agents.sandbox import Limits, _pids_of_uid, run_program

REPO = Path(__file__).resolve().parents[1]
QUICK = Limits(wall_s=3, cpu_s=1, memory_mb=256)
ADD = "def add(a, b):\n    return a + b\n"


def test_a_program_passes_or_fails_its_tests():
    assert run_program(ADD, "assert add(2, 3) == 5\n", QUICK).status == "passed"
    failed = run_program(ADD.replace("+", "-"), "assert add(2, 3) == 5\n", QUICK)
    assert failed.status == "failed" and "AssertionError" in failed.stderr
    assert run_program("def add(a, b) return a\n", "", QUICK).status == "error"  # a syntax error
    printed = run_program("print('hello')\n", "", QUICK)
    assert printed.status == "passed" and printed.stdout == "hello\n"


def test_an_infinite_loop_is_stopped_by_its_cpu_time():
    # A wall clock far past the CPU second: on a busy machine the loop gets a fraction of a core.
    out = run_program("while True:\n    pass\n", "", Limits(wall_s=30, cpu_s=1))
    assert out.status == "cpu_time" and out.signal in ("SIGXCPU", "SIGKILL") and out.wall_s < 30


def test_a_sleeper_is_stopped_by_the_wall_clock():
    out = run_program("import time\ntime.sleep(60)\n", "", Limits(wall_s=1, cpu_s=1))
    assert out.status == "timeout" and 1 <= out.wall_s < 10


@pytest.mark.parametrize("bomb", ["import os\nwhile True:\n    os.fork()\n",
                                  # one that keeps trying, and whose children leave the process group
                                  "import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n"
                                  "            os.setsid()\n            time.sleep(60)\n    except OSError:\n"
                                  "        time.sleep(0.01)\n"])
def test_a_fork_bomb_is_contained(bomb):
    out = run_program(bomb, "", Limits(wall_s=2, cpu_s=2, processes=8))
    assert out.protections["processes"].startswith("rlimit"), out.protections
    assert out.status in ("error", "timeout"), out
    if out.status == "error":
        assert "Resource temporarily unavailable" in out.stderr  # fork() got EAGAIN at the limit
    if "user" in out.protections:  # a root run's own uid: nothing of it is left running
        uid = int(out.protections["user"].split()[-1])
        assert _pids_of_uid(uid) == []


def test_a_huge_allocation_is_refused():
    out = run_program("x = bytearray(8 * 1024 ** 3)\n", "", QUICK)
    assert out.status == "memory"


def test_nothing_is_written_outside_the_scratch_folder(tmp_path):
    outside = tmp_path / "escaped.txt"
    code = (f"open('inside.txt', 'w').write('kept')\nassert open('inside.txt').read() == 'kept'\n"
            f"open({str(outside)!r}, 'w').write('x')\n")
    out = run_program(code, "", QUICK)
    assert out.protections["filesystem"].startswith("Landlock"), out.protections
    assert out.status == "error" and "PermissionError" in out.stderr and not outside.exists()


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    out = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", "", QUICK)
    thread.join()
    server.close()
    assert out.protections["network"], out.protections
    assert out.status == "error" and not accepted, out.stderr[-300:]


def test_endless_output_stops_at_the_file_size_limit():
    out = run_program("while True:\n    print('spam' * 100)\n", "", Limits(wall_s=5, cpu_s=5, file_size_mb=1))
    assert out.status == "file_size"


@pytest.mark.parametrize("leave", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"])
def test_leaving_before_the_tests_does_not_pass(leave):
    assert run_program(leave, "assert False\n", QUICK).status == "error"


def test_the_cli_prints_the_outcome(tmp_path):
    (tmp_path / "prog.py").write_text(ADD)
    (tmp_path / "tests.py").write_text("assert add(1, 1) == 3\n")
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "sandbox", "run", str(tmp_path / "prog.py"), "--tests",
                           str(tmp_path / "tests.py"), "--wall-s", "5"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome["status"] == "failed" and "AssertionError" in outcome["stderr"]
    missing = subprocess.run([sys.executable, "-m", "unirl.cli", "sandbox", "run", str(tmp_path / "nope.py")],
                             cwd=REPO, capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert missing.returncode == 2 and "the program: no file" in missing.stderr


def test_the_python_code_environment():
    assert program_of("Here:\n```python\nx = 1\n```\nand\n```py\nx = 2\n```") == "x = 2\n"
    assert program_of("x = 3") == "x = 3"
    row = {"prompt": "Write add(a, b).", "tests": "assert add(2, 3) == 5\n"}
    episode = PythonCode(row, attempts=2, wall_s=5, cpu_s=2)
    assert episode.reset() is None
    first = episode.step("```python\ndef add(a, b):\n    return a * b\n```")
    assert (first.done, first.reward, first.info["status"]) == (False, 0.0, "failed")
    assert "AssertionError" in first.observation and "Try again" in first.observation
    second = episode.step("```python\ndef add(a, b):\n    return a + b\n```")
    assert (second.done, second.reward, second.info["status"]) == (True, 1.0, "passed")
    with pytest.raises(ValueError, match="a row needs 'tests'"):
        PythonCode({"prompt": "x"})
