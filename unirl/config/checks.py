"""The range check every config section's ``__post_init__`` uses (``unirl.config.schema`` re-exports it)."""

from __future__ import annotations

from typing import Any


def check_range(owner: Any, name: str, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, optional: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``owner.<name>`` lies in the range (NaN never does;
    None only when ``optional``). The config loader prefixes the section's path (``optim: max_grad_norm ...``)."""
    value = getattr(owner, name)
    if value is None and optional:
        return
    ok = value is not None and value == value
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        expected = " and ".join(part for part in (lo, hi) if part) + (" or null" if optional else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")
