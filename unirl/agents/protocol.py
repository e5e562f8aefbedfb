"""The environment contract of unirl's agents: an episode made from a data row, stepped with the policy's
text, and the names of environments (``ENVIRONMENTS``, ``register_environment``). The bottom of
``unirl/agents/``; it imports nothing from it.

An **environment** is a callable ``make(row, **settings) -> episode``: a class whose instances are
episodes (its ``__init__`` takes the row first), or a function that returns one. ``row`` is the data
row the episode plays (its ``prompt`` and the other columns); ``settings`` come from the config
(``rollout.environment.kwargs``), checked by name at load. Episodes of one row (a group of GRPO) are
made from the same row: make them play the same task (seed any randomness from the row).

An **episode** holds its own state and has three methods, each a plain method or ``async def`` (an
environment may ``await`` I/O: an HTTP server, a subprocess):

- ``reset() -> str | None``: the first observation, which is the episode's prompt (the chat template is
  applied to it, as to a data row's prompt). None: the row's ``prompt``.
- ``step(action: str) -> Step``: the policy's turn as text (its stop string or EOS included, as
  sampled); the answer: an observation (shown to the policy before its next turn), an optional reward
  for this turn, whether the episode is over (``done``) or was cut short by the environment
  (``truncated``), and ``info`` for logging.
- ``close()``: always called once the episode is over: at its end, after a timeout or an error, and
  when the run stops (optional: an episode without one has nothing to release).

An episode that raises, returns something else, or takes longer than ``rollout.environment.step_timeout_s``
in any of the three never ends the run: it is ended there (its reward is what it earned so far and its
tokens leave the loss), one line names it, and it is counted (``env/errors``, ``env/timeouts``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from unirl.plugins import Plugins, check_kwargs
from unirl.registry import first_sentence

#: Modules whose import registers the built-in environments (an adapter needing an optional package
#: imports it first: without it, its environment is listed as unavailable with the pip line).
BUILTIN_MODULES: list[str] = ["unirl.agents.walk", "unirl.agents.code_env", "unirl.agents.adapters.gym",
                              "unirl.agents.adapters.openenv", "unirl.agents.adapters.verifiers"]

#: The entry-point group through which an installed package adds environments.
ENTRY_POINT_GROUP = "unirl.environments"


class EpisodeError(ValueError):
    """An environment cannot be loaded, its settings do not fit it, or an episode broke the contract."""


@dataclass
class Step:
    """An environment's answer to one turn of the policy."""

    #: What the policy is shown before its next turn (ignored when the episode is over).
    observation: str = ""
    #: This turn's reward; None: none for this turn (0 in the episode's return).
    reward: float | None = None
    #: The episode is over (the task is solved or failed).
    done: bool = False
    #: The environment cut the episode short (its own step limit); it is over too.
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Episode:
    """A convenience base for episodes (any object with ``reset`` and ``step`` will do): nothing to close."""

    def reset(self) -> str | None:
        raise NotImplementedError

    def step(self, action: str) -> Step:
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class EnvironmentInfo:
    """What a listing shows about a registered environment."""

    name: str
    description: str
    #: ``built-in``, ``entry point <dist> <version> (<module:attr>)`` or ``module <name>``.
    source: str


ENVIRONMENTS: Plugins = Plugins(
    "environment", builtin_modules=BUILTIN_MODULES, group=ENTRY_POINT_GROUP, error=EpisodeError,
    register=lambda name, obj: register_environment(name)(obj), package_dir=Path(__file__).resolve().parent,
    skip_first=True)


def register_environment(name: str, *, description: str | None = None) -> Callable:
    """Register an environment (an episode class, or a function ``make(row, **settings)``) under ``name``;
    ``description`` defaults to its docstring's first sentence."""

    def decorator(make: Callable) -> Callable:
        if not callable(make):
            raise TypeError(f"environment {name!r}: register a class or a function, got {type(make).__name__}")
        ENVIRONMENTS.add(name, make)
        module = getattr(make, "__module__", "?")
        source = "built-in" if module in ENVIRONMENTS.builtin_modules else f"module {module}"
        about = description if description is not None else first_sentence(inspect.getdoc(make) or "")
        ENVIRONMENTS.info[name] = EnvironmentInfo(name, about, source)
        return make

    return decorator


def load_environment(spec: str, kwargs: dict[str, Any] | None = None) -> Callable[[dict], Any]:
    """``row -> episode`` for the environment ``spec`` names (a registered name, an entry point of
    ``unirl.environments``, ``path/to/file.py:Name`` or ``package.module:Name``), with the config's
    ``kwargs`` checked against its parameters (after the row) and bound."""
    kwargs = dict(kwargs or {})
    make = ENVIRONMENTS.resolve(spec)
    if inspect.isclass(make):  # its __init__'s first parameter after self is the row, not a setting
        if "row" in kwargs:
            raise EpisodeError(f"environment {spec!r}: 'row' is the data row each episode is made from, not a setting")
        check_kwargs(spec, make, kwargs, kind="environment", error=EpisodeError)
    else:
        check_kwargs(spec, make, kwargs, kind="environment", error=EpisodeError, skip_first=True)

    def episode(row: dict) -> Any:
        made = make(row, **kwargs)
        missing = [m for m in ("reset", "step") if not callable(getattr(made, m, None))]
        if missing:
            raise EpisodeError(f"environment {spec!r} made a {type(made).__name__} without {' and '.join(missing)}(): "
                               f"an episode needs reset() and step(action) (unirl/agents/protocol.py)")
        return made

    episode.spec = spec
    return episode


def checked_step(result: Any) -> Step:
    """``result`` if it is a well-formed ``Step`` (a string observation, a finite reward or None); else
    an ``EpisodeError`` saying what came back."""
    if not isinstance(result, Step):
        raise EpisodeError(f"step() returned a {type(result).__name__}, not a unirl.agents.Step")
    if not isinstance(result.observation, str):
        raise EpisodeError(f"step() returned an observation of type {type(result.observation).__name__}, not a string")
    reward = result.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)):
        raise EpisodeError(f"step() returned the reward {reward!r}: a finite number or None was expected")
    return result


def list_environments() -> list[EnvironmentInfo]:
    """Every registered environment, sorted by name: built-ins, entry points, and those of modules imported so far."""
    return ENVIRONMENTS.listing()
