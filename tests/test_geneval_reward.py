"""GenEval's rules, case by case, on a stand-in detector built here (no detection model is loaded).

Each case follows a rule of GenEval's ``evaluation/evaluate_images.py`` (restated in
``unirl/rewards/geneval.py``): confidence thresholds (0.3; 0.9 for counting), the ``count`` most confident
objects, colours of those only, positions against the earlier clause's objects, exclusions. The
relative-position rule is also checked against the formula re-typed here with numpy over random boxes.
"""

from __future__ import annotations

import numpy as np
import pytest

from unirl.rewards.geneval import GenEval, Detection, Rules, check, iou, kept_detections, relations
from unirl.diffusion.prompts import load_prompt_rows


class Scene:
    """A stand-in ``Detector``: fixed detections; each one's colour looked up by its box."""

    def __init__(self, *objects: tuple[str, float, tuple, str]):
        self.objects = [Detection(label, score, box) for label, score, box, _ in objects]
        self.colour_of = {box: colour for _, _, box, colour in objects}
        self.asked: list[tuple[str, int]] = []

    def detect(self, image):
        return list(self.objects)

    def colours(self, image, detections, classname):
        self.asked.append((classname, len(detections)))
        return [self.colour_of[d.box] for d in detections]


def verdict(scene: Scene, tag: str, include: list, exclude: list | None = None, rules: Rules = Rules()):
    met, total, reasons = check(None, scene.detect(None), tag, include, exclude, scene, rules)
    return met == total, reasons


BOX = (10, 10, 30, 30)


@pytest.mark.parametrize("score, correct", [(0.31, True), (0.3, False), (0.1, False)])
def test_single_object_needs_a_detection_above_the_threshold(score, correct):
    ok, reasons = verdict(Scene(("cat", score, BOX, "red")), "single_object", [{"class": "cat", "count": 1}])
    assert ok == correct and (reasons == [] if correct else reasons == ["expected cat>=1, found 0"])


def test_two_objects_need_both():
    include = [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]
    assert verdict(Scene(("cat", 0.9, BOX, ""), ("dog", 0.5, (40, 10, 60, 30), "")), "two_object", include)[0]
    assert verdict(Scene(("cat", 0.9, BOX, "")), "two_object", include) == (False, ["expected dog>=1, found 0"])


def test_counting_uses_its_own_threshold_and_the_exclusion():
    include, exclude = [{"class": "cup", "count": 2}], [{"class": "cup", "count": 3}]
    boxes = [(10 * i, 0, 10 * i + 8, 8) for i in range(3)]
    two = Scene(("cup", 0.95, boxes[0], ""), ("cup", 0.92, boxes[1], ""))
    assert verdict(two, "counting", include, exclude) == (True, [])
    # A third cup at 0.85 is not counted (0.85 <= 0.9), so it breaks no exclusion ...
    assert verdict(Scene(*[(("cup", s, b, "")) for s, b in zip((0.95, 0.92, 0.85), boxes)]), "counting", include, exclude)[0]
    # ... a third at 0.95 is: two are needed, three are too many.
    three = Scene(*[("cup", 0.95, b, "") for b in boxes])
    assert verdict(three, "counting", include, exclude) == (False, ["expected cup<3, found 3"])
    # One confident cup and one at 0.8: two cups for any other tag, one for counting.
    mixed = Scene(("cup", 0.95, boxes[0], ""), ("cup", 0.8, boxes[1], ""))
    assert verdict(mixed, "counting", include) == (False, ["expected cup>=2, found 1"])
    assert verdict(mixed, "two_object", include)[0]


def test_colours_are_read_from_the_count_most_confident_objects_only():
    include = [{"class": "car", "count": 1, "color": "red"}]
    assert verdict(Scene(("car", 0.9, BOX, "red")), "colors", include) == (True, [])
    scene = Scene(("car", 0.9, BOX, "blue"), ("car", 0.6, (40, 10, 60, 30), "red"))
    assert verdict(scene, "colors", include) == (False, ["expected red car>=1, found 0 red (blue)"])
    assert scene.asked == [("car", 1)]  # the red one, second in confidence, was never looked at


def test_colour_attribution_needs_each_object_in_its_colour():
    include = [{"class": "handbag", "count": 1, "color": "pink"}, {"class": "scissors", "count": 1, "color": "black"}]
    right = Scene(("handbag", 0.8, BOX, "pink"), ("scissors", 0.7, (40, 10, 60, 30), "black"))
    swapped = Scene(("handbag", 0.8, BOX, "black"), ("scissors", 0.7, (40, 10, 60, 30), "pink"))
    assert verdict(right, "color_attr", include)[0] and not verdict(swapped, "color_attr", include)[0]


POSITION = [{"class": "laptop", "count": 1}, {"class": "cow", "count": 1, "position": ["right of", 0]}]


@pytest.mark.parametrize("cow, expected", [
    ((60, 10, 80, 30), (True, [])),  # beside it, to the right
    ((0, 10, 20, 30), (False, ["expected cow right of target, found left of"])),
    ((23, 10, 43, 30), (False, ["expected cow right of target, found no relation"])),  # 3 px off: within 0.1 x the widths
    ((60, 60, 80, 80), (True, [])),  # down and right: both relations hold (0.56 and 0.72 > 0.5)
    ((35, 200, 55, 220), (False, ["expected cow right of target, found below"])),  # mostly below
])
def test_position_is_relative_to_the_earlier_clause(cow, expected):
    scene = Scene(("laptop", 0.9, (20, 10, 40, 30), ""), ("cow", 0.9, cow, ""))
    assert verdict(scene, "position", POSITION) == expected


def test_position_without_its_target_fails_both_clauses():
    assert verdict(Scene(("cow", 0.9, BOX, "")), "position", POSITION) == (
        False, ["expected laptop>=1, found 0", "no target for cow to be right of"])


def test_iou_counts_pixels_inclusively_and_overlap_suppression_is_off_by_default():
    assert iou((0, 0, 9, 9), (5, 5, 14, 14)) == pytest.approx(25 / 175)  # 10x10 boxes sharing 5x5 pixels
    twins = [Detection("dog", 0.9, (0, 0, 9, 9)), Detection("dog", 0.8, (1, 0, 10, 9)), Detection("dog", 0.7, (50, 50, 60, 60))]
    assert "dog" not in kept_detections(twins, "counting")  # 0.9 is not above the counting threshold 0.9
    assert len(kept_detections(twins, "two_object")["dog"]) == 3
    assert [d.score for d in kept_detections(twins, "two_object", Rules(max_overlap=0.5))["dog"]] == [0.9, 0.7]
    many = [Detection("dog", 0.5 + i / 100, (i, i, i + 1, i + 1)) for i in range(20)]
    assert [d.score for d in kept_detections(many, "single_object")["dog"]] == [0.5 + i / 100 for i in range(19, 3, -1)]


def test_relations_equal_the_formula_retyped_with_numpy():
    def reference(a, b, threshold=0.1):
        boxes = np.array([a, b], dtype=float).reshape(2, 2, 2)  # [box, corner, xy]
        centre_a, centre_b = boxes.mean(axis=1)
        size_a, size_b = np.abs(boxes[:, 1] - boxes[:, 0])
        offset = centre_a - centre_b
        shrunk = np.maximum(np.abs(offset) - threshold * (size_a + size_b), 0) * np.sign(offset)
        if np.all(np.abs(shrunk) < 1e-3):
            return set()
        dx, dy = shrunk / np.linalg.norm(offset)
        return {name for name, hit in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5),
                                       ("below", dy > 0.5)) if hit}

    for seed in range(5):
        rng = np.random.default_rng(seed)
        for _ in range(200):
            corners = rng.uniform(0, 100, (2, 2, 2))
            a, b = (tuple(np.concatenate([c.min(0), c.max(0)])) for c in corners)
            assert relations(a, b) == reference(a, b), (seed, a, b)


def _satisfying_scene(row: dict) -> Scene:
    """Detections meeting every clause of a GenEval row: ``count`` confident objects per include clause,
    in its colour, placed in its relation to the clause it names."""
    shift = {"left of": (-100, 0), "right of": (100, 0), "above": (0, -100), "below": (0, 100)}
    objects, origin = [], []
    for k, clause in enumerate(row["include"]):
        x, y = (0.0, 0.0)
        if "position" in clause:
            relation, target = clause["position"]
            x, y = origin[target][0] + shift[relation][0], origin[target][1] + shift[relation][1]
        origin.append((x, y))
        for i in range(clause["count"]):  # side by side, 12 px apart: distinct boxes
            box = (x + 1000 * k + 12 * i, y, x + 1000 * k + 12 * i + 10, y + 10) if "position" not in row["tag"] else (x + 3 * i, y, x + 3 * i + 10, y + 10)
            objects.append((clause["class"], 0.95, box, clause.get("color", "")))
    return Scene(*objects)


def test_the_reward_scores_every_bundled_geneval_row():
    """Over all of ``unirl://geneval/test_metadata.jsonl``: a scene meeting the row scores 1 (partial 1);
    without the last include clause's most confident object it scores 0, and the share of clauses met."""
    rows = load_prompt_rows("unirl://geneval/test_metadata.jsonl", "test")
    assert len(rows) == 2212 and {r["tag"] for r in rows} == {"single_object", "two_object", "counting", "colors",
                                                                "position", "color_attr"}
    for mode in ("strict", "partial"):
        for row in rows:
            full = _satisfying_scene(row)
            short = Scene(*[(d.label, d.score, d.box, full.colour_of[d.box]) for d in full.objects[:-1]])
            scores = []
            for scene in (full, short):
                reward = GenEval(mode=mode, detector=scene)
                out = reward([None], prompts=[row["prompt"]], tag=[row["tag"]], include=[row["include"]],
                             exclude=[row.get("exclude")])
                scores.append(out[0])
            clauses = len(row["include"]) + len(row.get("exclude") or [])
            dropped_target = any(c.get("position", [None, None])[1] == len(row["include"]) - 1 for c in row["include"])
            assert scores[0] == 1.0, (row, out.texts)
            assert scores[1] == (0.0 if mode == "strict" else (clauses - 1 - dropped_target) / clauses), row


def test_the_default_detector_runs_on_a_toy_mask2former_and_clip(tmp_path):
    """The transformers path (Mask2Former instances, masks, boxes, COCO -> GenEval names, CLIP colours)
    on toy models built here from configs; the published weights are not needed to run the code."""
    import torch
    from PIL import Image
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer, Mask2FormerConfig,
                              Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor, SwinConfig)

    from unirl.rewards.geneval import COLOURS
    from unirl.rewards.geneval_detector import Mask2FormerDetector

    torch.manual_seed(0)
    swin = SwinConfig(image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=2,
                      out_features=["stage1", "stage2", "stage3", "stage4"])
    labels = {0: "mouse", 1: "cat"}
    Mask2FormerForUniversalSegmentation(Mask2FormerConfig(
        backbone_config=swin, hidden_dim=32, mask_feature_size=32, feature_size=32, num_queries=5, encoder_layers=1,
        decoder_layers=2, num_attention_heads=2, dim_feedforward=32, encoder_feedforward_dim=32, num_labels=2,
        id2label=labels, label2id={v: k for k, v in labels.items()}, common_stride=4)).save_pretrained(tmp_path / "m2f")
    Mask2FormerImageProcessor(size={"height": 64, "width": 64}).save_pretrained(tmp_path / "m2f")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char], vocab[char + "</w>"] = len(vocab), len(vocab) + 1
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=32)
    CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                           patch_size=16), projection_dim=8)).save_pretrained(tmp_path / "clip")
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=tokenizer).save_pretrained(tmp_path / "clip")

    detector = Mask2FormerDetector(str(tmp_path / "m2f"), str(tmp_path / "clip"))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    found = detector.detect(image)
    assert found and {d.label for d in found} <= {"computer mouse", "cat"}  # COCO's "mouse" under GenEval's name
    for d in found:
        x1, y1, x2, y2 = d.box
        assert d.mask.shape == (48, 64) and d.mask[int(y1):int(y2) + 1, int(x1):int(x2) + 1].sum() == d.mask.sum()
        assert 0 <= d.score <= 1
    assert set(detector.colours(image, found, "cat")) <= set(COLOURS)
    with pytest.raises(OSError, match="GenEval's detector needs 'nowhere'"):
        Mask2FormerDetector("nowhere", str(tmp_path / "clip"))
