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
