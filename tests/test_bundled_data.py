"""Bundled prompt sets (``unirl://``), generated OCR prompts, ``unirl data``, and the package layout
that ships them (and the configs) in a plain, non-editable install."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, SHARED_DATA
from unirl.cli import main
from unirl.data.paths import (
    BUNDLED_DIR, DataFileNotFoundError, bundled_files, generated_prompts, is_generated, local_path, locate,
)
from unirl.data.ocr_prompts import generate

# Row counts by hand: `python -c "print(len(open(f).read().splitlines()))"` on each file (the OCR
# and GenEval files end without a newline, so `wc -l` says one less).
EXPECTED = {"geneval/test_metadata.jsonl": 2212, "ocr/test.txt": 1018, "pickscore/test.txt": 2048,
            "pickscore/train.txt": 25432}


def _test_prompts() -> set[str]:
    return set((BUNDLED_DIR / "ocr" / "test.txt").read_text(encoding="utf-8").splitlines())


def test_bundled_files_rows_and_licences():
    assert {b.name: b.rows for b in bundled_files()} == EXPECTED
    for b in bundled_files():
        assert b.spec == f"unirl://{b.name}" and local_path(b.spec) == b.path
        assert (b.path.parent / "LICENSE").read_text().startswith("MIT License"), b.name
    readme = (BUNDLED_DIR / "README.md").read_text()
    for name, rows in EXPECTED.items():
        assert f"`unirl://{name}` | {rows:,} |" in readme, name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_files_are_copies_of_the_reference_data(name):
    reference = SHARED_DATA / name
    if not reference.exists():
        pytest.skip(f"{reference} is absent (the shared data sits beside the repository in CI)")
    assert (BUNDLED_DIR / name).read_bytes() == reference.read_bytes()


def test_unknown_bundled_name_lists_the_bundled_ones():
    with pytest.raises(DataFileNotFoundError, match=r"unirl://ocr/tset.txt is not bundled.*unirl://ocr/test.txt"):
        local_path("unirl://ocr/tset.txt")
    with pytest.raises(DataFileNotFoundError, match="not bundled"):
        local_path("unirl://../config.py")
    assert local_path("~/x.txt") == Path.home() / "x.txt"


def test_locate_names_every_place_it_looked(tmp_path, monkeypatch):
    work, conf = tmp_path / "work", tmp_path / "conf"
    work.mkdir(), conf.mkdir()
    monkeypatch.chdir(work)
    missing = locate("p/x.txt", conf)
    assert missing.path is None
    assert missing.message("data.train") == (
        f"data.train: 'p/x.txt' not found; looked at: {work / 'p/x.txt'} (working directory), "
        f"{conf / 'p/x.txt'} (beside the config file)"
    )
    (conf / "p").mkdir()
    (conf / "p" / "x.txt").write_text("a\n")
    assert locate("p/x.txt", conf).path == conf / "p" / "x.txt"
    (work / "p").mkdir()
    (work / "p" / "x.txt").write_text("b\n")
    assert locate("p/x.txt", conf).path == work / "p" / "x.txt"  # the working directory first
    assert locate(str(conf / "p" / "x.txt"), None).tried == ((conf / "p" / "x.txt", "absolute path"),)


def test_generated_ocr_prompts_follow_the_test_form():
    prompts = generated_prompts("unirl://ocr/generated")  # the defaults: n=20000, seed=0
    assert len(prompts) == 20000 and len(set(prompts)) == 20000
    assert not set(prompts) & _test_prompts()
    texts = []
    for p in prompts:
        assert p.count('"') == 2, p  # one quoted text, read by unirl/rewards/ocr.py as split('"')[1]
        texts.append(p.split('"')[1])
    words = [len(t.split()) for t in texts]
    assert min(words) == 1 and max(words) == 6
    # Mostly 2 to 4 words, as in the test set (~90% there); varied words and lengths.
    assert sum(2 <= w <= 4 for w in words) / len(words) > 0.8
    assert len(set(texts)) > 5000
    lengths = [len(p.split()) for p in prompts]
    assert min(lengths) >= 10 and max(lengths) - min(lengths) >= 15


def test_generated_prompts_are_seeded_and_parameterised():
    a = generated_prompts("unirl://ocr/generated?n=50&seed=3")
    assert a == generated_prompts("unirl://ocr/generated?seed=3&n=50") == generate(50, 3, exclude=_test_prompts())
    assert a != generated_prompts("unirl://ocr/generated?n=50&seed=4")
    assert a[:10] == generated_prompts("unirl://ocr/generated?n=10&seed=3")  # a prefix of a longer list
    assert is_generated("unirl://ocr/generated?n=5") and not is_generated("unirl://ocr/test.txt")
    with pytest.raises(ValueError, match="unknown parameter.*count.*takes n, seed"):
        generated_prompts("unirl://ocr/generated?count=5")
    with pytest.raises(ValueError, match="n must be an integer, got 'many'"):
        generated_prompts("unirl://ocr/generated?n=many")
    with pytest.raises(ValueError, match="must be >= 1"):
        generated_prompts("unirl://ocr/generated?n=0")


def test_loaders_read_bundled_and_generated_sources():
    from unirl.diffusion.prompts import load_prompt_rows
    from unirl.text.data import load_rows

    rows = load_prompt_rows("unirl://ocr/test.txt", "test")
    assert len(rows) == 1018 and rows[0]["prompt"].startswith("A high-fashion runway")
    assert [r["prompt"] for r in load_prompt_rows("unirl://ocr/generated?n=7&seed=1", "train")] == \
        generated_prompts("unirl://ocr/generated?n=7&seed=1")
    geneval = load_prompt_rows("unirl://geneval/test_metadata.jsonl", "test")  # columns beside the prompt
    assert len(geneval) == 2212 and geneval[0]["prompt"] == "a photo of two wine glasses"
    assert geneval[0]["include"] == [{"class": "wine glass", "count": 2}]
    assert load_rows("unirl://geneval/test_metadata.jsonl")[1]["tag"] == "color_attr"
    with pytest.raises(DataFileNotFoundError, match=r"prompt file \(train\): 'nope/train.txt' not found; looked at: .*nope/train.txt \(working directory\)"):
        load_prompt_rows("nope/train.txt", "train")


def test_unirl_data_list_and_cat(capsys):
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"unirl://ocr/test.txt\s+1018\s", out)
    assert re.search(r"unirl://pickscore/test.txt\s+2048\s", out)
    assert "unirl://ocr/generated?n=20000&seed=0" in out and "README.md" in out
    assert main(["data", "cat", "unirl://ocr/test.txt", "--head", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == (BUNDLED_DIR / "ocr/test.txt").read_text().splitlines()[:2]
    assert main(["data", "cat", "unirl://ocr/generated?n=3&seed=2"]) == 0
    assert capsys.readouterr().out.splitlines() == generated_prompts("unirl://ocr/generated?n=3&seed=2")
    assert main(["data", "cat", "unirl://nothing.txt"]) == 2
    assert "not bundled" in capsys.readouterr().err


@pytest.mark.slow
def test_a_plain_install_ships_the_configs_and_the_prompt_sets(tmp_path):
    """Build the wheel a non-editable ``pip install`` would install and look inside it."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info", "__pycache__", "tests"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("unirl_toolkit-*.whl")  # the distribution name (pyproject.toml)
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.relative_to(REPO / "configs").as_posix() for p in (REPO / "configs").rglob("*.yaml")}
    assert {"diffusion/sd3_ocr.yaml", "text/gsm8k.yaml"} <= configs
    for config in configs:
        assert f"unirl/configs/{config}" in names, config
    # The rewards ship inside the package (unirl.rewards), never as a top-level `rewards` package.
    assert "unirl/rewards/registry.py" in names and not any(n.startswith("rewards/") for n in names)
    for name in [*EXPECTED, "README.md", "ocr/LICENSE", "pickscore/LICENSE", "geneval/LICENSE"]:
        assert f"unirl/data/{name}" in names, name
