"""The user documentation builds as a site with every warning an error (a broken link, a page
missing from the navigation, a page the navigation names that does not exist)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.requires("mkdocs", why="the docs site's builder, in the test extra")
def test_docs_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_every_docs_page_is_in_the_navigation():
    import yaml

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    listed = {page for entry in nav for page in entry.values()}
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages == listed, f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}; missing: {sorted(listed - pages)}"


def test_every_shipped_config_says_what_it_needs():
    """docs/running.md's table says, for each shipped config, what a user must supply."""
    table = (REPO / "docs" / "running.md").read_text().split("What each shipped config needs from you")[1].split("\n\n")[1]
    shipped = {f"{p.parent.name}/{p.stem}" for p in (REPO / "configs").glob("*/*.yaml")}
    assert table.startswith("| config |") and len(shipped) >= 14, (table[:80], shipped)
    missing = sorted(name for name in shipped if f"`{name}`" not in table)
    assert not missing, f"configs missing from docs/running.md's table of what each config needs: {missing}"


def _documented_parameters(page: str, function: str) -> list[str]:
    """The parameter names in a page's ``## `unirl.FUNCTION(...)` `` heading."""
    import re

    heading = re.search(rf"^## `unirl\.{function}\((.*?)\)`", page, re.M)
    assert heading, f"docs/python.md has no heading for unirl.{function}"
    return [p.split("=")[0].strip() for p in heading.group(1).split(",") if p.strip() not in ("*", "")]


def test_python_page_names_every_parameter_of_train_and_load_config():
    """Issue 37 item 19: docs/python.md's signature of unirl.train lacked ``recipe=``."""
    import inspect

    import unirl

    page = (REPO / "docs" / "python.md").read_text()
    for function in ("train", "load_config"):
        real = list(inspect.signature(getattr(unirl, function)).parameters)
        assert _documented_parameters(page, function) == real, function
    assert "- `recipe`:" in page  # and says what it does


def test_every_gpu_set_up_in_the_docs_installs_the_default_extras():
    """Issue 37 item 19: a GPU set-up in the docs left out the ``tools`` extra the CPU default has, so
    ``tiny_search`` failed there. Each ``EXTRAS=`` with ``vllm`` names the Makefile's default extras with
    ``cpu`` (the CPU build of vLLM) swapped for ``vllm``."""
    import re

    default = re.search(r"^EXTRAS\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.M).group(1).split(",")
    wanted = sorted("vllm" if e == "cpu" else e for e in default)
    pages = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md"))]
    found = [(page.name, m.group(1)) for page in pages for m in re.finditer(r"EXTRAS=(\S*vllm\S*?)[`\s]", page.read_text())]
    assert len(found) >= 2, found  # docs/index.md and docs/running.md at least
    wrong = [(name, extras) for name, extras in found if sorted(extras.split(",")) != wanted]
    assert not wrong, f"GPU set-ups whose extras are not {','.join(wanted)}: {wrong}"


def test_every_path_the_architecture_page_names_exists():
    """docs/architecture.md names files and folders (``unirl/...``, ``tests/...``, ``configs/...``); each must be
    there, so the page cannot drift from the code unnoticed. A ``path:name`` or ``path::test`` names a function
    or test in that file: it must be defined there."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:unirl|tests|configs|benchmarks)/[\w/.-]+)(?:(?::{1,2})(\w+))?", text))
    assert len(named) > 40, named
    missing = []
    for path, name in sorted(named):
        target = REPO / path.rstrip(".")
        if not target.exists():
            missing.append(path)
        elif name and target.is_file() and not re.search(rf"\b(def|class)\s+{name}\b|^{name}\s*[:=]", target.read_text(), re.M):
            missing.append(f"{path}:{name}")
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
