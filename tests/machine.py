"""What a test needs from the machine it runs on, beyond the test install: the optional packages a
shipped config's run needs, and the environment of a CLI child process.

The suite runs on a CPU machine with everything (``make test``) and on a GPU machine whose packages come
from ``PYTHONPATH`` and which lacks vLLM, rapidocr and the SmolLM2 wheel (``benchmarks/gpu_check.sh``):
there, a test that needs one of those skips saying which, and a child process keeps ``PYTHONPATH``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

#: Built-in rewards whose module imports an optional package (unirl/rewards/registry.py's BUILTIN_MODULES).
REWARD_PACKAGES = {"ocr": "rapidocr"}


def config_packages(path: Path) -> list[str]:
    """The optional packages a run of the config at ``path`` needs: the named models' wheels (model,
    critic, reward model, teacher) and the rewards' engines; vLLM when it samples with vLLM."""
    from unirl.models.named import MODELS

    cfg = yaml.safe_load(path.read_text()) or {}
    needs = [REWARD_PACKAGES[r["name"]] for r in cfg.get("rewards") or [] if r.get("name") in REWARD_PACKAGES]
    for section in ("model", "critic", "distill"):
        for key in ("name_or_path", "teacher"):
            name = (cfg.get(section) or {}).get(key)
            if isinstance(name, str) and name in MODELS:
                needs.append(MODELS.get(name).module)
    return sorted(set(needs))


def missing(packages) -> list[str]:
    return [p for p in packages if importlib.util.find_spec(p) is None]


def config_param(path: Path, root: Path | None = None):
    """``path`` as a pytest parameter that skips, naming the packages, where the config needs missing ones."""
    packages = missing(config_packages(path if root is None else root / path))
    marks = [pytest.mark.skip(reason=f"needs {', '.join(packages)}, not installed here")] if packages else []
    return pytest.param(path, marks=marks)


def repo_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a CLI child process run from the repository: the repository first on
    ``PYTHONPATH``, whatever was there kept (a GPU machine's packages come from it)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def fresh_accelerate_state() -> None:
    """Accelerate's process-wide state unset. It is a borg: every ``Accelerator`` shares one
    ``PartialState``/``AcceleratorState`` dict, so in one process a CUDA ``Accelerator`` (a run's, through
    ``unirl.train``) and a later ``Accelerator(cpu=True)`` collide ("AcceleratorState has already been
    initialized ... pass cpu=True") on a GPU machine. Fresh dicts are swapped in rather than the old ones
    cleared (``_reset_state``), so accelerators made before keep their state."""
    import sys

    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState, PartialState

        for cls in (PartialState, AcceleratorState, GradientState):
            cls._shared_state = {}
