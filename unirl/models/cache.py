"""Where unirl builds and caches its local artefacts (the tiny models of the demos and tests), and the
one way they are built: once, under a lock, renamed into place (``cached_build``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

#: The torch threads every build runs on, whatever the caller's. A build that trains (a toy's warm start,
#: a fitted decoder) ends in other last bits with another thread count (reductions split differently), so
#: without it a toy's weights would depend on who built it first: a CLI run (all cores), a gloo test rank
#: (one thread) or a process whose threads vLLM's CPU worker rebound. With it the cache holds what its
#: key (the spec) says, on any machine of one CPU kind. Two: a CI machine's cores, and what
#: tests/fixtures/pinned_metrics.json's toys were built with.
BUILD_THREADS = 2


def default_cache_dir() -> Path:
    """``$UNIRL_CACHE``, else ``$XDG_CACHE_HOME/unirl``, else ``~/.cache/unirl``."""
    root = os.environ.get("UNIRL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "unirl")
    return Path(root)


def spec_digest(spec: dict) -> str:
    """The 12-hex-digit hash of a build's spec (its cache key)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def progress(message: str) -> None:
    """One line on stderr (and so in the run log): a build takes minutes on a CPU and would otherwise
    look like a hang."""
    print(f"unirl: {message}", file=sys.stderr, flush=True)


def cached_build(directory: Path, spec: dict, marker_name: str, build: Callable[[Path], dict | None], *,
                 what: str = "the toy model") -> Path:
    """``build(work)`` unless ``directory`` already holds this ``spec``'s build; returns ``directory``.

    The build runs once however many processes ask at once: under a file lock beside the directory, the
    first builds into a temporary directory that is renamed into place (with its marker, the hash of
    ``spec`` and whatever ``build`` returns, written last), and the others wait for the lock and find it
    built. A stale or half-written directory is removed and rebuilt. The build runs in a fork of the
    caller's RNG: a run that builds (a cold cache) draws the same afterwards as one that finds it; and on
    ``BUILD_THREADS`` threads: the same weights whoever builds.
    """
    import torch

    digest = spec_digest(spec)
    if _built(directory, marker_name, digest):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(directory.parent / f".{directory.name}.lock", what):
        if _built(directory, marker_name, digest):  # another process built it while this one waited
            return directory
        work = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            progress(f"building {what} once (cached in {directory}) ...")
            start = time.monotonic()
            with torch.random.fork_rng(devices=[]), _threads(BUILD_THREADS):
                extra = build(work) or {}
            (work / marker_name).write_text(json.dumps({"digest": digest, "spec": spec, **extra}, indent=1))
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(work, directory)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        progress(f"built {what} in {time.monotonic() - start:.0f} s")
    return directory


@contextlib.contextmanager
def _threads(count: int):
    """torch on ``count`` threads, then the caller's again. ``torch._C``'s setter: vLLM's CPU worker replaces
    ``torch.set_num_threads`` by a no-op once it has bound its threads (see ``unirl/rollout/``)."""
    import torch

    before = torch.get_num_threads()
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def _built(directory: Path, marker_name: str, digest: str) -> bool:
    marker = directory / marker_name
    try:
        return json.loads(marker.read_text()).get("digest") == digest
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(path: Path, what: str):
    """An exclusive lock on ``path`` (POSIX ``flock``; none where there is no ``fcntl``), saying when it waits."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the rename still keeps a half-written build out of sight
        yield
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process building {what} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
