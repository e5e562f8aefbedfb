"""unirl imports under one name: the rewards package is ``unirl.rewards`` (the ``rewards/`` folder,
linked into the package as ``unirl/configs`` is), never a top-level ``rewards`` that a PyPI project of
that name or a user's own ``rewards.py`` would shadow."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _top_level_rewards_imports(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            lines += [node.lineno for alias in node.names if alias.name.split(".")[0] == "rewards"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "rewards":
            lines.append(node.lineno)
    return lines


def test_no_code_imports_a_top_level_rewards_package():
    offenders = []
    for folder in ("unirl", "rewards", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "rewards" in path.relative_to(ROOT).parts[1:2] and folder == "unirl":
                continue  # unirl/rewards is the link to rewards/, scanned once as rewards/
            offenders += [f"{path.relative_to(ROOT)}:{n}" for n in _top_level_rewards_imports(path.read_text())]
    assert not offenders, f"import unirl.rewards, not rewards: {offenders}"


def test_docs_examples_import_unirl_rewards():
    pattern = re.compile(r"^\s*(from rewards\b|import rewards\b)", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
                 if pattern.search(p.read_text())]
    assert not offenders, f"examples must import unirl.rewards: {offenders}"


def test_the_distribution_ships_no_top_level_rewards_package():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert packages["include"] == ["unirl*"], packages
    assert (ROOT / "unirl" / "rewards" / "__init__.py").is_file() and not (ROOT / "unirl" / "rewards").is_symlink()
    assert not (ROOT / "rewards").exists()  # the rewards live inside unirl/, no top-level package or link


def test_the_distribution_name_is_not_pypis_unirl():
    import unirl

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == unirl.DISTRIBUTION != "unirl"  # "unirl" on PyPI is Tencent's UniRL
    assert project["scripts"] == {"unirl": "unirl.cli:main"}


def test_a_users_own_rewards_module_does_not_shadow_unirl_rewards(tmp_path):
    # A notebook's working directory holding its own rewards.py (first on sys.path, as in Jupyter).
    (tmp_path / "rewards.py").write_text("raise ImportError('the user rewards.py was imported')\n")
    code = ("import unirl.rewards as r; fn = r.load_reward('gsm8k'); "
            "print(fn(['#### 3'], prompts=['p'], answer=['#### 3'])[0])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1.0"
