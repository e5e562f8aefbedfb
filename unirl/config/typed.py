"""Values checked against their annotations and built into config dataclasses, failing with the dotted path.

``build_dataclass(cls, mapping, path)`` is what ``unirl.config.load_config`` calls once the YAML and
the overrides are merged; the supported annotations are listed in ``unirl/config/loading.py``. This
module knows no field names and reads no files.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Union

#: Class attribute of a config dataclass naming the field a bare string fills: with
#: ``config_shorthand = "name"``, ``rewards: [gsm8k]`` (or ``rewards=[my_rewards.py:fn]`` on the
#: command line) reads as ``rewards: [{name: gsm8k}]``.
SHORTHAND = "config_shorthand"


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message starts with the dotted path."""


# ----------------------------------------------------------------------------------------------
# Building and checking
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def fields_of(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """The init fields of a dataclass with their resolved annotations (string annotations too)."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError as err:
        raise ConfigError(
            f"cannot resolve the annotations of {cls.__qualname__} ({err}); config dataclasses and the "
            "types they name must be defined at module level"
        ) from None
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


#: The config class being built from its root, for an unknown key's "did you mean" in other sections.
_ROOT: contextvars.ContextVar[type | None] = contextvars.ContextVar("unirl_config_root", default=None)


def build_dataclass(cls: type, value: Any, path: str) -> Any:
    if path:
        return _build_dataclass(cls, value, path)
    token = _ROOT.set(cls)
    try:
        return _build_dataclass(cls, value, path)
    finally:
        _ROOT.reset(token)


def _build_dataclass(cls: type, value: Any, path: str) -> Any:
    if isinstance(value, cls):
        return value
    shorthand = getattr(cls, SHORTHAND, None)
    if isinstance(value, str) and shorthand is not None:  # rewards: [gsm8k] is rewards: [{name: gsm8k}]
        value = {shorthand: value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path or '<root>'}: expected a mapping for {cls.__name__}, got {describe(value)}")
    fields = fields_of(cls)
    unknown = [k for k in value if k not in fields]
    if unknown:
        raise ConfigError(unknown_keys_message(cls, path, unknown))

    kwargs = {}
    for name, (field, tp) in fields.items():
        sub_path = join_path(path, name)
        if name not in value:
            if not has_default(field):
                raise ConfigError(f"{sub_path}: missing required value ({type_name(tp)})")
            continue  # the dataclass fills its own default
        given = value[name]
        if isinstance(given, Mapping) and has_default(field):
            # A partial mapping for a nested dataclass overlays the field's default instance, so a
            # default_factory with non-class defaults keeps them for the keys not given.
            default = default_of(field)
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                given = {**to_plain(default), **given}
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
    if origin is Union or origin is types.UnionType:
        return _convert_union(value, tp, path)
    if origin is Literal:
        args = typing.get_args(tp)
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise ConfigError(f"{path}: expected one of {', '.join(map(repr, args))}, got {describe(value)}")
    if origin is list or tp is list or origin is tuple or tp is tuple:
        return _convert_sequence(value, tp, path)
    if origin in (dict, Mapping) or tp is dict:
        return _convert_mapping(value, tp, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path)
    return _convert_scalar(value, tp, path)


def _convert_union(value: Any, tp: Any, path: str) -> Any:
    args = typing.get_args(tp)
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


def _convert_sequence(value: Any, tp: Any, path: str) -> list | tuple:
    """``list[X]``, ``tuple[X, ...]`` or ``tuple[X, Y]`` from a YAML list."""
    if not isinstance(value, (list, tuple)):
        raise _mismatch(path, tp, value)
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list or tp is list:
        item_tp = args[0] if args else Any
        return [_convert(v, item_tp, join_path(path, i)) for i, v in enumerate(value)]
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        item_tp = args[0] if args else Any
        return tuple(_convert(v, item_tp, join_path(path, i)) for i, v in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(f"{path}: expected {type_name(tp)} ({len(args)} items), got {len(value)} items: {value!r}")
    return tuple(_convert(v, a, join_path(path, i)) for i, (v, a) in enumerate(zip(value, args)))


def _convert_mapping(value: Any, tp: Any, path: str) -> dict:
    if not isinstance(value, Mapping):
        raise _mismatch(path, tp, value)
    args = typing.get_args(tp)
    key_tp, value_tp = args if args else (Any, Any)
    out = {}
    for k, v in value.items():
        if key_tp is str and not isinstance(k, str):
            raise ConfigError(f"{join_path(path, str(k))}: keys must be str, got {describe(k)}")
        out[k] = _convert(v, value_tp, join_path(path, str(k)))
    return out


def _convert_scalar(value: Any, tp: Any, path: str) -> Any:
    """bool, int and str exactly (``True`` is no int); float from an int too; ``Path`` from a string."""
    if tp in (bool, int):
        ok = type(value) is tp
    elif tp is float:
        ok = type(value) in (int, float)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    elif isinstance(tp, type) and issubclass(tp, Path):
        ok = isinstance(value, (str, Path))
        value = tp(value) if ok else value
    elif isinstance(tp, type):
        ok = isinstance(value, tp)
    else:
        raise ConfigError(f"{path}: unsupported annotation {tp!r}")
    if not ok:
        raise _mismatch(path, tp, value)
    return value


def to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def has_default(field: dataclasses.Field) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def default_of(field: dataclasses.Field) -> Any:
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def item_type(tp: Any, index: int) -> Any:
    """The annotation of item ``index`` of a ``list[X]``, ``tuple[X, ...]`` or ``tuple[X, Y]``."""
    args = typing.get_args(tp)
    if not args:
        return Any
    if typing.get_origin(tp) is list or (len(args) == 2 and args[1] is Ellipsis):
        return args[0]
    return args[index] if index < len(args) else Any


def strip_optional(tp: Any) -> Any:
    """``Optional[X]`` -> X (other unions unchanged)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return options[0]
    return tp


def join_path(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else str(part)


def unknown_keys_message(cls: type, path: str, keys: list, root: type | None = None) -> str:
    """One line per unknown key of section ``path`` (a ``cls``): where a key moved (the class's ``config_moved``:
    old key -> the new key's full path), that path; else close names in the section and the keys of that name in
    the root config's other sections (``trainer.lr``: ``optim.lr``), then the section's valid keys."""
    valid = list(fields_of(cls))
    where = f"{path} ({cls.__name__})" if path else cls.__name__
    moved = getattr(cls, "config_moved", {})
    root = root or _ROOT.get()
    lines = []
    for key in keys:
        if key in moved:
            lines.append(f"{join_path(path, str(key))}: this key moved to {moved[key]}; set it there")
            continue
        close = [repr(k) for k in difflib.get_close_matches(str(key), valid, n=3)]
        if root is not None:
            close += [repr(k) for k in dotted_keys(root) if k.rpartition(".")[2] == str(key)
                      and k.rpartition(".")[0] != path][:3]
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        lines.append(f"{join_path(path, str(key))}: unknown key.{hint} Valid keys of {where}: {', '.join(valid)}")
    return "\n".join(lines)


def dotted_keys(cls: type, prefix: str = "", depth: int = 3) -> list[str]:
    """Every leaf key of a config class as a dotted path (``optim.lr``), nested sections ``depth`` deep."""
    out = []
    for name, (_, tp) in fields_of(cls).items():
        inner = strip_optional(tp)
        if isinstance(inner, type) and dataclasses.is_dataclass(inner) and depth > 1:
            out += dotted_keys(inner, f"{prefix}{name}.", depth - 1)
        else:
            out.append(f"{prefix}{name}")
    return out


def type_name(tp: Any) -> str:
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
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    return getattr(tp, "__name__", repr(tp))


def describe(value: Any) -> str:
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def _mismatch(path: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{path or '<root>'}: expected {type_name(tp)}, got {describe(value)}")
