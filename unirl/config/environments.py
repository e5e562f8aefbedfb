"""The environments a config can train, and the config dataclass of each: ``unirl train ENV`` and
``unirl.train(ENV, ...)`` look ``ENV`` up here. Both are named as ``module:name`` and imported only
when used, so reading this table imports neither environment (nor torch).
"""

from __future__ import annotations

import importlib

#: environment -> (config dataclass, environment class or factory taking the config); imported only when used.
ENVIRONMENTS = {
    "text": ("unirl.text.config:TextConfig", "unirl.text:build_environment"),
    "diffusion": ("unirl.diffusion.config:DiffusionConfig", "unirl.diffusion:build_environment"),
}


def import_object(path: str):
    """``module:name`` -> the object."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def config_class(env_name: str) -> type:
    if env_name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {env_name!r}; choose from {', '.join(sorted(ENVIRONMENTS))}")
    return import_object(ENVIRONMENTS[env_name][0])
