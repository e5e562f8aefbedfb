"""One small registry type for every extension point (advantage estimators, rewards, ...).

A duplicate name is an error and an unknown name lists the valid ones, so a typo in a config
fails with the choices instead of a bare ``KeyError``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> object mapping with a decorator for registration.

    >>> estimators = Registry("advantage estimator")
    >>> @estimators.register("mean")
    ... def mean(x):
    ...     return sum(x) / len(x)
    >>> estimators.get("mean")([1, 3])
    2.0
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items and self._items[name] is not obj:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {_where(self._items[name])})")
        self._items[name] = obj

    def remove(self, name: str) -> None:
        """Forget ``name`` (a registration scoped to one run: ``unirl.train``'s reward callables)."""
        self._items.pop(name, None)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(str(name), self._items, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        return f"unknown {self.kind} {name!r}.{hint} Available: {', '.join(sorted(self._items)) or '(none)'}"

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def items(self):
        return sorted(self._items.items())


def _where(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def first_sentence(text: str) -> str:
    """The first sentence of ``text``'s first paragraph, its lines joined: a one-line description that is
    never cut mid-sentence (a docstring's or a config header's first line often is).

    >>> first_sentence("GRPO on a real model: it learns one-step\\narithmetic. Goal: 0.5.\\n\\nMore.")
    'GRPO on a real model: it learns one-step arithmetic.'
    """
    paragraph = " ".join(text.strip().split("\n\n", 1)[0].split())
    match = re.search(r"(?<=[.!?])\s+(?=[A-Z`(\[])", paragraph)
    return paragraph[: match.start()] if match else paragraph


def build_settings(cls: type | None, given: dict | None, *, key: str, owner: str, name: str):
    """An instance of a registered entry's settings dataclass ``cls`` (None: it has none) from the config's
    ``given`` dict, as a policy loss's ``algo.loss_args`` and a diffusion mode's ``mode_args`` are built: keys
    for an entry without settings, an unknown key, or a value its ``__post_init__`` refuses is a ``ValueError``
    naming ``<key>.<field>`` (or ``<key>``), ``owner`` (e.g. "the policy loss 'cispo'") and the valid keys."""
    given = dict(given or {})
    if cls is None:
        if given:
            raise ValueError(f"{key}: {owner} has no settings of its own, got {', '.join(sorted(given))}")
        return None
    valid = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(given) - valid)
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: not a setting of {owner}; its settings: {', '.join(sorted(valid))}")
    try:
        return cls(**given)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{key} ({name}): {err}") from None
