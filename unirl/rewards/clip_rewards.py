"""Image rewards on a CLIP model (transformers): ``pickscore``, ``clip_score``, ``image_similarity`` and ``aesthetic``.

Each takes ``model=`` (and ``processor=``) as a hub id or a local directory, so a user's machine
downloads the published weights while the tests pass a toy CLIP built locally. Weights load once,
lazily, on the right device, and batches are scored ``batch_size`` images at a time
(``unirl/rewards/models.py``).

Embeddings are computed explicitly (``vision_model`` -> pooled output -> ``visual_projection``,
and the same for text), which is what ``CLIPModel.get_image_features`` / ``get_text_features``
do, without depending on what those return in a given transformers version.

- ``pickscore`` (Kirstain et al. 2023, https://arxiv.org/abs/2305.01569): the CLIP-H model
  fine-tuned on human preferences, ``yuvalkirstain/PickScore_v1``, with the processor of the CLIP
  it was fine-tuned from, ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``. Score =
  ``logit_scale.exp() * cos(image, prompt) / divisor``. FlowGRPO's ``PickScoreScorer``
  (``flow_grpo/pickscore_scorer.py``) divides by 26 "to bring it to 0-1" (raw PickScores of SD
  images sit around 20-23), and so does the default here; ``divisor=1`` gives the raw PickScore.
- ``clip_score``: ``cos(image, prompt) * scale`` with ``openai/clip-vit-large-patch14``. (CLIPScore
  of Hessel et al. 2021 is ``100 * max(cos, 0)``: ``scale=100`` and the sign aside.)
- ``image_similarity`` (image editing): ``cos(image, input image)`` of the two CLIP image embeddings with
  ``openai/clip-vit-large-patch14``, FlowGRPO's ``image_similarity_score`` (``ClipScorer.image_similarity``),
  which its FLUX.1 Kontext and Qwen-Image-Edit configs weigh against GenEval so that the edit keeps the
  input. The input image is the ``image`` column (``unirl/rewards/image.py``: ``input_images``); both images go
  through the CLIP processor as PIL images, as in the other rewards here (FlowGRPO resizes tensors with torchvision).
- ``aesthetic``: the LAION improved aesthetic predictor
  (https://github.com/christophschuhmann/improved-aesthetic-predictor), an MLP head
  768 -> 1024 -> 128 -> 64 -> 16 -> 1 on the L2-normalised CLIP ViT-L/14 image embedding, weights
  ``sac+logos+ava1-l14-linearMSE.pth``. It predicts a 1-10 rating and ignores the prompt, as in
  DDPO and FlowGRPO.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from unirl.rewards.image import input_images
from unirl.rewards.models import ModelReward
from unirl.rewards.registry import register_reward


class CLIPReward(ModelReward):
    """Shared loading and embedding for CLIP-based rewards.

    Args:
        model: hub id or local directory of a ``CLIPModel``.
        processor: hub id or local directory of its ``CLIPProcessor``; defaults to ``model``.
        device, dtype, batch_size: see ``ModelReward``.
    """

    default_model = "openai/clip-vit-large-patch14"
    default_processor: str | None = None

    def __init__(self, *, model: str | None = None, processor: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.model_path = str(model or self.default_model)
        self.processor_path = str(processor or self.default_processor or self.model_path)

    def load(self) -> None:
        from transformers import CLIPModel, CLIPProcessor

        self.processor = CLIPProcessor.from_pretrained(self.processor_path)
        self.model = CLIPModel.from_pretrained(self.model_path).to(self.device, self.torch_dtype)
        self.model.eval().requires_grad_(False)

    def image_embeddings(self, images: Sequence[Any]):
        """L2-normalised image embeddings [n, D]."""
        inputs = self.processor(images=list(images), return_tensors="pt")
        pixels = inputs["pixel_values"].to(self.device, self.torch_dtype)  # [n, 3, H, W]
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output  # [n, hidden]
        emb = self.model.visual_projection(pooled)  # [n, D]
        return emb / emb.norm(p=2, dim=-1, keepdim=True)

    def text_embeddings(self, prompts: Sequence[str]):
        """L2-normalised text embeddings [n, D]; prompts are cut at CLIP's 77 tokens."""
        inputs = self.processor(text=list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt")
        pooled = self.model.text_model(input_ids=inputs["input_ids"].to(self.device),
                                       attention_mask=inputs["attention_mask"].to(self.device)).pooler_output
        emb = self.model.text_projection(pooled)  # [n, D]
        return emb / emb.norm(p=2, dim=-1, keepdim=True)


@register_reward("pickscore", modality="image")
class PickScore(CLIPReward):
    """PickScore (human preference for an image given its prompt), divided by 26 as in FlowGRPO."""

    default_model = "yuvalkirstain/PickScore_v1"
    default_processor = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

    def __init__(self, *, divisor: float = 26.0, **kwargs: Any):
        super().__init__(**kwargs)
        if not divisor > 0:
            raise ValueError(f"pickscore: divisor must be > 0, got {divisor}")
        self.divisor = float(divisor)

    def score(self, samples, *, prompts, **columns):
        img = self.image_embeddings(samples)  # [n, D]
        txt = self.text_embeddings(prompts)  # [n, D]
        # logit_scale.exp() * (txt @ img.T).diag(), without the n x n matrix.
        return (self.model.logit_scale.exp() * (img * txt).sum(-1) / self.divisor).float().cpu()


@register_reward("clip_score", modality="image")
class CLIPScore(CLIPReward):
    """Cosine similarity of the image and prompt CLIP embeddings (times scale)."""

    def __init__(self, *, scale: float = 1.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.scale = float(scale)

    def score(self, samples, *, prompts, **columns):
        return (self.scale * (self.image_embeddings(samples) * self.text_embeddings(prompts)).sum(-1)).float().cpu()


@register_reward("image_similarity", modality="image")
class ImageSimilarity(CLIPReward):
    """Cosine similarity of the CLIP image embeddings of each image and its input image (image editing)."""

    def score(self, samples, *, image=None, **columns):
        inputs = self.image_embeddings(input_images(image))  # [n, D]
        return (self.image_embeddings(samples) * inputs).sum(-1).float().cpu()


@register_reward("aesthetic", modality="image")
class Aesthetic(CLIPReward):
    """LAION aesthetic predictor: an MLP on the normalised CLIP ViT-L/14 image embedding (about 1-10)."""

    def __init__(self, *, head: str = "camenduru/improved-aesthetic-predictor",
                 head_file: str = "sac+logos+ava1-l14-linearMSE.pth", **kwargs: Any):
        """``head``: a local ``.pth`` file, or a hub repository holding ``head_file``."""
        super().__init__(**kwargs)
        self.head_path = head
        self.head_file = head_file

    def load(self) -> None:
        super().load()
        path = Path(self.head_path).expanduser()
        if not path.is_file():
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(self.head_path, self.head_file))
        import torch

        from unirl.rewards.aesthetic_head import AestheticHead

        state = torch.load(path, map_location="cpu", weights_only=True)
        state = {k if k.startswith("layers.") else f"layers.{k}": v for k, v in state.items()}
        dim = self.model.config.projection_dim
        if state["layers.0.weight"].shape[1] != dim:
            raise ValueError(f"aesthetic head {path} takes {state['layers.0.weight'].shape[1]}-d embeddings, "
                             f"the CLIP model {self.model_path} makes {dim}-d ones (use a ViT-L/14 CLIP)")
        self.head = AestheticHead(dim)
        self.head.load_state_dict(state)
        self.head.to(self.device, self.torch_dtype).eval().requires_grad_(False)

    def score(self, samples, *, prompts, **columns):
        return self.head(self.image_embeddings(samples)).squeeze(-1).float().cpu()  # [n, 1] -> [n]
