"""Load typed config dataclasses from YAML and ``key=value`` overrides, failing with the path.

The dataclasses (``unirl/schema.py``, ``unirl/text/config.py``, ...) are the source of truth: this
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
``unirl://`` values (bundled data, ``unirl/data_paths.py``) are left as they are.

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
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, TypeVar, Union

import yaml

T = TypeVar("T")

#: The shipped configs, ``configs/<kind>/<name>.yaml`` (kind: text, diffusion). They live in
#: ``configs/`` at the repository root; ``unirl/configs`` links there, so a wheel installs them
#: inside the package and a name resolves the same in a checkout and in a plain ``pip install``.
CONFIGS_ROOT = (Path(__file__).resolve().parent / "configs").resolve()

#: Field metadata of a string that may name a file (``field(default="tiny", metadata=PATH)``):
#: a relative value is looked up beside the config file when not found from the working directory.
PATH = types.MappingProxyType({"unirl_path": "path"})
#: Field metadata of a spec that may be ``path/to/file.py:function``: the part before the last
#: ``:`` is such a path when it ends in ``.py`` or contains a ``/``.
FILE_SPEC = types.MappingProxyType({"unirl_path": "file:attr"})
#: Class attribute of a config dataclass naming the field a bare string fills: with
#: ``config_shorthand = "name"``, ``rewards: [gsm8k]`` (or ``rewards=[my_rewards.py:fn]`` on the
#: command line) reads as ``rewards: [{name: gsm8k}]``.
SHORTHAND = "config_shorthand"


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message starts with the dotted path."""


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
    instance = _build_dataclass(cls, data, "")
    # 4. Relative paths not found from the working directory: look beside the config file.
    if isinstance(source, (str, Path)):
        _resolve_paths(instance, Path(source).expanduser().resolve().parent)
    return instance


def config_to_dict(instance: Any) -> dict[str, Any]:
    """A dataclass instance as plain YAML-safe types (Path -> str, tuple -> list), recursively."""
    if not (dataclasses.is_dataclass(instance) and not isinstance(instance, type)):
        raise TypeError(f"config_to_dict needs a dataclass instance, got {instance!r}")
    return _to_plain(instance)


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
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {_describe(data)}")
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
        tp = _strip_optional(tp)
        origin = typing.get_origin(tp)
        seed: Any = {}  # what a missing intermediate container starts as
        if dataclasses.is_dataclass(tp):
            fields = _fields(tp)
            if part not in fields:
                raise ConfigError(_unknown_keys_message(tp, path, [part]))
            field, child_tp = fields[part]
            if isinstance(_strip_optional(child_tp), type) and dataclasses.is_dataclass(_strip_optional(child_tp)):
                seed = {}  # the field's default is merged in when the instance is built
            elif _has_default(field):
                seed = _to_plain(_default_of(field))
        elif origin in (dict, Mapping) or tp is dict:
            args = typing.get_args(tp)
            child_tp = args[1] if args else Any
            part = str(part)
        elif origin in (list, tuple) or tp in (list, tuple):
            if not isinstance(part, int):
                raise ConfigError(f"{path}: is a list; index it with a number, not {part!r} (override {item!r})")
            child_tp = _item_type(tp, part)
        elif tp is Any:
            child_tp = Any
        else:
            raise ConfigError(f"{path}: is a {_type_name(tp)}, it has no key {part!r} (override {item!r})")

        sub_path = _join(path, part)
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                size = len(node) if isinstance(node, list) else 0
                raise ConfigError(f"{sub_path}: index out of range (the list has {size} items) in override {item!r}")
        elif not isinstance(node, dict):
            raise ConfigError(f"{path}: cannot apply override {item!r}, the value there is {_describe(node)}")
        if depth == len(parts) - 1:
            node[part] = value
            return
        if isinstance(node, dict) and node.get(part) is None:
            node[part] = seed
        shorthand = getattr(_strip_optional(child_tp), SHORTHAND, None)
        if shorthand is not None and isinstance(node[part], str):  # rewards=[gsm8k] then rewards[0].weight=2
            node[part] = {shorthand: node[part]}
        node, tp, path = node[part], child_tp, sub_path


# ----------------------------------------------------------------------------------------------
# Building and checking
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """The init fields of a dataclass with their resolved annotations (string annotations too)."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError as err:
        raise ConfigError(
            f"cannot resolve the annotations of {cls.__qualname__} ({err}); config dataclasses and the "
            "types they name must be defined at module level"
        ) from None
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def _build_dataclass(cls: type, value: Any, path: str) -> Any:
    if isinstance(value, cls):
        return value
    shorthand = getattr(cls, SHORTHAND, None)
    if isinstance(value, str) and shorthand is not None:  # rewards: [gsm8k] is rewards: [{name: gsm8k}]
        value = {shorthand: value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path or '<root>'}: expected a mapping for {cls.__name__}, got {_describe(value)}")
    fields = _fields(cls)
    unknown = [k for k in value if k not in fields]
    if unknown:
        raise ConfigError(_unknown_keys_message(cls, path, unknown))

    kwargs = {}
    for name, (field, tp) in fields.items():
        sub_path = _join(path, name)
        if name not in value:
            if not _has_default(field):
                raise ConfigError(f"{sub_path}: missing required value ({_type_name(tp)})")
            continue  # the dataclass fills its own default
        given = value[name]
        if isinstance(given, Mapping) and _has_default(field):
            # A partial mapping for a nested dataclass overlays the field's default instance, so a
            # default_factory with non-class defaults keeps them for the keys not given.
            default = _default_of(field)
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                given = {**_to_plain(default), **given}
        kwargs[name] = _convert(given, tp, sub_path)
    try:
        return cls(**kwargs)
    except ValueError as err:  # __post_init__ checks: give them the dataclass's path
        raise ConfigError(f"{path or cls.__name__}: {err}") from err


def _convert(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked against (and converted to) the annotation ``tp``."""
    if tp is Any:
        return value
    if tp is type(None) or tp is None:
        if value is None:
            return None
        raise _mismatch(path, tp, value)

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        if value is None:
            if type(None) in args:
                return None
            raise _mismatch(path, tp, value)
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own message is the most precise
            return _convert(value, options[0], path)
        for option in options:
            try:
                return _convert(value, option, path)
            except ConfigError:
                continue
        raise _mismatch(path, tp, value)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise ConfigError(f"{path}: expected one of {', '.join(map(repr, args))}, got {_describe(value)}")
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise _mismatch(path, tp, value)
        item_tp = args[0] if args else Any
        return [_convert(v, item_tp, _join(path, i)) for i, v in enumerate(value)]
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise _mismatch(path, tp, value)
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            item_tp = args[0] if args else Any
            return tuple(_convert(v, item_tp, _join(path, i)) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{path}: expected {_type_name(tp)} ({len(args)} items), got {len(value)} items: {value!r}")
        return tuple(_convert(v, a, _join(path, i)) for i, (v, a) in enumerate(zip(value, args)))
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise _mismatch(path, tp, value)
        key_tp, value_tp = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise ConfigError(f"{_join(path, str(k))}: keys must be str, got {_describe(k)}")
            out[k] = _convert(v, value_tp, _join(path, str(k)))
        return out
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if tp is bool:
        if type(value) is bool:
            return value
        raise _mismatch(path, tp, value)
    if tp is int:
        if type(value) is int:
            return value
        raise _mismatch(path, tp, value)
    if tp is float:
        if type(value) in (int, float):
            return float(value)
        raise _mismatch(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _mismatch(path, tp, value)
    if isinstance(tp, type) and issubclass(tp, Path):
        if isinstance(value, (str, Path)):
            return tp(value)
        raise _mismatch(path, tp, value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _mismatch(path, tp, value)
    raise ConfigError(f"{path}: unsupported annotation {tp!r}")


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# ----------------------------------------------------------------------------------------------
# Paths relative to the config file
# ----------------------------------------------------------------------------------------------


def _resolve_paths(instance: Any, config_dir: Path) -> None:
    """Replace, in place, each ``PATH``/``FILE_SPEC`` value found only beside the config file by its absolute path."""
    from unirl.data_paths import locate

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
    from unirl.data_paths import is_scheme

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


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def _has_default(field: dataclasses.Field) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def _default_of(field: dataclasses.Field) -> Any:
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def _item_type(tp: Any, index: int) -> Any:
    """The annotation of item ``index`` of a ``list[X]``, ``tuple[X, ...]`` or ``tuple[X, Y]``."""
    args = typing.get_args(tp)
    if not args:
        return Any
    if typing.get_origin(tp) is list or (len(args) == 2 and args[1] is Ellipsis):
        return args[0]
    return args[index] if index < len(args) else Any


def _strip_optional(tp: Any) -> Any:
    """``Optional[X]`` -> X (other unions unchanged)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return options[0]
    return tp


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else str(part)


def _unknown_keys_message(cls: type, path: str, keys: list) -> str:
    valid = list(_fields(cls))
    where = f"{path} ({cls.__name__})" if path else cls.__name__
    lines = []
    for key in keys:
        close = difflib.get_close_matches(str(key), valid, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        lines.append(f"{_join(path, str(key))}: unknown key.{hint} Valid keys of {where}: {', '.join(valid)}")
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    if tp is Any:
        return "Any"
    if tp is type(None) or tp is None:
        return "None"
    if tp is Ellipsis:
        return "..."
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return f"one of {', '.join(map(repr, args))}"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    return getattr(tp, "__name__", repr(tp))


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def _mismatch(path: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{path or '<root>'}: expected {_type_name(tp)}, got {_describe(value)}")
