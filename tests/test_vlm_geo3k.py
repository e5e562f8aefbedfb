"""verl's Geometry3K recipe (configs/text/geo3k.yaml): hiyouga/geometry3k's parquet rows with their figures, the
geo3k adapter's prompt, and the boxed-answer reward (issue 35)."""

from __future__ import annotations

import pytest
from PIL import Image

from unirl.rewards.geo3k import boxed_content, geo3k
from unirl.text.data import GEO3K_INSTRUCTION


def _geometry3k_parquet(path, rows):
    """A parquet file in hiyouga/geometry3k's schema (``images``: a list of images, ``problem``, ``answer``)."""
    import datasets

    features = datasets.Features({"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))


def _env(tmp_path, train):
    from unirl.cli import load_run_config
    from unirl.text import build_environment
    from unirl.text.tiny_vlm import build_tiny_vlm

    cfg = load_run_config("text", "geo3k", ["model.name_or_path=tiny_vlm", f"data.train={train}", f"data.test={train}",
                                            "data.max_prompt_length=4096"], output_dir=str(tmp_path / "run"))
    env = build_environment(cfg)  # a VLMEnvironment; what setup does before loading the weights
    env.model_path = str(build_tiny_vlm())
    env.load_processor()
    env.tokenizer = env.processor.tokenizer
    return env


def test_geometry3k_parquet_rows_load_with_their_figures_and_verls_prompt(tmp_path):
    train = tmp_path / "train.parquet"
    figures = [Image.new("RGB", (60, 40), (255, 0, 0)), Image.new("RGB", (30, 30), (0, 0, 255))]
    _geometry3k_parquet(train, [
        {"images": [figures[0]], "problem": "<image>Find x. Round to the nearest tenth.", "answer": "3.5"},
        {"images": [figures[1]], "problem": "<image>Find the area of the figure.", "answer": "\\frac{3}{2}"},
    ])
    env = _env(tmp_path, train)
    rows = env._rows(str(train), "train", "train")
    # verl's geo3k.py: problem + " " + instruction; the <image> mark gives way to the template's image place.
    assert [r["prompt"] for r in rows] == [f"Find x. Round to the nearest tenth. {GEO3K_INSTRUCTION}",
                                           f"Find the area of the figure. {GEO3K_INSTRUCTION}"]
    assert [r["answer"] for r in rows] == ["3.5", "\\frac{3}{2}"]
    assert [[im.size for im in r["images"]] for r in rows] == [[(60, 40)], [(30, 30)]]
    assert rows[1]["images"][0].open().getpixel((0, 0)) == (0, 0, 255)  # checked at load, decoded when used
    ids = env.encode_prompt(rows[0], 0)
    assert len(ids.images) == 1 and ids.count(env.processor.image_token_id) == 6  # 60x40 -> 84x56 (aspect kept): 3x2 tokens


def test_a_geometry3k_row_without_its_figure_is_named(tmp_path):
    train = tmp_path / "train.parquet"
    _geometry3k_parquet(train, [{"images": [Image.new("RGB", (8, 8))], "problem": "<image>a", "answer": "1"},
                                {"images": [], "problem": "<image>b", "answer": "2"}])
    with pytest.raises(ValueError, match=r"row 1 has no 'images'.*data.adapter=geo3k"):
        _env(tmp_path, train)._rows(str(train), "train", "train")


def test_geo3k_reward_is_verls_formula():
    """verl's compute_score: 0.9 * (last boxed answer right) + 0.1 * (fullmatch <think>.*</think>.*\\boxed{.*}.*)."""
    samples = [
        "<think>area is half</think> The answer is \\boxed{\\frac{3}{2}}.",  # right, formatted: 0.9 + 0.1
        "<think>x</think>\n\\boxed{1.5}",  # the same number written otherwise (math-verify): 1.0
        "\\boxed{\\dfrac{3}{2}}",  # right, no think block: 0.9
        "<think>x</think> \\boxed{2} then \\boxed{4}",  # the last box counts, wrong: 0.1
        "<think>x</think> the answer is 3/2",  # no box: format fails too (verl's pattern needs \\boxed{})
        "<think>unclosed \\boxed{3",  # unbalanced box: no answer
    ]
    scores = geo3k(samples, answer=["\\frac{3}{2}"] * len(samples))
    assert scores == pytest.approx([1.0, 1.0, 0.9, 0.1, 0.0, 0.0])
    assert geo3k(["\\boxed{2\\sqrt 3}", "\\boxed{60^\\circ}"], answer=["2\\sqrt{3}", "60"], format_score=0.0) == [1.0, 1.0]
    assert boxed_content("\\boxed{\\frac{1}{\\sqrt{2}}} end") == "\\frac{1}{\\sqrt{2}}"
