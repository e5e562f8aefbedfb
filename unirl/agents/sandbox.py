"""A Python program run against tests in a process of its own, within limits (``unirl sandbox run``, the
``python_code`` environment). docs/agents.md says what it protects and what it does not.

``run_program(code, tests)`` writes the program and the tests into a fresh scratch folder, starts
``sandbox_harness.py`` there with ``python -I -S`` (no site-packages, no environment variables but a
minimal few) in a session of its own, and waits at most ``wall_s`` seconds. The harness sets, before any
of the program's code runs (the ``protections`` of the outcome say which took effect here):

- CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), the size of any file it writes, its
  captured output included (``RLIMIT_FSIZE``), open files, no core files;
- processes (``RLIMIT_NPROC``): a fork bomb gets ``EAGAIN``. The kernel exempts root from it, so a root
  run drops the child to an unused uid of its own (``sandbox_uid``) when the interpreter is readable by
  other users; afterwards every process left with that uid is killed;
- no network where the OS lets it have a namespace of its own (root, or unprivileged user namespaces),
  else Landlock's TCP rules (Linux 6.7+);
- writes only inside the scratch folder (Landlock, Linux 5.13+); the folder is deleted afterwards.

The outcome's ``status``: ``passed`` (the tests ran to their end), ``failed`` (an assertion),
``error`` (another exception, a syntax error, the program exiting before its tests), ``timeout`` (the
wall clock), ``cpu_time``, ``memory``, ``file_size``, or ``killed`` (another signal).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HARNESS = Path(__file__).with_name("sandbox_harness.py")
#: Unused uids for root runs, one per run at a time (RLIMIT_NPROC counts a uid's tasks all together).
UID_BASE, UID_COUNT = 61000, 2000
_uids = itertools.count()
_uid_lock = threading.Lock()


@dataclass
class Limits:
    #: Seconds of wall clock; past it the process group (and every process of its uid) is killed.
    wall_s: float = 10.0
    #: Seconds of CPU time (SIGXCPU, then SIGKILL a second later).
    cpu_s: int = 5
    #: Address space in MiB (an allocation past it raises MemoryError).
    memory_mb: int = 512
    #: Largest file it may write, in MiB (its stdout and stderr are files too).
    file_size_mb: int = 8
    #: Processes (threads) it may start beside itself.
    processes: int = 8
    open_files: int = 64
    #: Characters of stdout and stderr kept in the outcome.
    output_chars: int = 4000
    #: The interpreter; None: this one, or, for a root run that drops its uid, a python3 other users can read.
    python: str | None = None

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "file_size_mb", "processes", "open_files", "output_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class Outcome:
    status: str
    exit_code: int | None
    signal: str | None
    wall_s: float
    stdout: str
    stderr: str
    protections: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def run_program(code: str, tests: str = "", limits: Limits | None = None) -> Outcome:
    """Run ``code`` then ``tests`` (Python source) in the sandbox; the outcome says how it ended."""
    limits = limits or Limits()
    scratch = Path(tempfile.mkdtemp(prefix="unirl-sandbox-"))
    uid, python = _identity(limits)
    try:
        (scratch / "main.py").write_text(code)
        (scratch / "tests.py").write_text(tests)
        shutil.copy(HARNESS, scratch / "harness.py")
        out, err = open(scratch / ".stdout", "wb"), open(scratch / ".stderr", "wb")
        if uid is not None:
            for path in (scratch, *scratch.iterdir()):
                os.chown(path, uid, uid)
        read, write = os.pipe()
        nonce = secrets.token_hex(16)
        settings = {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_size_mb": limits.file_size_mb,
                    "open_files": limits.open_files, "scratch": str(scratch), "verdict_fd": write, "nonce": nonce,
                    "uid": uid, "nproc": _nproc(limits, uid)}
        start = time.monotonic()
        try:
            proc = subprocess.Popen([python, "-I", "-S", "harness.py", json.dumps(settings)], cwd=scratch,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=(write,),
                                    start_new_session=True, env=_environment(scratch))
        finally:
            os.close(write)
            out.close()
            err.close()
        timed_out = _wait(proc, limits.wall_s, uid)
        wall = time.monotonic() - start
        with os.fdopen(read) as verdict:
            passed = verdict.read() == nonce
        return _outcome(proc.returncode, timed_out, passed, wall, scratch, limits)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _wait(proc: subprocess.Popen, wall_s: float, uid: int | None) -> bool:
    """Wait for the child; past ``wall_s`` kill its process group. Either way, every process left in
    the group or with its uid is killed (a child that left the group, a forked process still sleeping)."""
    timed_out = False
    try:
        proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_group(proc.pid)
    proc.wait()
    if uid is not None:  # a fork bomb may still be forking while a kill lands: until none is left (1 s at most)
        deadline = time.monotonic() + 1.0
        while (left := _pids_of_uid(uid)) and time.monotonic() < deadline:
            for pid in left:
                _kill(pid)
            time.sleep(0.01)
    return timed_out


def _outcome(code: int, timed_out: bool, passed: bool, wall: float, scratch: Path, limits: Limits) -> Outcome:
    stdout = _tail(scratch / ".stdout", limits.output_chars)
    stderr_lines = _tail(scratch / ".stderr", limits.output_chars + 4000).splitlines()
    protections = next((json.loads(line.split(" ", 1)[1]) for line in stderr_lines if line.startswith("#protections ")), {})
    stderr = "\n".join(line for line in stderr_lines if not line.startswith("#protections "))[-limits.output_chars:]
    sig = signal.Signals(-code).name if code is not None and code < 0 else None
    if timed_out:
        status = "timeout"
    elif code == 0:
        status = "passed" if passed else "error"
    elif sig in ("SIGXCPU",) or (sig == "SIGKILL" and wall >= limits.cpu_s):
        status = "cpu_time"
    elif sig == "SIGXFSZ" or code == 6:
        status = "file_size"
    elif code == 4:
        status = "memory"
    elif code == 3:
        status = "failed"
    elif sig is not None:
        status = "killed"
    else:
        status = "error"
    return Outcome(status, code, sig, round(wall, 3), stdout, stderr, protections)


def _identity(limits: Limits) -> tuple[int | None, str]:
    """``(uid to drop to, interpreter)``: as root, an unused uid when an interpreter other users can read
    is found (``limits.python``, this one, or a python3 on the usual paths); otherwise no uid."""
    python = limits.python or sys.executable
    if os.geteuid() != 0:
        return None, python
    candidates = [python] if limits.python else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    reachable = next((p for p in candidates if _readable_by_others(p)), None)
    if reachable is None:
        return None, python
    with _uid_lock:
        return UID_BASE + next(_uids) % UID_COUNT, reachable


def _readable_by_others(path: str) -> bool:
    """Whether a user with no rights of its own can run ``path``: every folder on the way searchable
    and the interpreter (symlinks resolved) readable and executable by others."""
    real = Path(os.path.realpath(path))
    if not real.is_file() or (real.stat().st_mode & 0o005) != 0o005:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


def _nproc(limits: Limits, uid: int | None) -> int:
    """The RLIMIT_NPROC that lets the child start ``limits.processes`` more: a fresh uid has none yet;
    this user's own count (RLIMIT_NPROC counts all of a user's tasks) is added otherwise."""
    if uid is not None:
        return limits.processes + 1
    return _tasks_of_uid(os.getuid()) + limits.processes + 1


def _tasks_of_uid(uid: int) -> int:
    count = 0
    for pid in _pids_of_uid(uid):
        try:
            count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:  # gone meanwhile
            pass
    return count


def _pids_of_uid(uid: int) -> list[int]:
    """The live processes of ``uid`` (zombies left out: they run nothing, and init reaps them)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]  # after "pid (comm)"
            if os.stat(f"/proc/{entry}").st_uid == uid and state != "Z":
                pids.append(int(entry))
        except (OSError, IndexError):  # gone meanwhile
            continue
    return pids


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _environment(scratch: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def _tail(path: Path, chars: int) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data.decode("utf-8", "replace")[-chars:]
