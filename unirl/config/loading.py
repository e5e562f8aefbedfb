"""Load typed config dataclasses from YAML and ``key=value`` overrides, failing with the path.

The dataclasses (``unirl/config/schema.py``, ``unirl/text/config.py``, ...) are the source of truth: this
module knows no field names. It reads a YAML file or a dict, applies dotted overrides
(``algo.clip_high=0.28``, ``rewards[0].weight=2``), then builds the nested instance, checking
every value against its annotation. Any mistake raises ``ConfigError`` naming the dotted path of
the bad key::

    algo.clip_hgih: unknown key. Did you mean 'clip_high'? Valid keys of algo (AlgoConfig): ...
    trainer.total_steps: expected int, got str 'ten'

Paths in a config file resolve relative to that file when they are not absolute and not found
from the working directory: a field whose metadata is ``PATH`` (or ``FILE_SPEC``, for
``path/to/file.py:function``) and whose relative value exists beside the config file (and not in
the working directory) is replaced by that file's absolute path. A value found nowhere stays as
written (it may be a hub name); ``unirl.preflight`` reports it with every place it looked.
``unirl://`` values (bundled data, ``unirl/data/paths.py``) are left as they are.

Supported annotations: int, float (an int is accepted and converted), str, bool (only true/false),
``Optional[X]`` / ``X | None``, ``Literal[...]``, ``list[X]``, ``tuple[X, ...]``, ``tuple[X, Y]``,
``dict[str, X]``, ``Any``, ``pathlib.Path`` (from a string), nested dataclasses (from a mapping)
and lists of them (a bare string fills the field a dataclass names in ``config_shorthand``). A
``ValueError`` raised by a dataclass's ``__post_init__`` (cross-field checks) comes out as a
``ConfigError`` prefixed with that dataclass's path.

YAML is read with YAML 1.2 scalars rather than PyYAML's 1.1 ones: ``1e-4`` is a float (PyYAML
reads a string), and only true/false are booleans (``yes``/``no``/``on``/``off`` stay strings,
so ``country: no`` is not ``False``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping, TypeVar

import yaml

from unirl.config.typed import (SHORTHAND, ConfigError, build_dataclass, default_of, describe, fields_of, has_default,
                                item_type, join_path, strip_optional, to_plain, type_name, unknown_keys_message)

T = TypeVar("T")

#: The shipped configs, ``configs/<kind>/<name>.yaml`` (kind: text, diffusion). They live in
#: ``configs/`` at the repository root; ``unirl/configs`` links there, so a wheel installs them
#: inside the package and a name resolves the same in a checkout and in a plain ``pip install``.
CONFIGS_ROOT = (Path(__file__).resolve().parents[1] / "configs").resolve()

#: Field metadata of a string that may name a file (``field(default="tiny", metadata=PATH)``):
#: a relative value is looked up beside the config file when not found from the working directory.
PATH = types.MappingProxyType({"unirl_path": "path"})
#: Field metadata of a spec that may be ``path/to/file.py:function``: the part before the last
#: ``:`` is such a path when it ends in ``.py`` or contains a ``/``.
FILE_SPEC = types.MappingProxyType({"unirl_path": "file:attr"})


# ----------------------------------------------------------------------------------------------
# YAML
# ----------------------------------------------------------------------------------------------

_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2 booleans and exponent floats (see the module docstring)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
# PyYAML's float pattern needs a dot ("1.0e-4"); this adds "1e-4" and "5E3". Ints still resolve first.
_Loader.add_implicit_resolver(_FLOAT_TAG, re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_yaml(text: str) -> Any:
    """Parse YAML text (a file, or one override value) with this module's scalar rules."""
    return yaml.load(text, Loader=_Loader)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def load_config(cls: type[T], source: str | Path | Mapping | None = None, overrides: Iterable[str] = ()) -> T:
    """Build a ``cls`` instance from a YAML file or a mapping, then ``key=value`` overrides.

    ``source`` is a path to a YAML file, a mapping, or None (all defaults). ``overrides`` are
    ``dotted.key=value`` strings whose values are parsed as YAML (``true``, ``3``, ``1e-4``,
    ``[1, 2]``, ``null``); the key must exist in ``cls``. Raises ``ConfigError``.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config needs a dataclass type, got {cls!r}")
    if isinstance(overrides, str):
        raise TypeError(f"overrides must be a list of key=value strings, got the string {overrides!r}")
    # 1. Read the source into a fresh nested dict (the caller's mapping is never modified).
    data = _read_source(source)
    # 2. Overrides win over the file; each key is checked against the dataclass fields.
    for item in overrides:
        _apply_override(cls, data, item)
    # 3. Build the instance, checking every value against its annotation.
    instance = build_dataclass(cls, data, "")
    # 4. Relative paths not found from the working directory: look beside the config file.
    if isinstance(source, (str, Path)):
        _resolve_paths(instance, Path(source).expanduser().resolve().parent)
    return instance


def config_to_dict(instance: Any) -> dict[str, Any]:
    """A dataclass instance as plain YAML-safe types (Path -> str, tuple -> list), recursively."""
    if not (dataclasses.is_dataclass(instance) and not isinstance(instance, type)):
        raise TypeError(f"config_to_dict needs a dataclass instance, got {instance!r}")
    return to_plain(instance)


def dump_config(instance: Any, path: str | Path) -> Path:
    """Write ``config_to_dict(instance)`` as YAML to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(instance), sort_keys=False, allow_unicode=True))
    return path


def available_configs(kind: str, *, root: str | Path | None = None) -> list[str]:
    """The config names bundled for ``kind`` (``configs/<kind>/*.yaml`` without the suffix)."""
    kind_dir = Path(root if root is not None else CONFIGS_ROOT) / kind
    return sorted(p.stem for p in kind_dir.glob("*.yaml")) if kind_dir.is_dir() else []


def resolve_config_path(kind: str, name_or_path: str | Path, *, root: str | Path | None = None) -> Path:
    """A path to an existing file as is; otherwise NAME -> ``<root>/<kind>/NAME.yaml``.

    ``root`` defaults to ``CONFIGS_ROOT`` (``configs/`` at the repository root). An unknown name
    raises ``ConfigError`` listing the available names for ``kind`` and the close matches.
    """
    given = Path(name_or_path).expanduser()
    if given.is_file():
        return given
    root = Path(root if root is not None else CONFIGS_ROOT)
    name = str(name_or_path).removesuffix(".yaml")
    candidate = root / kind / f"{name}.yaml"
    if "/" not in name and candidate.is_file():
        return candidate

    available = available_configs(kind, root=root)
    if not (root / kind).is_dir():
        kinds = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise ConfigError(
            f"{str(name_or_path)!r} is not a file, and there is no {kind!r} config directory "
            f"{root / kind} (config kinds there: {', '.join(kinds) or '(none)'})"
        )
    close = difflib.get_close_matches(name, available, n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    raise ConfigError(
        f"{str(name_or_path)!r} is neither an existing file nor a {kind} config name.{hint} "
        f"Available {kind} configs (in {root / kind}): {', '.join(available) or '(none)'}"
    )


# ----------------------------------------------------------------------------------------------
# Reading and overrides
# ----------------------------------------------------------------------------------------------


def _read_source(source: str | Path | Mapping | None) -> dict:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if not isinstance(source, (str, Path)):
        raise TypeError(f"config source must be a path, a mapping or None, got {type(source).__name__}")
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {describe(data)}")
    return data


def _apply_override(cls: type, data: dict, item: str) -> None:
    """Set ``data[a][b]... = value`` for ``a.b...=value`` after checking the key exists in ``cls``."""
    key, sep, text = str(item).partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. trainer.total_steps=5)")
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as err:  # e.g. an unclosed [ or {: one line, not the parser's report
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}); quote it or close its brackets") from None
    parts: list[str | int] = [int(p) if p.isdigit() else p for p in key.replace("[", ".").replace("]", "").split(".")]
    if any(p == "" for p in parts):
        raise ConfigError(f"override {item!r}: malformed key {key!r}")

    tp: Any = cls
    node: Any = data
    path = ""
    for depth, part in enumerate(parts):
        tp = strip_optional(tp)
        origin = typing.get_origin(tp)
        seed: Any = {}  # what a missing intermediate container starts as
        if dataclasses.is_dataclass(tp):
            fields = fields_of(tp)
            if part not in fields:
                raise ConfigError(unknown_keys_message(tp, path, [part], root=cls))
            field, child_tp = fields[part]
            if isinstance(strip_optional(child_tp), type) and dataclasses.is_dataclass(strip_optional(child_tp)):
                seed = {}  # the field's default is merged in when the instance is built
            elif has_default(field):
                seed = to_plain(default_of(field))
        elif origin in (dict, Mapping) or tp is dict:
            args = typing.get_args(tp)
            child_tp = args[1] if args else Any
            part = str(part)
        elif origin in (list, tuple) or tp in (list, tuple):
            if not isinstance(part, int):
                raise ConfigError(f"{path}: is a list; index it with a number, not {part!r} (override {item!r})")
            child_tp = item_type(tp, part)
        elif tp is Any:
            child_tp = Any
        else:
            raise ConfigError(f"{path}: is a {type_name(tp)}, it has no key {part!r} (override {item!r})")

        sub_path = join_path(path, part)
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                size = len(node) if isinstance(node, list) else 0
                raise ConfigError(f"{sub_path}: index out of range (the list has {size} items) in override {item!r}")
        elif not isinstance(node, dict):
            raise ConfigError(f"{path}: cannot apply override {item!r}, the value there is {describe(node)}")
        if depth == len(parts) - 1:
            node[part] = value
            return
        if isinstance(node, dict) and node.get(part) is None:
            node[part] = seed
        shorthand = getattr(strip_optional(child_tp), SHORTHAND, None)
        if shorthand is not None and isinstance(node[part], str):  # rewards=[gsm8k] then rewards[0].weight=2
            node[part] = {shorthand: node[part]}
        node, tp, path = node[part], child_tp, sub_path


# ----------------------------------------------------------------------------------------------
# Paths relative to the config file
# ----------------------------------------------------------------------------------------------


def _resolve_paths(instance: Any, config_dir: Path) -> None:
    """Replace, in place, each ``PATH``/``FILE_SPEC`` value found only beside the config file by its absolute path."""
    from unirl.data.paths import locate

    for owner, name, where, attr in _path_values(instance):
        located = locate(where, config_dir)
        if located.path is not None and located.tried[0][0] != located.path:  # found only beside the config
            setattr(owner, name, str(located.path) + attr)


def absolute_paths(instance: Any) -> None:
    """Replace, in place, each ``PATH``/``FILE_SPEC`` value that names an existing file or directory
    by its absolute path, so a saved config works from any working directory (a run's ``config.yaml``
    given to ``unirl eval --config``). Values found nowhere (hub names, registered rewards) stay."""
    for owner, name, where, attr in _path_values(instance):
        path = Path(where).expanduser()
        if path.exists() and not path.is_absolute():
            setattr(owner, name, str(path.absolute()) + attr)


def _path_values(instance: Any):
    """``(owner, field name, path part, ':function' or '')`` of each ``PATH``/``FILE_SPEC`` value
    that may name a file (not empty, not ``unirl://`` or another URL, not a registered name or module)."""
    from unirl.data.paths import is_scheme

    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        kind = field.metadata.get("unirl_path")
        if kind is not None and isinstance(value, str) and value and not is_scheme(value) and "://" not in value:
            where, attr = value, ""
            if kind == "file:attr":
                where, sep, attr = value.rpartition(":")
                if not sep or not (where.endswith(".py") or "/" in where):
                    continue  # a registered name or package.module:function, not a file
                attr = ":" + attr
            yield instance, field.name, where, attr
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _path_values(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    yield from _path_values(item)
