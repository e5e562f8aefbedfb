"""GenEval's default detector for unirl: Mask2Former (COCO instances) and a CLIP colour classifier, both
loaded by transformers.

Why this model: GenEval detects with Mask2Former (Swin-S, COCO instance segmentation) through mmdet,
which unirl does not install (it pins its own torch and mmcv builds). transformers implements the
same architecture, and ``facebook/mask2former-swin-small-coco-instance`` is Swin-S trained on COCO
instances, so the classes are GenEval's (COCO's 80, three renamed below) and each object has a mask
for the colour step, as in GenEval. Differences: the weights are Facebook's release, not mmdet's;
transformers' post-processing gives each pixel to one instance, where mmdet's masks may overlap.
Colours: CLIP ViT-L/14 zero-shot over GenEval's ten colours with its three templates, on each object
pasted by its mask onto GenEval's grey (#999) background and cropped to its box.

Nothing is downloaded at run time here: ``model`` and ``clip_model`` load from a local directory or
the hub cache when present; otherwise loading fails and the reward says which model is missing.
"""

from __future__ import annotations

import numpy as np
import torch

from unirl.rewards.geneval_rules import COLOURS, Detection

#: COCO's names in transformers' label maps -> GenEval's (``object_names.txt``) where they differ.
GENEVAL_NAMES = {"keyboard": "computer keyboard", "mouse": "computer mouse", "remote": "tv remote"}

#: GenEval's colour prompts ({c}: a colour, {o}: the class name).
COLOUR_TEMPLATES = ("a photo of a {c} {o}", "a photo of a {c}-colored {o}", "a photo of a {c} object")


class Mask2FormerDetector:
    """``Detector`` (``unirl/rewards/geneval.py``) with Mask2Former instances and CLIP colours."""

    def __init__(self, model: str, clip_model: str, *, device: str = "cpu", dtype=torch.float32):
        from transformers import AutoImageProcessor, CLIPModel, CLIPProcessor, Mask2FormerForUniversalSegmentation

        self.device = device
        try:
            self.processor = AutoImageProcessor.from_pretrained(model)
            self.model = Mask2FormerForUniversalSegmentation.from_pretrained(model, dtype=dtype).to(device).eval()
            self.clip_processor = CLIPProcessor.from_pretrained(clip_model)
            self.clip = CLIPModel.from_pretrained(clip_model, dtype=dtype).to(device).eval()
        except OSError as err:
            raise OSError(f"GenEval's detector needs {model!r} and {clip_model!r} locally (a directory or the hub "
                          f"cache; nothing is downloaded here): {err}") from err
        self._classifiers: dict[str, torch.Tensor] = {}  # class name -> [colours, D] text embeddings

    @torch.no_grad()
    def detect(self, image) -> list[Detection]:
        image = image.convert("RGB")
        inputs = self.processor(images=image, return_tensors="pt").to(self.device)
        outputs = self.model(**inputs)
        # threshold 0: the rules apply GenEval's confidence thresholds themselves.
        result = self.processor.post_process_instance_segmentation(
            outputs, threshold=0.0, target_sizes=[image.size[::-1]], return_binary_maps=True)[0]
        masks = result["segmentation"]
        names = self.model.config.id2label
        found = []
        for k, info in enumerate(result["segments_info"]):
            mask = masks[k].bool().cpu().numpy()  # [H, W]
            rows, cols = np.nonzero(mask)
            if not len(rows):
                continue
            name = names[info["label_id"]]
            box = (float(cols.min()), float(rows.min()), float(cols.max()), float(rows.max()))
            found.append(Detection(GENEVAL_NAMES.get(name, name), float(info["score"]), box, mask))
        return found

    @torch.no_grad()
    def colours(self, image, detections: list[Detection], classname: str) -> list[str]:
        from PIL import Image

        image = image.convert("RGB")
        grey = Image.new("RGB", image.size, "#999")
        crops = []
        for d in detections:
            shown = image if d.mask is None else Image.composite(image, grey, Image.fromarray(d.mask.astype(np.uint8) * 255))
            crops.append(shown.crop(tuple(int(v) for v in d.box)))
        pixels = self.clip_processor(images=crops, return_tensors="pt")["pixel_values"].to(self.device, self.clip.dtype)
        embeds = torch.nn.functional.normalize(_features(self.clip.get_image_features(pixel_values=pixels)), dim=-1)  # [n, D]
        return [COLOURS[i] for i in (embeds @ self._classifier(classname).T).argmax(-1).tolist()]

    def _classifier(self, classname: str) -> torch.Tensor:
        """``[colours, D]``: each colour's text embedding, the mean of its normalised template embeddings,
        normalised (zero-shot classification as CLIP's paper and GenEval's clip_benchmark build it)."""
        if classname not in self._classifiers:
            rows = []
            for colour in COLOURS:
                texts = [t.format(c=colour, o=classname) for t in COLOUR_TEMPLATES]
                tokens = self.clip_processor(text=texts, return_tensors="pt", padding=True, truncation=True).to(self.device)
                embeds = torch.nn.functional.normalize(_features(self.clip.get_text_features(**tokens)), dim=-1)
                rows.append(torch.nn.functional.normalize(embeds.mean(0), dim=-1))
            self._classifiers[classname] = torch.stack(rows)
        return self._classifiers[classname]


def _features(out) -> torch.Tensor:
    """CLIP's projected embeddings ``[n, D]`` in float32: transformers 5 returns them as an output's
    ``pooler_output``, earlier versions as the tensor itself."""
    return (out if torch.is_tensor(out) else out.pooler_output).float()
