"""Agents: stateful environments whose episodes the policy plays over turns (docs/agents.md).

- ``protocol.py``: the contract (an episode made from a data row: ``reset``, ``step(action) -> Step``,
  ``close``), the registry ``ENVIRONMENTS`` and ``load_environment``;
- ``calls.py``: calling an environment with a timeout, in a daemon thread when it is synchronous;
- ``runner.py``: ``run_episodes``, many episodes at once against a rollout engine;
- ``episodes.py``: episodes as a text run's ``Rollout`` (``rollout.environment``) and their figures;
- ``config.py``: ``rollout.environment``; ``reward.py``: the ``episode_return`` reward;
- environments shipped with unirl: ``walk.py`` (the tiny game), ``code_env.py`` over ``sandbox.py``
  (Python against tests, in a limited process); ``adapters/``: gymnasium, OpenEnv, verifiers.

Importing this package is cheap (no torch): the runner and the environments load on use.
"""

from unirl.agents.protocol import (ENVIRONMENTS, Episode, EpisodeError, Step, list_environments, load_environment,
                                   register_environment)

__all__ = ["ENVIRONMENTS", "Episode", "EpisodeError", "Step", "list_environments", "load_environment",
           "register_environment"]
