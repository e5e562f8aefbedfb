"""A VLM's pictures (issue 51): every bad picture is one line naming its row, in the dry run and the run;
pictures larger than ``data.max_image_pixels`` are refused; rows keep their pictures' sources, not their
decoded pixels, and a batch gets them decoded."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import pytest
from conftest import text_env
from PIL import Image

from unirl.cli import main
from unirl.text.vlm import Picture, row_pictures


def _png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` pixels (its data is one row's worth)."""
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr:ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13:ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4:ihdr + 13])))
    return bytes(data)


def _write_picture(folder: Path, kind: str):
    """Row 1's ``images`` value for each kind of bad picture (files written into ``folder``)."""
    good = folder / "good.png"
    Image.new("RGB", (56, 56), "blue").save(good)
    if kind == "missing":
        return ["nope.png"]
    if kind == "truncated":
        (folder / "cut.png").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
        return ["cut.png"]
    if kind == "not_an_image":
        (folder / "notes.png").write_text("these are my notes, not a picture\n")
        return ["notes.png"]
    if kind == "bomb":
        (folder / "bomb.png").write_bytes(_png_claiming(100_000, 100_000))
        return ["bomb.png"]
    if kind == "100_megapixels":
        (folder / "huge.png").write_bytes(_png_claiming(10_000, 10_000))
        return ["huge.png"]
    if kind == "a_number":
        return 7
    if kind == "thin":
        Image.new("RGB", (2000, 4), "green").save(folder / "thin.png")
        return ["thin.png"]
    raise AssertionError(kind)


def _rows_file(folder: Path, kind: str) -> Path:
    Image.new("RGB", (56, 56), "red").save(folder / "ok.png")
    rows = [{"question": "count?", "answer": "#### 1", "images": ["ok.png"]},
            {"question": "count?", "answer": "#### 2", "images": _write_picture(folder, kind)}]
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


EXPECTED = {
    "missing": r"image file '.*nope\.png' does not exist",
    "truncated": r"'.*cut\.png' is not a readable image",
    "not_an_image": r"'.*notes\.png' is not a readable image \(cannot identify image file",
    "bomb": r"'.*bomb\.png': its header claims a decompression bomb \(Image size \(10000000000 pixels\) exceeds limit.*"
            r"data\.max_image_pixels=50000000 is the largest picture a run takes",
    "100_megapixels": r"'.*huge\.png' is 10000x10000 = 100 megapixels, over data\.max_image_pixels=50000000",
    "a_number": r"expected an image path, a PIL\.Image, bytes or a \{'bytes', 'path'\} dict, got int 7",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_the_dry_run_names_each_bad_picture_by_its_row(tmp_path, capsys, kind):
    rows = _rows_file(tmp_path, kind)
    code = main(["train", "text", "--config", "tiny_vlm", "--dry-run", f"data.train={rows}", "data.test=null",
                 f"output_dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    problems = [line for line in out.splitlines() if line.startswith("# PROBLEM")]
    assert code == 2 and len(problems) == 1, out + err
    assert "Traceback" not in out + err
    pattern = rf"# PROBLEM data\.train: .*rows\.jsonl: .*rows\.jsonl:2 \(row 1\): images\[0\]: {EXPECTED[kind]}"
    assert any(__import__("re").search(pattern, p) for p in problems), problems


def test_a_picture_the_processor_refuses_is_one_line_naming_its_row(tmp_path, capsys):
    """A 2000x4 picture passes the dry run (no processor is loaded there); the run stops at load, named."""
    rows = _rows_file(tmp_path, "thin")
    code = main(["train", "text", "--config", "tiny_vlm", f"data.train={rows}", "data.test=null",
                 f"output_dir={tmp_path / 'run'}", "trainer.total_steps=1"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("unirl: ")][-1]
    assert "rows.jsonl:2 (row 1): images[0]: a 2000x4 picture the model's image processor refuses: " in line, line
    assert "aspect ratio" in line


def test_the_limit_is_a_setting(tmp_path):
    (tmp_path / "p.png").write_bytes(_png_claiming(10_000, 10_000))
    with pytest.raises(ValueError, match=r"10000x10000 = 100 megapixels, over data.max_image_pixels=99999999"):
        row_pictures({"images": ["p.png"]}, 0, base_dir=tmp_path, max_pixels=99_999_999)
    Image.new("RGB", (300, 200)).save(tmp_path / "q.png")
    with pytest.raises(ValueError, match=r"row 0: images\[0\]: .* is 300x200 = 0 megapixels, over data.max_image_pixels=50000"):
        row_pictures({"images": ["q.png"]}, 0, base_dir=tmp_path, max_pixels=50_000)
    assert row_pictures({"images": ["q.png"]}, 0, base_dir=tmp_path, max_pixels=None)[0].size == (300, 200)


def test_rows_keep_their_pictures_sources_and_a_batch_gets_them_decoded(tmp_path):
    """No row holds decoded pixels for the run (two 6000x6000 rows held 108 MB each, train and test); the
    rollout and the held-out evaluation decode the pictures they use, and rewards receive PIL images."""
    folder = tmp_path / "data"
    folder.mkdir()
    rows = _rows_file(folder, "truncated")
    rows.write_text(rows.read_text().splitlines()[0] + "\n" + rows.read_text().splitlines()[0].replace("#### 1", "#### 2")
                    + "\n")
    env = text_env(tmp_path, "model.name_or_path=tiny_vlm", f"data.train={rows}", f"data.test={rows}",
                   "rollout.max_new_tokens=4", "data.max_prompt_length=64")
    pictures = [p for row in env.train_rows + env.test_rows for p in row["images"]]
    assert pictures and all(isinstance(p, Picture) for p in pictures)
    assert all(p.size == (56, 56) and p.source == folder / "ok.png" for p in pictures)
    batch = env.sampler.rollout(env.train_rows, group_size=2)  # the environment's sampler (VLMSampler)
    assert all(isinstance(images[0], Image.Image) for images in batch.columns["images"])
    assert batch.columns["images"][0][0].getpixel((0, 0)) == (255, 0, 0)
    assert all(isinstance(p, Picture) for row in env.train_rows for p in row["images"])  # the rows are unchanged
    assert all(isinstance(p, Image.Image) for row in env.with_pictures(env.test_rows) for p in row["images"])


def test_settings_a_vlm_does_not_support_are_refused_by_the_dry_run_and_before_loading(tmp_path, capsys):
    """``tiny_vlm trainer.strategy=fsdp2`` passed load and the dry run and stopped at the first rollout with a
    110-line DTensor traceback; now each unsupported setting is a line of the dry run and the run's one error."""
    code = main(["train", "text", "--config", "tiny_vlm", "--dry-run", "trainer.strategy=fsdp2", "rollout.engine=vllm",
                 f"output_dir={tmp_path / 'run'}"])
    out, _ = capsys.readouterr()
    problems = [line for line in out.splitlines() if line.startswith("# PROBLEM")]
    assert code == 2 and len(problems) == 2, out
    assert "trainer.strategy=fsdp2: a vision-language policy (tiny_vlm) trains with trainer.strategy=ddp only" in problems[1]
    assert "rollout.engine=vllm: vision-language policies sample with the transformers engine only" in problems[0]
    code = main(["train", "text", "--config", "tiny_vlm", "trainer.strategy=fsdp2", f"output_dir={tmp_path / 'run'}"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and "trainer.strategy=fsdp2: a vision-language policy" in err, err[-2000:]
