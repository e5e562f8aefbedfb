"""Where a config's data comes from: bundled prompt sets (``unirl://``), generated prompts, and
files looked up from the working directory, then beside the config file.

Three forms of a data value (``data.train``, ``data.test``; reward files too, see ``locate``):

- ``unirl://NAME``: a file bundled inside the package (``unirl/data/NAME``, listed by
  ``unirl data list``), e.g. ``unirl://ocr/test.txt``. It resolves the same from any directory and
  in any install.
- ``unirl://ocr/generated?n=20000&seed=0``: prompts generated in code (``unirl/data/ocr_prompts.py``),
  not a file; ``generated_prompts`` returns them. ``unirl://arithmetic/train?n=5000&seed=0`` (and
  ``/test``): text rows with answers (``unirl/text/arithmetic.py``); ``unirl://tiny_search/train``,
  ``/test`` and ``/corpus``: the tiny search task and its corpus (``unirl/text/tiny_search.py``);
  ``generated_rows`` returns them.
- a path: absolute, or relative. A relative path is looked up from the working directory first,
  then beside the config file that names it (``unirl.config.load_config`` does this once when it
  loads a file; see ``locate``). A path found nowhere stays as written, and the error that follows
  names the path as written and every place it was looked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qsl, urlsplit

from unirl.registry import Registry

#: The prefix of a bundled or generated data source.
SCHEME = "unirl://"
#: Where the bundled files live inside the package.
BUNDLED_DIR = Path(__file__).resolve().parent
#: File types that hold prompt rows (the README and licences beside them are not data).
DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
#: Modules whose import registers the built-in generated sources (``register_source``): the tasks own
#: their data and register it here, so this module imports none of them until a source is looked up.
#: Each must import cheaply (no torch): ``unirl data list`` imports them all.
SOURCE_MODULES = ["unirl.data.ocr_prompts", "unirl.text.arithmetic", "unirl.text.tiny_search_task",
                  "unirl.agents.tiny_game_task"]


@dataclass(frozen=True)
class GeneratedSource:
    """A source made in code: ``make(**params)`` returns prompts (strings) or, with ``rows``, text rows
    (``{"question", "answer"}``) or a search corpus (``{"id", "contents"}``)."""

    name: str
    defaults: dict
    about: str
    rows: bool
    make: Callable[..., list]


_SOURCES: Registry[GeneratedSource] = Registry("generated source")
_imported = False


def register_source(name: str, *, defaults: dict, about: str, rows: bool) -> Callable:
    """Register the decorated ``make(**params)`` as ``unirl://NAME``; ``defaults`` name its integer parameters."""

    def decorator(make: Callable[..., list]) -> Callable[..., list]:
        _SOURCES.add(name, GeneratedSource(name, dict(defaults), about, rows, make))
        return make

    return decorator


def generated_sources() -> list[GeneratedSource]:
    """Every registered generated source, sorted by name."""
    return [source for _, source in _registered().items()]


def _registered() -> Registry[GeneratedSource]:
    global _imported
    if not _imported:
        _imported = True
        for module in SOURCE_MODULES:
            importlib.import_module(module)
    return _SOURCES


class DataFileNotFoundError(FileNotFoundError):
    """A data file named by a config does not exist; the message names it as written and where it was looked for."""


@dataclass(frozen=True)
class Bundled:
    """One bundled file: its ``unirl://`` name, where it is, and how many rows (non-empty lines) it has."""

    name: str
    path: Path
    rows: int

    @property
    def spec(self) -> str:
        return SCHEME + self.name


@dataclass(frozen=True)
class Located:
    """Where a path named in a config was looked for: ``tried`` in order, ``path`` the first that exists."""

    written: str
    path: Path | None
    tried: tuple[tuple[Path, str], ...]

    def message(self, what: str) -> str:
        """``what: 'x.txt' not found; looked at: /cwd/x.txt (working directory), ...``"""
        places = ", ".join(f"{p} ({why})" for p, why in self.tried)
        return f"{what}: {self.written!r} not found; looked at: {places}"


def is_scheme(value: str) -> bool:
    return isinstance(value, str) and value.startswith(SCHEME)


def bundled_files() -> list[Bundled]:
    """Every bundled data file, sorted by name."""
    out = []
    for path in sorted(BUNDLED_DIR.rglob("*")):
        if path.is_file() and path.suffix in DATA_SUFFIXES:
            with open(path, encoding="utf-8") as f:
                rows = sum(1 for line in f if line.strip())
            out.append(Bundled(path.relative_to(BUNDLED_DIR).as_posix(), path, rows))
    return out


def _split(spec: str) -> tuple[str, dict[str, str]]:
    """``unirl://ocr/generated?n=5`` -> ``("ocr/generated", {"n": "5"})``."""
    parts = urlsplit(spec)
    name = (parts.netloc + parts.path).strip("/")
    try:
        params = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    except ValueError:
        raise ValueError(f"{spec!r}: malformed parameters {parts.query!r} (expected key=value&key=value)") from None
    return name, params


def is_generated(spec: str) -> bool:
    return is_scheme(spec) and _split(spec)[0] in _registered()


def makes_rows(spec: str) -> bool:
    """A generated source of text rows (``generated_rows``), not of prompts."""
    return is_generated(spec) and _registered().get(_split(spec)[0]).rows


def generated_prompts(spec: str) -> list[str]:
    """The prompts a generated source names, e.g. ``unirl://ocr/generated?n=100&seed=3``."""
    source, params = _generated_params(spec)
    if source.rows:
        raise ValueError(f"{spec!r} makes text rows (question and answer), not prompts: a text config's data.train/test takes it")
    return list(source.make(**params))


def generated_rows(spec: str) -> list[dict]:
    """The rows a generated source names, e.g. ``unirl://arithmetic/train?n=1000&seed=0``."""
    source, params = _generated_params(spec)
    if not source.rows:
        raise ValueError(f"{spec!r} makes prompts, not text rows with answers")
    return [dict(r) for r in source.make(**params)]


def _generated_params(spec: str) -> tuple[GeneratedSource, dict[str, int]]:
    """A generated source and its parameters (the defaults, overridden by the spec's)."""
    name, given = _split(spec)
    if name not in _registered():
        names = ", ".join(SCHEME + g for g in _registered())
        raise ValueError(f"{spec!r} is not a generated source; those are: {names}")
    source = _registered().get(name)
    unknown = sorted(set(given) - set(source.defaults))
    if unknown:
        raise ValueError(f"{spec!r}: unknown parameter(s) {', '.join(unknown)}; {SCHEME}{name} takes {', '.join(source.defaults)}")
    params = dict(source.defaults)
    for key, text in given.items():
        try:
            params[key] = int(text)
        except ValueError:
            raise ValueError(f"{spec!r}: {key} must be an integer, got {text!r}") from None
    return source, params


def bundled_path(name: str) -> Path:
    """The file bundled as ``unirl://NAME``; an unknown name lists the bundled ones."""
    path = BUNDLED_DIR / name
    if name and ".." not in Path(name).parts and path.is_file() and path.suffix in DATA_SUFFIXES:
        return path
    names = [b.spec for b in bundled_files()] + [SCHEME + g + "?..." for g in _registered()]
    raise DataFileNotFoundError(f"{SCHEME}{name} is not bundled with unirl; bundled: {', '.join(names)}")


def local_path(source: str) -> Path:
    """The file a data value names: ``unirl://NAME`` -> the bundled file; a path -> itself (``~`` expanded).

    Existence is not checked for plain paths (the loaders say which file is missing); a generated
    source is not a file (use ``generated_prompts``).
    """
    if is_scheme(source):
        name, params = _split(source)
        if name in _registered():
            raise ValueError(f"{source!r} is generated, not a file (unirl.data.paths.generated_prompts reads it)")
        if params:
            raise ValueError(f"{source!r}: a bundled file takes no parameters")
        return bundled_path(name)
    return Path(source).expanduser()


def locate(written: str, config_dir: Path | None = None) -> Located:
    """Look for the path ``written``: as is when absolute; else from the working directory, then
    in ``config_dir`` (the directory of the config file that names it). ``unirl://`` names the
    bundled file."""
    if is_scheme(written):
        name, _ = _split(written)
        candidates = [(BUNDLED_DIR / name, "bundled with unirl")]
    else:
        path = Path(written).expanduser()
        if path.is_absolute():
            candidates = [(path, "absolute path")]
        else:
            candidates = [(Path.cwd() / path, "working directory")]
            if config_dir is not None and Path(config_dir).resolve() != Path.cwd().resolve():
                candidates.append((Path(config_dir).resolve() / path, "beside the config file"))
    found = next((p for p, _ in candidates if p.exists()), None)
    return Located(written, found, tuple(candidates))
