"""Every file a shipped config reads (prompt files, input images beside it) is package data, so
``--config NAME`` works from a plain (non-editable) install as it does from the clone."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_under_configs_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["unirl"]
    files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*") if p.is_file()
             and "__pycache__" not in p.parts]
    assert len(files) > 20
    # setuptools matches package-data globs per path segment: "*" never crosses a "/".
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data] unirl: {missing}"
