"""ImageReward (Xu et al., 2023, https://arxiv.org/abs/2304.05977): a BLIP model fine-tuned on human
preference rankings of text-to-image outputs; FlowGRPO and DanceGRPO train and report with it.

The model (THUDM/ImageReward, ``ImageReward/ImageReward.py``): BLIP's ViT-L/16 encodes the image
(224 px: resized by the short side with bicubic filtering, centre-cropped, CLIP's mean and std);
BLIP's BERT-base text encoder reads the prompt (``bert-base-uncased`` tokens, padded and cut to 35)
with cross-attention to the image tokens; its first token's state goes through a linear stack
768-1024-128-64-16-1 (no activations between, dropout in training); the score is that output minus
0.16717 over 1.03334 (the mean and std the authors measured, so scores sit around 0).

Here the two BLIP encoders are transformers' ``BlipVisionModel`` and ``BlipTextModel`` (the same
computation, other parameter names), and ``convert_checkpoint`` renames the published
``ImageReward.pt`` state dict into them. ``checkpoint`` is that file, and ``tokenizer`` a
``bert-base-uncased`` directory, both read locally (nothing is downloaded at run time); ``vision`` and
``text`` hold the BLIP sizes (the published model's by default; the tests build a toy).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from unirl.rewards.models import ModelReward
from unirl.rewards.registry import RewardError, register_reward

#: The authors' normalisation of the head's output (``ImageReward.mean`` / ``.std``).
SCORE_MEAN, SCORE_STD = 0.16717362830052426, 1.0333394966054072
#: BLIP's text length in ImageReward (``max_length=35``).
MAX_TOKENS = 35
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
#: BLIP ViT-L/16 at 224 px (``vit='large'``; its LayerNorms use eps 1e-6) and BLIP's BERT-base with cross-attention.
VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
              image_size=224, patch_size=16, layer_norm_eps=1e-6)
TEXT = dict(vocab_size=30524, hidden_size=768, encoder_hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
            num_attention_heads=12, max_position_embeddings=512, layer_norm_eps=1e-12)

# BLIP's ViT (timm names) -> transformers' BlipVisionModel.
_VISION_RENAMES = [
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


def convert_checkpoint(state: dict) -> dict[str, dict]:
    """``ImageReward.pt``'s state dict -> ``{"vision": ..., "text": ..., "head": ...}`` for this module's
    ``BlipVisionModel``, ``BlipTextModel`` and head (BLIP's text encoder already uses BERT's names;
    the head's Linear layers sit at the same indices). Other BLIP parts (projections, decoder) are unused."""
    out: dict[str, dict] = {"vision": {}, "text": {}, "head": {}}
    for key, value in state.items():
        if key.endswith("position_ids"):  # a buffer of 0..L-1 older BERT code saved; rebuilt by transformers
            continue
        if key.startswith("blip.visual_encoder."):
            name = key.removeprefix("blip.visual_encoder.")
            for pattern, replacement in _VISION_RENAMES:
                name, hits = re.subn(pattern, replacement, name)
                if hits:
                    break
            out["vision"][name] = value
        elif key.startswith("blip.text_encoder.") and not key.startswith("blip.text_encoder.pooler."):
            out["text"][key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp.layers."):
            out["head"][key.removeprefix("mlp.layers.")] = value
    return out


def score_head(width: int):
    """ImageReward's head: Linear layers width-1024-128-64-16-1 with dropouts between the first four
    (indices 0, 2, 4, 6, 7, as in its ``MLP.layers``), no activations."""
    import torch.nn as nn

    return nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))


@register_reward("imagereward", modality="image")
class ImageReward(ModelReward):
    """ImageReward: BLIP fine-tuned on human preferences between images for a prompt (about -2 to 2)."""

    def __init__(self, *, checkpoint: str = "ImageReward.pt", tokenizer: str = "bert-base-uncased",
                 vision: dict | None = None, text: dict | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.checkpoint, self.tokenizer_name = checkpoint, tokenizer
        self.vision_sizes, self.text_sizes = vision or VISION, text or TEXT

    def load(self) -> None:
        import torch
        from transformers import AutoTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        try:
            state = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise RewardError(f"imagereward: no checkpoint at {self.checkpoint!r}; download ImageReward.pt "
                              f"(THUDM/ImageReward on the hub) and pass its path as kwargs.checkpoint") from None
        parts = convert_checkpoint(state.get("state_dict", state) if isinstance(state, dict) else state)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
        self.vision = BlipVisionModel(BlipVisionConfig(**self.vision_sizes))
        self.text = BlipTextModel(BlipTextConfig(**self.text_sizes), add_pooling_layer=False)
        self.head = score_head(self.text_sizes["hidden_size"])
        for name, module in (("vision", self.vision), ("text", self.text), ("head", self.head)):
            missing, unexpected = module.load_state_dict(parts[name], strict=False)
            if missing or unexpected:
                raise RewardError(f"imagereward: {self.checkpoint} does not fit the {name} part: missing "
                                  f"{missing[:5]}, unexpected {unexpected[:5]}")
            # The head runs in float32 on float32 features, as ImageReward casts them (``.float()``).
            module.to(self.device, self.torch_dtype if name != "head" else torch.float32).eval()

    def pixels(self, images: Sequence[Any]):
        """``[n, 3, S, S]``: ImageReward's preprocessing (short side to S bicubic, centre crop, CLIP normalisation)."""
        import numpy as np
        import torch
        from PIL import Image

        size = self.vision_sizes["image_size"]
        out = []
        for image in images:
            image = image.convert("RGB")
            w, h = image.size
            scale = size / min(w, h)
            image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BICUBIC)
            left, top = (image.width - size) // 2, (image.height - size) // 2
            array = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.float32) / 255  # [S, S, 3]
            out.append((torch.from_numpy(array) - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD))
        return torch.stack(out).permute(0, 3, 1, 2)

    def score(self, samples: Sequence[Any], *, prompts: Sequence[str], **columns: Any):
        import torch

        tokens = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_TOKENS,
                                return_tensors="pt").to(self.device)
        image_states = self.vision(pixel_values=self.pixels(samples).to(self.device, self.torch_dtype)).last_hidden_state
        image_mask = torch.ones(image_states.shape[:-1], dtype=torch.long, device=self.device)  # [n, 1 + patches]
        states = self.text(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                           encoder_hidden_states=image_states, encoder_attention_mask=image_mask).last_hidden_state
        raw = self.head(states[:, 0].float()).squeeze(-1)  # [n]
        return ((raw - SCORE_MEAN) / SCORE_STD).cpu()
