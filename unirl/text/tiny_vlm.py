"""The embedded tiny vision-language model: a real ``Qwen2VLForConditionalGeneration`` at toy size,
its character tokenizer with Qwen2-VL's image special tokens, and a real processor, built here.

Nothing is downloaded. ``build_tiny_vlm`` writes an ordinary Hugging Face directory (config, weights,
tokenizer, ``Qwen2VLImageProcessor``, chat template) into the cache from a fixed seed, so that
``AutoProcessor.from_pretrained`` and ``AutoModelForImageTextToText.from_pretrained`` (and vLLM) load it
by path like the real Qwen2-VL-2B. Attention head_dim is 64 in both towers because vLLM's CPU attention
kernels reject smaller heads; the text tower's multimodal rotary sections (``mrope_section``) split its
32 rotary frequencies 8/12/12 over time/height/width as Qwen2-VL splits 64 as 16/24/24.

Images are resized to about 56x56 pixels (area fixed, aspect kept in multiples of 28): a square picture
is 16 patches of 14 pixels, merged 2x2 into 4 image tokens of the 256-token context.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from unirl.models.cache import cached_build, default_cache_dir, spec_digest
from unirl.text.tiny import character_tokenizer_core

#: Qwen2-VL's chat and vision special tokens (the names its processor and vLLM look for).
VISION_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_SPECIAL = ["<|pad|>", "<|endoftext|>", "<|unk|>"] + VISION_SPECIAL

#: Qwen2-VL's chat template, reduced to what the tiny model needs: user/assistant turns whose content is
#: a string or a list of ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts; each image
#: becomes ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor then repeats ``<|image_pad|>``
#: once per merged patch).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Everything that changes the built artefacts goes into the cache key.
TINY_VLM_SPEC = {
    "version": 3,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 64
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "mrope_section": [8, 12, 12],  # sums to head_dim / 2
    "vision_depth": 2,
    "vision_embed_dim": 128,
    "vision_num_heads": 2,  # head_dim 64
    "image_pixels": 56 * 56,
    "train_rows": 1000,
    "test_rows": 100,
    "warm_start_steps": 130,
    "warm_start_lr": 1e-3,
}


def build_vlm_tokenizer():
    """The tiny character tokenizer (``unirl.text.tiny``) plus Qwen2-VL's chat and image special tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=character_tokenizer_core(_SPECIAL, "<>|_"), pad_token="<|pad|>", eos_token="<|im_end|>", unk_token="<|unk|>",
        model_max_length=TINY_VLM_SPEC["max_position_embeddings"],
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
    )


def build_image_processor(spec: dict = TINY_VLM_SPEC):
    """A real Qwen2-VL image processor (the PIL backend, which needs no torchvision) that resizes every image to ``spec["image_pixels"]`` (min = max)."""
    from transformers import Qwen2VLImageProcessorPil

    pixels = spec["image_pixels"]
    return Qwen2VLImageProcessorPil(size={"shortest_edge": pixels, "longest_edge": pixels},
                                    patch_size=14, merge_size=2, temporal_patch_size=2)


def new_vlm(tokenizer, spec: dict, seed: int):
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` of ``spec``'s shape over ``tokenizer``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"], num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"], max_position_embeddings=spec["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": spec["mrope_section"]},
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(depth=spec["vision_depth"], embed_dim=spec["vision_embed_dim"], hidden_size=spec["hidden_size"],
                  num_heads=spec["vision_num_heads"], mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, dtype="float32", **ids)
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def build_tiny_vlm(directory: str | Path | None = None, seed: int = 0) -> Path:
    """Build (or reuse) the tiny VLM + tokenizer + processor; return the model directory (cached like
    ``unirl.text.tiny.build_tiny_lm``)."""
    spec = dict(TINY_VLM_SPEC, seed=seed)
    directory = Path(directory) if directory else default_cache_dir() / f"tiny-qwen2vl-{spec_digest(spec)}"
    return cached_build(directory, spec, "unirl_tiny_vlm.json", lambda work: _build(work, spec, seed),
                        what="the tiny vision-language model")


def _build(directory: Path, spec: dict, seed: int) -> None:
    """Model, processor files, the counting task (``unirl/text/tiny_vlm_task.py``) and a supervised warm
    start on it. A random model never writes ``#### N``, and GRPO cannot find a reward it never samples;
    and a model that answers in the format but has not begun to read its pictures did not learn to count
    under GRPO (held-out accuracy stayed at chance, docs/vlm.md). The warm start's 130 steps stop halfway
    through the supervised curve (about 0.6 held-out accuracy; the full fit reaches 1.0 near step 160), so
    the demo's RL has room to show."""
    from unirl.text.tiny_vlm_task import write_counting_task

    tokenizer = build_vlm_tokenizer()
    model = new_vlm(tokenizer, spec, seed)
    train = write_counting_task(directory, "train", spec["train_rows"], seed + 1)
    write_counting_task(directory, "test", spec["test_rows"], seed + 2)
    _warm_start(model, tokenizer, build_image_processor(spec), directory, train, spec, seed)
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.save_pretrained(directory)
    # The processor's parts, as ``Qwen2VLProcessor.save_pretrained`` writes them. transformers 5 builds a
    # Qwen2VLProcessor only where torchvision is installed (for its video half), so it is not built here:
    # the directory loads with AutoProcessor where torchvision is, and with unirl.text.vlm.VLMProcessor always.
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    build_image_processor(spec).save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=1))


def _warm_start(model, tokenizer, image_processor, directory: Path, rows: list[dict], spec: dict, seed: int) -> None:
    """``warm_start_steps`` next-token steps on 16 rows each: the answer's tokens only (prompt and image
    tokens are labelled -100). Every prompt and answer has the same length, so no padding is needed."""
    import random

    from PIL import Image

    from unirl.text.vlm import VLMProcessor, vision_inputs

    tokenizer.chat_template = CHAT_TEMPLATE
    processor = VLMProcessor(tokenizer, image_processor)
    rng = random.Random(seed + 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["warm_start_lr"])
    model.train()
    for _ in range(spec["warm_start_steps"]):
        batch = rng.sample(rows, 16)
        images = [Image.open(directory / r["images"][0]).convert("RGB") for r in batch]
        encoded = [processor.encode(processor.prompt_text(r["question"], 1), [im]) for r, im in zip(batch, images)]
        answers = [tokenizer(r["answer"]).input_ids + [tokenizer.eos_token_id] for r in batch]
        ids = torch.tensor([e["input_ids"] + a for e, a in zip(encoded, answers)])  # [16, P+A]
        labels = torch.tensor([[-100] * len(e["input_ids"]) + a for e, a in zip(encoded, answers)])
        pixels = image_processor(images=images, return_tensors="pt")
        loss = model(input_ids=ids, labels=labels, **vision_inputs(ids, pixels["pixel_values"], pixels["image_grid_thw"],
                                                                  processor.image_token_id)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
