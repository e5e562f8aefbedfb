"""unirl: RL post-training for LLMs (GRPO with vLLM rollouts) and flow-matching image models (FlowGRPO).

From Python::

    import unirl
    result = unirl.train("text", "tiny", {"trainer.total_steps": 20}, rewards=[my_reward], train_data=rows)

``train``, ``load_config``, ``evaluate`` and ``TrainResult`` live in ``unirl.api``; they are imported
on first use, so ``import unirl`` loads neither torch nor any model library.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TrainResult", "__version__", "evaluate", "load_config", "train"]

_API = {"train", "load_config", "evaluate", "TrainResult"}


#: The distribution's name in pyproject.toml ("unirl" on PyPI is another project: see there).
DISTRIBUTION = "unirl-toolkit"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # a source tree on PYTHONPATH without `pip install -e .`
        return "0+unknown (not installed)"


__version__ = _version()


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("unirl.api"), name)
    raise AttributeError(f"module 'unirl' has no attribute {name!r}")
