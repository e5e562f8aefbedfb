"""Environments from the ecosystem as unirl episodes: ``gym`` (gymnasium environments with text or discrete
actions), ``openenv`` (an OpenEnv server's sessions, openenv-core) and ``verifiers`` (PrimeIntellect's).
Each module checks its package first (``require``): without it, the environment is listed as unavailable
with the pip line (``pip install -e .[agents]``); the package itself is imported when an episode is made
(openenv-core and verifiers take seconds to import, which a run of another environment need not pay)."""

import importlib.util


def require(module: str) -> None:
    """Raise ``ModuleNotFoundError`` for ``module`` (named, as an import would) unless it is installed."""
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)
