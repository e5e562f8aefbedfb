"""ImageReward's code path on a toy BLIP built here: a checkpoint in ImageReward's own layout (BLIP's
timm-style ViT names, BERT names, ``mlp.layers``) loads through ``convert_checkpoint`` and scores
exactly what the toy's modules compute by ImageReward's recipe, re-typed here: CLIP-normalised centre
crop, 35 tokens, the text encoder's first state through the head, minus the mean over the std."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl.rewards.imagereward import ImageReward
from unirl.rewards.registry import RewardError

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=16, layer_norm_eps=1e-6)
WORDS = ["a", "red", "blue", "cat", "dog", "photo", "of", "the", "on", "mat"]


def _toy(tmp_path, seed: int):
    """The tokenizer directory, the ImageReward-layout checkpoint and the modules it holds."""
    import torch.nn as nn
    from transformers import BertTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = BertTokenizer(str(vocab))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    text_sizes = dict(vocab_size=len(tokenizer), hidden_size=32, encoder_hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=40, layer_norm_eps=1e-12)
    torch.manual_seed(seed)
    vision = BlipVisionModel(BlipVisionConfig(**VISION)).eval()
    text = BlipTextModel(BlipTextConfig(**text_sizes), add_pooling_layer=False).eval()
    head = nn.Sequential(nn.Linear(32, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2), nn.Linear(128, 64),
                         nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1)).eval()
    with torch.no_grad():  # LayerNorms away from their 1/0 start, so a misplaced one would show
        for name, p in [*vision.named_parameters(), *text.named_parameters()]:
            if "norm" in name.lower():
                p.add_(0.1 * torch.randn_like(p))
    # Back to BLIP's ViT names, as ImageReward.pt stores them (typed here, not taken from the converter).
    timm = {"embeddings.class_embedding": "cls_token", "embeddings.position_embedding": "pos_embed",
            "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
            "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
            "post_layernorm.weight": "norm.weight", "post_layernorm.bias": "norm.bias"}
    state = {}
    for key, value in vision.state_dict().items():
        name = timm.get(key) or (key.replace("encoder.layers.", "blocks.").replace("layer_norm1", "norm1")
                                 .replace("layer_norm2", "norm2").replace("self_attn.projection", "attn.proj")
                                 .replace("self_attn.qkv", "attn.qkv"))
        state["blip.visual_encoder." + name] = value
    state.update({"blip.text_encoder." + k: v for k, v in text.state_dict().items()})
    state.update({"mlp.layers." + k: v for k, v in head.state_dict().items()})
    state["blip.vision_proj.weight"] = torch.zeros(4, 32)  # BLIP parts ImageReward does not use
    torch.save(state, tmp_path / "ImageReward.pt")
    return tokenizer, text_sizes, (vision, text, head)


def _expected(images, prompts, tokenizer, modules):
    vision, text, head = modules
    crops = []
    for image in images:  # 48 x 32: already 32 on its short side, so only the centre crop applies
        array = np.asarray(image, dtype=np.float32)[:, 8:40] / 255
        crops.append((array - np.array([0.48145466, 0.4578275, 0.40821073])) / np.array([0.26862954, 0.26130258, 0.27577711]))
    pixels = torch.tensor(np.stack(crops), dtype=torch.float32).permute(0, 3, 1, 2)
    tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    with torch.no_grad():
        image_states = vision(pixel_values=pixels).last_hidden_state
        states = text(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, encoder_hidden_states=image_states,
                      encoder_attention_mask=torch.ones(image_states.shape[:-1], dtype=torch.long)).last_hidden_state
        return ((head(states[:, 0]).squeeze(-1) - 0.16717362830052426) / 1.0333394966054072).tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_checkpoint_in_imagereward_layout_scores_as_imagereward_computes(tmp_path, seed):
    from PIL import Image

    tokenizer, text_sizes, modules = _toy(tmp_path, seed)
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)) for _ in range(3)]
    prompts = ["a photo of a red cat", "a blue dog on the mat", "a photo of a red cat"]
    reward = ImageReward(checkpoint=str(tmp_path / "ImageReward.pt"), tokenizer=str(tmp_path / "tokenizer"),
                         vision=VISION, text=text_sizes, batch_size=2, device="cpu")
    got = reward(images, prompts=prompts)
    assert got == pytest.approx(_expected(images, prompts, tokenizer, modules), abs=1e-5)
    # The prompt is read: the first image with the second prompt scores otherwise.
    assert reward(images[:1], prompts=prompts[1:2])[0] != pytest.approx(got[0], abs=1e-4)


def test_a_missing_checkpoint_is_named(tmp_path):
    reward = ImageReward(checkpoint=str(tmp_path / "nowhere.pt"), device="cpu")
    with pytest.raises(RewardError, match="no checkpoint at .*nowhere.pt.*kwargs.checkpoint"):
        reward([None], prompts=["a cat"])
