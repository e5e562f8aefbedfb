"""GenEval's rules (``evaluation/evaluate_images.py``) over a detector's output, as ``unirl/rewards/geneval.py``'s
docstring states them: which detections count, and whether each include and exclude clause holds. Pure
Python; the reward (``geneval.py``) and the default detector (``geneval_detector.py``) both build on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

#: GenEval's colour names (the colour classifier chooses among them).
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")


@dataclass(frozen=True)
class Detection:
    """One detected object: its class name (GenEval's), confidence, box ``(x1, y1, x2, y2)`` in pixels
    and, when the detector segments, its mask (``[H, W]`` bool array) for the colour classifier."""

    label: str
    score: float
    box: tuple[float, float, float, float]
    mask: Any = field(default=None, compare=False)


class Detector(Protocol):
    def detect(self, image) -> list[Detection]: ...

    def colours(self, image, detections: list[Detection], classname: str) -> list[str]: ...


@dataclass(frozen=True)
class Rules:
    """GenEval's settings (``evaluate_images.py``'s ``--options`` defaults)."""

    threshold: float = 0.3
    counting_threshold: float = 0.9
    max_objects: int = 16
    max_overlap: float = 1.0
    position_threshold: float = 0.1


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two boxes, GenEval's way: a box spans ``x2 - x1 + 1`` pixels."""
    def area(x1, y1, x2, y2):
        return max(x2 - x1 + 1, 0) * max(y2 - y1 + 1, 0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a[:4]) + area(*b[:4]) - inter
    return inter / union if union else 0.0


def kept_detections(detections: list[Detection], tag: str, rules: Rules = Rules()) -> dict[str, list[Detection]]:
    """Rule 1: per class, the detections the rules look at, most confident first."""
    threshold = rules.counting_threshold if tag == "counting" else rules.threshold
    by_class: dict[str, list[Detection]] = {}
    for d in sorted(detections, key=lambda d: -d.score):
        if d.score > threshold:
            by_class.setdefault(d.label, []).append(d)
    kept = {}
    for label, ranked in by_class.items():
        ranked, chosen = ranked[: rules.max_objects], []
        for d in ranked:
            if rules.max_overlap >= 1 or all(iou(d.box, c.box) < rules.max_overlap for c in chosen):
                chosen.append(d)
        kept[label] = chosen
    return kept


def relations(a: Sequence[float], b: Sequence[float], position_threshold: float = 0.1) -> set[str]:
    """Rule 4: where box ``a`` lies relative to box ``b``."""
    ca, cb = ((a[0] + a[2]) / 2, (a[1] + a[3]) / 2), ((b[0] + b[2]) / 2, (b[1] + b[3]) / 2)
    size = (abs(a[2] - a[0]) + abs(b[2] - b[0]), abs(a[3] - a[1]) + abs(b[3] - b[1]))
    offset = (ca[0] - cb[0], ca[1] - cb[1])
    shrunk = [math.copysign(max(abs(o) - position_threshold * s, 0.0), o) for o, s in zip(offset, size)]
    if all(abs(v) < 1e-3 for v in shrunk):
        return set()
    length = math.hypot(*offset)
    dx, dy = shrunk[0] / length, shrunk[1] / length
    found = set()
    if dx < -0.5:
        found.add("left of")
    if dx > 0.5:
        found.add("right of")
    if dy < -0.5:
        found.add("above")
    if dy > 0.5:
        found.add("below")
    return found


def check(image, detections: list[Detection], tag: str, include: list[dict], exclude: list[dict] | None,
          detector: Detector, rules: Rules = Rules()) -> tuple[int, int, list[str]]:
    """Rules 2 and 3 on ``detections``: ``(clauses met, clauses, reasons for the failed ones)``."""
    kept = kept_detections(detections, tag, rules)
    met, reasons, groups = 0, [], []  # groups: each include clause's objects, or None where it failed
    for clause in include:
        name, count = clause["class"], clause["count"]
        found = kept.get(name, [])[:count]
        ok = len(found) >= count
        if not ok:
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        elif "color" in clause:
            colours = detector.colours(image, found, name)
            if colours.count(clause["color"]) < count:
                ok = False
                reasons.append(f"expected {clause['color']} {name}>={count}, found {colours.count(clause['color'])} "
                               f"{clause['color']} ({', '.join(colours)})")
        if ok and "position" in clause:
            relation, target = clause["position"]
            if groups[target] is None:
                ok = False
                reasons.append(f"no target for {name} to be {relation}")
            else:
                bad = next(((o, t) for o in found for t in groups[target]
                            if relation not in relations(o.box, t.box, rules.position_threshold)), None)
                if bad is not None:
                    ok = False
                    seen = relations(bad[0].box, bad[1].box, rules.position_threshold)
                    reasons.append(f"expected {name} {relation} target, found {' and '.join(sorted(seen)) or 'no relation'}")
        groups.append(found if ok else None)
        met += ok
    for clause in exclude or []:
        name, count = clause["class"], clause["count"]
        n = len(kept.get(name, []))
        if n >= count:
            reasons.append(f"expected {name}<{count}, found {n}")
        else:
            met += 1
    return met, len(include) + len(exclude or []), reasons
