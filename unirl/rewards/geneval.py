"""GenEval (Ghosh et al., 2023, https://arxiv.org/abs/2310.11513): does the image hold the objects, counts,
colours and positions its prompt asks for? Scored by GenEval's rules on an object detector's output.

Each prompt row of ``unirl://geneval/test_metadata.jsonl`` carries its requirements as columns: ``tag``
(``single_object``, ``two_object``, ``counting``, ``colors``, ``position``, ``color_attr``), ``include``
(clauses that must all hold: ``{"class", "count"}``, optionally ``"color"`` and ``"position": [relation,
index of an earlier include clause]``) and ``exclude`` (clauses of which none may hold). The rules, as
GenEval's ``evaluation/evaluate_images.py`` defines them (its defaults in brackets):

1. Detections: per class, those scoring above the confidence threshold [0.3; 0.9 for ``counting``
   prompts], most confident first, at most ``max_objects`` [16]; overlapping ones are dropped when
   their IoU with a kept one reaches ``max_overlap`` [1.0: never].
2. An include clause needs ``count`` detections of its class; only its ``count`` most confident ones
   are looked at further. ``color``: at least ``count`` of those must be classified that colour.
   ``position``: each of them must stand in ``relation`` (``left of``, ``right of``, ``above``,
   ``below``) to each object of the clause it names, which must itself have been met.
3. An exclude clause fails when its class has ``count`` detections or more.
4. Relative position of A to B: the offset of the box centres, each axis shrunk towards 0 by
   ``position_threshold`` [0.1] times the sum of the boxes' sizes on that axis; no relation when both
   shrink to 0; otherwise, divided by the unshrunk offset's length, below -0.5 on x is ``left of``,
   above 0.5 ``right of``, and on y (image rows grow downwards) ``above`` / ``below``.

The image is correct when every clause holds (GenEval's score: the share of correct images per tag).
``mode: strict`` rewards that (1 or 0); ``mode: partial`` rewards the share of clauses that hold,
a denser signal for RL (FlowGRPO also trains GenEval on a partial score; this share is unirl's).

The rules are ``unirl/rewards/geneval_rules.py``. The detector sits behind ``Detector``: ``detect(image) ->
[Detection]`` and ``colours(image, detections, classname) -> [colour]``. The default is
``unirl/rewards/geneval_detector.py``.
"""

from __future__ import annotations

from typing import Any, Sequence

from unirl.rewards.geneval_rules import (COLOURS, RELATIONS, Detection, Detector, Rules, check, iou, kept_detections,
                                         relations)
from unirl.rewards.models import ModelReward
from unirl.rewards.registry import RewardError, ScoresWithText, register_reward

__all__ = ["COLOURS", "RELATIONS", "Detection", "Detector", "GenEval", "Rules", "check", "iou", "kept_detections",
           "relations"]

@register_reward("geneval", modality="image")
class GenEval(ModelReward):
    """GenEval's rules (objects, counts, colours, positions) on an object detector's output: 1 if all hold."""

    def __init__(self, *, mode: str = "strict", model: str = "facebook/mask2former-swin-small-coco-instance",
                 clip_model: str = "openai/clip-vit-large-patch14", threshold: float = 0.3,
                 counting_threshold: float = 0.9, max_objects: int = 16, max_overlap: float = 1.0,
                 position_threshold: float = 0.1, detector: Detector | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if mode not in ("strict", "partial"):
            raise RewardError(f"geneval: mode must be 'strict' or 'partial', got {mode!r}")
        self.mode, self.model, self.clip_model = mode, model, clip_model
        self.rules = Rules(threshold, counting_threshold, max_objects, max_overlap, position_threshold)
        self.detector = detector

    def load(self) -> None:
        if self.detector is None:
            from unirl.rewards.geneval_detector import Mask2FormerDetector

            self.detector = Mask2FormerDetector(self.model, self.clip_model, device=self.device, dtype=self.torch_dtype)

    def score(self, samples: Sequence[Any], *, prompts: Sequence[str], tag: Sequence[str] | None = None,
              include: Sequence[list] | None = None, exclude: Sequence[list | None] | None = None,
              **columns: Any) -> ScoresWithText:
        if tag is None or include is None:
            raise RewardError("geneval needs the prompt rows' 'tag' and 'include' columns "
                              "(data.train: unirl://geneval/test_metadata.jsonl, or rows of that form)")
        exclude = exclude if exclude is not None else [None] * len(samples)
        scores, reasons = [], []
        for image, t, inc, exc in zip(samples, tag, include, exclude):
            met, total, why = check(image, self.detector.detect(image), t, inc, exc, self.detector, self.rules)
            scores.append(float(met == total) if self.mode == "strict" else met / total)
            reasons.append("; ".join(why) or "correct")
        return ScoresWithText(scores, reasons)
