"""Image rewards: OCR on rendered text (real RapidOCR), JPEG sizes and the brightness demo reward."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw, ImageFont

pytest.importorskip("rapidocr", reason="the ocr reward's engine (pip install rapidocr onnxruntime)")
from unirl.rewards.image import brightness, jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb
from unirl.rewards.ocr import ocr, ocr_similarity, quoted_text
from unirl.rewards.registry import load_reward
from conftest import shared_data


def render(text: str) -> Image.Image:
    """Black text on white, large enough for the OCR models."""
    font = ImageFont.load_default(size=40)
    width = int(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(text, font=font)) + 40
    image = Image.new("RGB", (max(width, 64), 96), "white")
    ImageDraw.Draw(image).text((20, 24), text, fill="black", font=font)
    return image


@pytest.fixture(scope="module")
def ocr_prompts() -> list[str]:
    lines = shared_data("ocr", "test.txt").read_text().splitlines()
    # Six prompts with short-to-medium quoted texts, spread over the file.
    picked = [p for p in lines[::37] if quoted_text(p) and 4 <= len(quoted_text(p)) <= 24][:6]
    assert len(picked) == 6
    return picked


def test_ocr_scores_rendered_quoted_text_high_and_other_prompts_low(ocr_prompts):
    images = [render(quoted_text(p)) for p in ocr_prompts]
    own = ocr(images, prompts=ocr_prompts)
    assert min(own) >= 0.9, list(zip(ocr_prompts, own))
    shifted = ocr_prompts[1:] + ocr_prompts[:1]  # each image scored against another prompt's text
    other = ocr(images, prompts=shifted)
    assert max(other) <= 0.6, list(zip(shifted, other))
    assert sum(own) / len(own) - sum(other) / len(other) >= 0.5


def test_ocr_blank_image_scores_zero_and_unquoted_prompt_does_not_apply():
    blank = Image.new("RGB", (128, 64), "white")
    assert ocr([blank, blank], prompts=['a sign saying "Hello"', "no quoted text"]) == [0.0, None]


@pytest.mark.parametrize("target, read, expected", [
    ("Open 24 Hours", "open24hours", 1.0),  # case and spaces ignored
    ("Sale", "BIG SALE TODAY", 1.0),  # contained
    ("abcd", "abxd", 0.75),  # one substitution in 4 characters
    ("abcd", "zzzzzzzzzz", 0.0),  # distance 10 capped at len 4
    ("ab", "", 0.0),  # nothing recognised
])
def test_ocr_similarity_by_hand(target, read, expected):
    assert ocr_similarity(target, read) == pytest.approx(expected, abs=1e-12)


def test_brightness_is_the_mean_pixel_value():
    # (255, 0, 0) and (0, 0, 255) halves: mean over all channels = (255 / 3) / 255 = 1/3.
    half = Image.new("RGB", (4, 2), (255, 0, 0))
    half.paste((0, 0, 255), (0, 0, 2, 2))
    gray = Image.new("RGB", (3, 3), (51, 51, 51))  # 51 / 255 = 0.2
    assert brightness([half, gray]) == pytest.approx([1 / 3, 0.2], abs=1e-12)


def test_jpeg_rewards_are_plus_and_minus_the_kilobytes():
    flat = Image.new("RGB", (64, 64), (120, 130, 140))
    noisy = Image.effect_noise((64, 64), 80).convert("RGB")
    sizes = [jpeg_size_kb(flat), jpeg_size_kb(noisy)]
    assert jpeg_incompressibility([flat, noisy]) == sizes
    assert jpeg_compressibility([flat, noisy]) == [-s for s in sizes]
    assert sizes[0] < 1.0 < 2.0 < sizes[1]  # a flat 64x64 is under 1 kB, noise several kB


def test_image_rewards_are_registered():
    for name in ("ocr", "brightness", "jpeg_compressibility", "jpeg_incompressibility"):
        assert callable(load_reward(name))


# ------------------------------------------------------------------ bad input image files (issue 37 item 9)
def _bomb_png(path):
    """A 1x1 PNG whose header claims 100000 x 100000 pixels (with the header's checksum fixed)."""
    import io
    import struct
    import zlib

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", 100_000, 100_000)  # IHDR's width and height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))
    return path


def _truncated_png(path):
    import io

    import numpy as np

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def test_a_bomb_or_truncated_input_image_is_one_error_naming_the_file(tmp_path):
    from unirl.rewards.image import input_images, input_similarity

    bomb, cut = _bomb_png(tmp_path / "bomb.png"), _truncated_png(tmp_path / "cut.png")
    with pytest.raises(ValueError, match=r"image file .*bomb\.png: Image size \(10000000000 pixels\) exceeds limit"):
        input_images([str(bomb)])
    with pytest.raises(ValueError, match=r"image file .*cut\.png is truncated or corrupt"):
        input_similarity([Image.new("RGB", (4, 4))], image=[str(cut)])
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"image file .*text\.png is not an image"):
        input_images([str(tmp_path / "text.png")])


def test_loading_and_the_dry_run_check_the_input_images_decode_not_only_exist(tmp_path):
    import json

    from unirl.diffusion.prompts import load_prompt_rows

    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    _bomb_png(tmp_path / "bomb.png")
    _truncated_png(tmp_path / "cut.png")
    for bad, what in (("bomb.png", "10000000000 pixels"), ("cut.png", "truncated or corrupt")):
        prompts = tmp_path / f"edits_{bad}.jsonl"
        prompts.write_text(json.dumps({"prompt": "a", "image": "ok.png"}) + "\n" + json.dumps({"prompt": "b", "image": bad}) + "\n")
        with pytest.raises(ValueError, match=rf"{prompts.name}, row 2: image file .*{bad}.*{what}"):
            load_prompt_rows(str(prompts), "train", image=True)
