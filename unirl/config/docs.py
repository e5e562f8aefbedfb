"""The config reference, docs/configs.md, generated from the typed dataclasses and their ``#:`` comments.

    python -m unirl.config.docs            # rewrite docs/configs.md
    python -m unirl.config.docs --check    # exit 1 when the page is stale or a field has no comment

Every key of ``TextConfig`` and ``DiffusionConfig`` (``unirl/text/config.py``, ``unirl/diffusion/config.py``
and the shared ``unirl/config/schema.py``) is listed with its type, its default and its meaning: the
``#:`` comment lines right above the field (a nested section's meaning is its class docstring).
A field without either is an error, so a new key cannot land undocumented (``tests/test_config_docs.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import re
import sys
import typing
from pathlib import Path

#: Where the page is written, from the repository root.
PAGE = Path(__file__).resolve().parents[2] / "docs" / "configs.md"
_FIELD = re.compile(r"^\s+(\w+)\s*:")


@functools.lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the ``#:`` comment lines right above its definition in ``cls``'s source, joined (a field
    defined in a base dataclass, e.g. ``RunConfig``'s, by the base's comment unless ``cls`` comments it anew)."""
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            comments.update(field_comments(base))
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = _FIELD.match(line)
        if match and pending:
            comments[match.group(1)] = " ".join(pending)
        pending = []
    return comments


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(key, type, default, meaning)`` of every field of ``cls``, nested sections first as a row of their own."""
    from unirl.config.typed import default_of, fields_of, has_default, strip_optional, to_plain, type_name

    out = []
    comments = field_comments(cls)
    for name, (field, tp) in fields_of(cls).items():
        key = f"{prefix}{name}"
        inner = strip_optional(tp)
        nested = isinstance(inner, type) and dataclasses.is_dataclass(inner)
        meaning = comments.get(name) or (_docstring(inner) if nested else "")
        if nested:
            out.append((key, inner.__name__, "", meaning))
            out.extend(rows(inner, key + "."))
            continue
        item = typing.get_args(inner)[0] if typing.get_origin(inner) is list else None
        if isinstance(item, type) and dataclasses.is_dataclass(item):  # rewards: each item's keys as rewards[].name
            out.append((key, type_name(tp), json.dumps(to_plain(default_of(field))), meaning))
            out.extend(rows(item, key + "[]."))
            continue
        default = to_plain(default_of(field)) if has_default(field) else "(required)"
        out.append((key, type_name(tp), json.dumps(default), meaning))
    return out


def _docstring(cls: type) -> str:
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())  # dataclass's generated signature


def missing(env_classes: dict[str, type]) -> list[str]:
    """Keys without a meaning."""
    return [f"{env}: {key}" for env, cls in env_classes.items() for key, _, _, meaning in rows(cls) if not meaning]


def page(env_classes: dict[str, type]) -> str:
    lines = ["# Config reference", "",
             "Generated from the config dataclasses and their comments by `python -m unirl.config.docs`; do not edit.",
             "Every key can be set in a config file or on the command line (`key=value`, e.g. `algo.clip_high=0.28`);",
             "`unirl config show ENV --config NAME` prints a config's values beside these defaults.", ""]
    for env, cls in env_classes.items():
        lines += [f"## {env} (`{cls.__module__}.{cls.__name__}`)", "", "| key | type | default | meaning |",
                  "|---|---|---|---|"]
        for key, type_name, default, meaning in rows(cls):
            cells = [f"`{key}`", type_name, f"`{default}`" if default else "", meaning]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    from unirl.config.recipes import RECIPES

    lines += ["## Recipes", "", "`unirl train ENV --config NAME --recipe RECIPE` (`unirl.train(..., recipe=...)`) sets these keys "
              "before the overrides (`unirl/config/recipes.py`).", "", "| recipe | keys | what it changes |", "|---|---|---|"]
    for name, recipe in RECIPES.items():
        keys = "<br>".join(f"`{k}={json.dumps(v)}`" for k, v in recipe.keys.items())
        lines.append(f"| `{name}` | {keys} | {recipe.about} ([paper]({recipe.reference})) |")
    lines.append("")
    return "\n".join(lines + loss_settings_section() + mode_settings_section())


def loss_settings_section() -> list[str]:
    """A table of each registered policy loss's own settings (``algo.loss_args``), from its dataclass."""
    lines = ["## Policy losses and their settings", "",
             "`algo.policy_loss` picks a registered loss; `algo.loss_args` sets that loss's own settings (the "
             "dataclass it registered, `unirl/core/policy_losses.py`); `unirl config losses` prints this list.", "",
             "| loss | setting | default | meaning |", "|---|---|---|---|"]
    for name, about, settings in loss_lines():
        lines.append(f"| `{name}` | | | {about.replace('|', chr(92) + '|')} |")
        for key, default, meaning in settings:
            lines.append(f"| | `loss_args.{key}` | `{json.dumps(default)}` | {meaning.replace('|', chr(92) + '|')} |")
    lines.append("")
    return lines


def mode_settings_section() -> list[str]:
    """A table of each registered diffusion algorithm (rollout mode): its default loss and its own settings
    (``mode_args``), from the dataclass it registered."""
    from unirl.diffusion.modes import shipped_modes
    from unirl.registry import first_sentence

    lines = ["## Diffusion algorithms and their settings", "",
             "`algorithm` picks a registered rollout mode (`unirl/diffusion/rollout_mode.py`); `mode_args` sets its "
             "own settings; its loss is `algo.policy_loss`, else the one named here.", "",
             "| algorithm | setting | default | meaning |", "|---|---|---|---|"]
    for name, mode in shipped_modes().items():
        loss = f"`{mode.policy_loss}`" if mode.policy_loss else "the ratio loss of `algo` (`clipped`, or `gspo`)"
        about = first_sentence(mode.__doc__ or "").replace("|", chr(92) + "|")
        lines.append(f"| `{name}` | | | {about} Loss: {loss}. |")
        if mode.settings is not None:
            comments = field_comments(mode.settings)
            for f in dataclasses.fields(mode.settings):
                meaning = comments.get(f.name, "").replace("|", chr(92) + "|")
                lines.append(f"| | `mode_args.{f.name}` | `{json.dumps(f.default)}` | {meaning} |")
    lines.append("")
    return lines


def loss_lines() -> list[tuple[str, str, list[tuple[str, typing.Any, str]]]]:
    """``(name, first sentence of its docstring, [(setting, default, its comment)])`` per registered loss."""
    from unirl.core import POLICY_LOSSES
    from unirl.registry import first_sentence

    out = []
    for name, loss in POLICY_LOSSES.items():
        settings = []
        if loss.settings is not None:
            comments = field_comments(loss.settings)
            settings = [(f.name, f.default, comments.get(f.name, "")) for f in dataclasses.fields(loss.settings)]
        out.append((name, first_sentence(loss.fn.__doc__ or ""), settings))
    return out


def env_classes() -> dict[str, type]:
    from unirl.config.environments import ENVIRONMENTS, config_class

    return {env: config_class(env) for env in ENVIRONMENTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unirl.config.docs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale or a key has no comment")
    args = parser.parse_args(argv)
    classes = env_classes()
    undocumented = missing(classes)
    if undocumented:
        print("keys without a #: comment (or a section docstring):\n  " + "\n  ".join(undocumented), file=sys.stderr)
        return 1
    text = page(classes)
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python -m unirl.config.docs", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
