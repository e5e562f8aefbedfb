"""The diffusion runs' prompt files: ``tiny``, ``.txt`` (one prompt a line), ``.jsonl`` rows (with their
columns, and a conditioning image per row for families that take one), bundled and generated sets.
"""

from __future__ import annotations


def load_prompt_rows(source: str, split: str, image: bool = False) -> list[dict]:
    """Rows ``{"prompt": ..., <columns>}`` from ``tiny``, a ``.txt`` (one prompt a line), a ``.jsonl``,
    a bundled ``unirl://NAME`` file or generated ``unirl://ocr/generated?n=...`` (``unirl/data/paths.py``).

    ``image``: the family takes a conditioning image per prompt (``ModelFamily.conditioning_image``), so
    every row must be a ``.jsonl`` row naming an existing, readable image file in its ``image`` field (relative paths
    are read from the prompt file's folder); the first row without one is named."""
    rows = _prompt_rows(source, split)
    if image:
        _check_images(rows, source, split)
    return rows


def _check_images(rows: list[dict], source: str, split: str) -> None:
    from unirl.data.paths import local_path
    from unirl.image_files import check_image_file

    for i, row in enumerate(rows):
        name = row.get("image")  # only .jsonl rows have one, so only then is the source a file
        path = local_path(source).parent / name if isinstance(name, str) else None
        if path is None or not path.is_file():
            raise ValueError(f"prompt file ({split}) {source}, row {i + 1}: model.family takes a conditioning image "
                             f"per prompt, so each row needs an 'image' naming an existing file; got {name!r}")
        try:
            check_image_file(path)  # decodable, not only present: header and checksums, cheap
        except ValueError as err:
            raise ValueError(f"prompt file ({split}) {source}, row {i + 1}: {err}") from None
        row["image"] = str(path)


def _prompt_rows(source: str, split: str) -> list[dict]:
    from unirl.data.paths import DataFileNotFoundError, generated_prompts, is_generated, local_path, locate

    if source == "tiny":
        from unirl.diffusion.tiny.prompts import tiny_prompts

        return [{"prompt": p} for p in tiny_prompts(split)]
    if is_generated(source):
        return [{"prompt": p} for p in generated_prompts(source)]
    path = local_path(source)
    if not path.exists():
        raise DataFileNotFoundError(locate(source).message(f"prompt file ({split})"))
    if path.suffix == ".jsonl":
        from unirl.text.data import load_rows

        rows = load_rows(str(path))  # the text runs' loader: a bad line is named with its number
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{i + 1}: each line must be a JSON object with a string 'prompt'")
        return rows
    if path.suffix == ".txt":
        return [{"prompt": line.strip()} for line in path.read_text().splitlines() if line.strip()]
    raise ValueError(f"prompt file {str(path)!r}: expected .txt (one prompt a line) or .jsonl")
