"""``unirl config list``, ``unirl config show``, ``unirl config losses`` and ``unirl config protocols``: the shipped
configs, every key of one with its value and default, the registered policy losses with their own settings,
and the shipped evaluation protocols.

``unirl config list`` prints each shipped config (``configs/<env>/NAME.yaml``) with the first sentence of
its header comment, and each recipe (``unirl/config/recipes.py``) with the keys it sets. ``unirl config show ENV --config NAME [key=value ...]`` loads the config as a run
would (overrides applied) and prints every key, its value and its default, a ``*`` marking the
keys the config (or an override) changes. What each key means: docs/configs.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    """Add ``config list`` and ``config show``; each sets ``func``."""
    p_config = subparsers.add_parser("config", help="the shipped configs and their keys", parents=[common])
    config_sub = p_config.add_subparsers(dest="config_command", required=True)
    p_list = config_sub.add_parser("list", help="each shipped config with its one-line description", parents=[common])
    p_list.set_defaults(func=list_command, loads_libraries=False)
    p_show = config_sub.add_parser("show", help="every key of a config with its value and default", parents=[common])
    p_show.add_argument("env", choices=["diffusion", "text"])
    p_show.add_argument("--config", required=True, help="config name (unirl config list) or a YAML path")
    p_show.add_argument("--recipe", default=None, help="a recipe's keys, set before the overrides (unirl config list)")
    p_show.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. algo.clip_high=0.28")
    p_show.set_defaults(func=show_command)
    p_losses = config_sub.add_parser("losses", help="the registered policy losses and their settings (algo.loss_args)",
                                     parents=[common])
    p_losses.set_defaults(func=losses_command)
    p_protocols = config_sub.add_parser("protocols", help="the shipped evaluation protocols (eval.protocols, unirl eval "
                                        "--protocol)", parents=[common])
    p_protocols.set_defaults(func=protocols_command, loads_libraries=False)


def list_command(args: argparse.Namespace) -> int:
    from unirl.config import CONFIGS_ROOT, available_configs

    rows = [(env, name, _description(CONFIGS_ROOT / env / f"{name}.yaml"))
            for env in ("text", "diffusion") for name in available_configs(env)]
    widths = [max(len(r[k]) for r in rows) for k in range(2)]
    for env, name, about in rows:
        print(f"{env.ljust(widths[0])}  {name.ljust(widths[1])}  {about}")
    print(f"\nunirl train ENV --config NAME; every key of one: unirl config show ENV --config NAME ({CONFIGS_ROOT})")
    print("\nRecipes (unirl train ENV --config NAME --recipe RECIPE; the keys it sets):")
    for name, line in recipe_lines():
        print(f"  {name.ljust(8)}  {line}")
    return 0


def recipe_lines() -> list[tuple[str, str]]:
    """``(name, "key=value, ...: about (reference)")`` of each recipe."""
    from unirl.config.recipes import RECIPES

    return [(name, ", ".join(f"{k}={_text(v)}" for k, v in recipe.keys.items()) + f": {recipe.about} ({recipe.reference})")
            for name, recipe in RECIPES.items()]


def show_command(args: argparse.Namespace) -> int:
    from unirl.api import load_config
    from unirl.config import config_to_dict
    from unirl.config.environments import config_class

    values = flatten(config_to_dict(load_config(args.env, args.config, args.overrides, recipe=args.recipe)))
    defaults = flatten(config_to_dict(config_class(args.env)()))
    rows = [(("* " if values[k] != defaults.get(k) else "  ") + k, _text(values[k]), _text(defaults.get(k)))
            for k in values]
    header = ("  KEY", "VALUE", "DEFAULT")
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(2)]
    for row in [header, *rows]:
        print(f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}")
    return 0


def losses_command(args: argparse.Namespace) -> int:
    """Each registered policy loss (``algo.policy_loss``), what it reads, and its settings with their defaults
    (``algo.loss_args``)."""
    from unirl.config.docs import loss_lines

    for name, line, settings in loss_lines():
        print(f"{name}: {line}")
        for key, default, about in settings:
            print(f"    algo.loss_args.{key} = {_text(default)}" + (f"   # {about}" if about else ""))
    return 0


def protocols_command(args: argparse.Namespace) -> int:
    """Each shipped evaluation protocol and the keys it sets (the others: the run's config, docs/evaluation.md)."""
    import dataclasses

    from unirl.text.protocols import PROTOCOLS

    for name, protocol in PROTOCOLS.items():
        keys = {f.name: getattr(protocol, f.name) for f in dataclasses.fields(protocol)}
        print(f"{name}: " + ", ".join(f"{k}={_text(v)}" for k, v in keys.items() if v is not None and k != "name"))
    print("\nUse: eval.protocols=[NAME, ...] in a text config, or unirl eval text --protocol NAME")
    return 0


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys; lists (``rewards``) stay one value."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _text(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if not isinstance(value, str) else value


def _description(path: Path) -> str:
    """The first sentence of the config file's header comment (its leading ``#`` lines)."""
    from unirl.registry import first_sentence

    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    return first_sentence("\n".join(header))
