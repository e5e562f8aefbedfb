"""Where a config's data comes from: bundled prompt sets (``unirl://``), generated prompts, and
files looked up from the working directory, then beside the config file.

Three forms of a data value (``data.train``, ``data.test``; reward files too, see ``locate``):

- ``unirl://NAME``: a file bundled inside the package (``unirl/data/NAME``, listed by
  ``unirl data list``), e.g. ``unirl://ocr/test.txt``. It resolves the same from any directory and
  in any install.
- ``unirl://ocr/generated?n=20000&seed=0``: prompts generated in code (``unirl/ocr_prompts.py``),
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

import functools
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

#: The prefix of a bundled or generated data source.
SCHEME = "unirl://"
#: Where the bundled files live inside the package.
BUNDLED_DIR = Path(__file__).resolve().parent / "data"
#: File types that hold prompt rows (the README and licences beside them are not data).
DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
#: Generated sources: name -> (parameters with their defaults, description). ``ocr/generated`` makes
#: prompts (``generated_prompts``); ``arithmetic/*`` make text rows with an answer (``generated_rows``).
GENERATED = {
    "ocr/generated": ({"n": 20000, "seed": 0}, "OCR training prompts of the test set's form, made in code (unirl/ocr_prompts.py)"),
    "arithmetic/train": ({"n": 5000, "seed": 0, "max_operand": 20},
                         "one-step arithmetic word problems with GSM8K answers (unirl/text/arithmetic.py)"),
    "arithmetic/test": ({"n": 200, "seed": 0, "max_operand": 20},
                        "held-out arithmetic word problems, never in arithmetic/train (unirl/text/arithmetic.py)"),
    "tiny_search/train": ({"seed": 0}, "'What is the code of NAME?' with the code as answer, 32 names (unirl/text/tiny_search.py)"),
    "tiny_search/test": ({"seed": 0}, "the same question about 16 other names, for evaluation (unirl/text/tiny_search.py)"),
    "tiny_search/corpus": ({"seed": 0}, "the search corpus of tiny_search's 48 names and codes, {id, contents} "
                                        "rows (unirl/text/tiny_search.py)"),
}
#: The generated sources that make rows (text rows {"question", "answer"}, or a search corpus), not prompts.
GENERATED_ROWS = ("arithmetic/train", "arithmetic/test", "tiny_search/train", "tiny_search/test", "tiny_search/corpus")


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
    return is_scheme(spec) and _split(spec)[0] in GENERATED


def makes_rows(spec: str) -> bool:
    """A generated source of text rows (``generated_rows``), not of prompts."""
    return is_generated(spec) and _split(spec)[0] in GENERATED_ROWS


def generated_prompts(spec: str) -> list[str]:
    """The prompts a generated source names, e.g. ``unirl://ocr/generated?n=100&seed=3``."""
    name, params = _generated_params(spec)
    if name in GENERATED_ROWS:
        raise ValueError(f"{spec!r} makes text rows (question and answer), not prompts: a text config's data.train/test takes it")
    return list(_generate_ocr(params["n"], params["seed"]))


def generated_rows(spec: str) -> list[dict]:
    """The rows a generated source names, e.g. ``unirl://arithmetic/train?n=1000&seed=0``."""
    name, params = _generated_params(spec)
    if name not in GENERATED_ROWS:
        raise ValueError(f"{spec!r} makes prompts, not text rows with answers")
    task, part = name.split("/")
    if task == "tiny_search":
        from unirl.text.tiny_search import task_rows

        return task_rows(part, params["seed"])
    from unirl.text.arithmetic import rows

    return [dict(r) for r in rows(part, params["n"], params["seed"], params["max_operand"])]


def _generated_params(spec: str) -> tuple[str, dict[str, int]]:
    """A generated source's name and its parameters (the defaults, overridden by the spec's)."""
    name, given = _split(spec)
    if name not in GENERATED:
        raise ValueError(f"{spec!r} is not a generated source; those are: {', '.join(SCHEME + g for g in GENERATED)}")
    defaults, _ = GENERATED[name]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{spec!r}: unknown parameter(s) {', '.join(unknown)}; {SCHEME}{name} takes {', '.join(defaults)}")
    params = dict(defaults)
    for key, text in given.items():
        try:
            params[key] = int(text)
        except ValueError:
            raise ValueError(f"{spec!r}: {key} must be an integer, got {text!r}") from None
    return name, params


@functools.lru_cache(maxsize=4)
def _generate_ocr(n: int, seed: int) -> tuple[str, ...]:
    from unirl.ocr_prompts import generate

    test = bundled_path("ocr/test.txt").read_text(encoding="utf-8").splitlines()
    return tuple(generate(n, seed, exclude={line.strip() for line in test}))


def bundled_path(name: str) -> Path:
    """The file bundled as ``unirl://NAME``; an unknown name lists the bundled ones."""
    path = BUNDLED_DIR / name
    if name and ".." not in Path(name).parts and path.is_file() and path.suffix in DATA_SUFFIXES:
        return path
    names = [b.spec for b in bundled_files()] + [SCHEME + g + "?n=...&seed=..." for g in GENERATED]
    raise DataFileNotFoundError(f"{SCHEME}{name} is not bundled with unirl; bundled: {', '.join(names)}")


def local_path(source: str) -> Path:
    """The file a data value names: ``unirl://NAME`` -> the bundled file; a path -> itself (``~`` expanded).

    Existence is not checked for plain paths (the loaders say which file is missing); a generated
    source is not a file (use ``generated_prompts``).
    """
    if is_scheme(source):
        name, params = _split(source)
        if name in GENERATED:
            raise ValueError(f"{source!r} is generated, not a file (unirl.data_paths.generated_prompts reads it)")
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
