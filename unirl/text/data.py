"""Prompt data for text runs: load rows, turn them into prompts, hand out B rows per step."""

from __future__ import annotations

import json

#: verl's GSM8K instruction (examples/data_preprocess/gsm8k.py).
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

#: verl's Geometry3K instruction (examples/data_preprocess/geo3k.py).
GEO3K_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
                     r"The reasoning process MUST BE enclosed within <think> </think> tags. "
                     r"The final answer MUST BE put in \boxed{}.")


def load_rows(source: str, *, split: str = "train", hub_config: str | None = None) -> list[dict]:
    """Rows from a local ``.jsonl``/``.json``/``.parquet`` file (``unirl://NAME``: a bundled one, or
    generated ones such as ``unirl://arithmetic/train``) or a ``datasets`` hub name."""
    from unirl.data.paths import DataFileNotFoundError, generated_rows, is_generated, local_path, locate

    if is_generated(source):  # e.g. unirl://arithmetic/train?n=5000
        return generated_rows(source)
    path = local_path(source)
    if path.suffix in {".jsonl", ".json", ".parquet"} or path.exists():
        if not path.exists():
            raise DataFileNotFoundError(locate(source).message("data file"))
        if path.suffix == ".jsonl":
            rows = []
            with open(path) as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            return rows
        if path.suffix == ".json":
            rows = json.loads(path.read_text())
            if not isinstance(rows, list):
                raise ValueError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
            return rows
        if path.suffix == ".parquet":
            import datasets

            return list(datasets.load_dataset("parquet", data_files=str(path), split="train"))
        raise ValueError(f"data file {str(path)!r}: expected a .jsonl, .json or .parquet file")
    import datasets

    return list(datasets.load_dataset(source, hub_config, split=split))


def gsm8k_gold(answer: str) -> str:
    """The gold number of a GSM8K answer (the text after the last ``####``)."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '#### N' line: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


#: The columns a prompt is looked for in when ``data.prompt_key`` is null, in this order (TRL's
#: ``prompt``, GSM8K's ``question``); a row with neither and a single text column uses that one.
PROMPT_COLUMNS = ("prompt", "question")


def to_prompt_rows(rows: list[dict], *, adapter: str, prompt_key: str | None, source: str) -> list[dict]:
    """Rows with a ``prompt`` (the user message) plus every original column.

    ``gsm8k`` appends verl's instruction and adds ``answer`` = the gold number; ``plain`` takes
    the ``prompt_key`` column as is (``prompt_key`` None: ``find_prompt_key`` on the first row). Every
    row is checked (a JSON object whose ``prompt_key`` is a string); a bad one is a ``ValueError``
    naming its place (``file:line`` for a .jsonl file) and the settings to change.
    """
    if prompt_key is None and rows:
        prompt_key = find_prompt_key(rows[0], source)
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{row_place(source, i)}: row {i} must be a JSON object with a {prompt_key!r} column, "
                             f"got {json.dumps(row)[:80]}")
        if prompt_key not in row:
            raise ValueError(f"{row_place(source, i)}: row {i} has no {prompt_key!r} column (columns: {sorted(row)}); "
                             f"set data.prompt_key to the column holding the prompt (data.adapter is {adapter!r})")
        if not isinstance(row[prompt_key], str):
            raise ValueError(f"{row_place(source, i)}: row {i}'s {prompt_key!r} must be a string, got "
                             f"{json.dumps(row[prompt_key], default=str)[:80]}")
        new = dict(row)
        if adapter == "gsm8k":
            if "answer" not in row:
                raise ValueError(f"{row_place(source, i)}: row {i} has no 'answer' column, which data.adapter=gsm8k "
                                 f"needs (data.adapter=plain takes the prompt column as it is)")
            new["prompt"] = f"{row[prompt_key]} {GSM8K_INSTRUCTION}"
            try:
                new["answer"] = gsm8k_gold(str(row["answer"]))
            except ValueError as e:
                raise ValueError(f"{row_place(source, i)}: row {i}: {e}") from None
        elif adapter == "geo3k":
            new["prompt"] = geo3k_prompt(row, i, prompt_key, source)
        else:
            new["prompt"] = row[prompt_key]
        out.append(new)
    return out


def geo3k_prompt(row: dict, index: int, prompt_key: str, source: str) -> str:
    """hiyouga/geometry3k's problem as verl's preprocessing writes it (``problem + " " + instruction``),
    less its ``<image>`` marks: the chat template places the row's images before the text itself (as
    verl's dataset turns each mark into the image's place, and geometry3k's marks all lead the problem).
    The row must carry its gold ``answer`` and at least one image."""
    if "answer" not in row:
        raise ValueError(f"{row_place(source, index)}: row {index} has no 'answer' column, which data.adapter=geo3k needs")
    if not row.get("images"):
        raise ValueError(f"{row_place(source, index)}: row {index} has no 'images': a geometry3k problem comes with "
                         f"its figure (data.adapter=geo3k)")
    problem = row[prompt_key].replace("<image>", "").strip()
    return f"{problem} {GEO3K_INSTRUCTION}"


def row_place(source: str, index: int) -> str:
    """Where row ``index`` (0-based, as ``load_rows`` returns them) sits: ``file:line`` for a .jsonl
    file (blank lines are skipped by the loader), else the source itself. Read only for an error."""
    from unirl.data.paths import local_path

    path = local_path(source)
    if path.suffix == ".jsonl" and path.exists():
        with open(path) as f:
            numbers = (lineno for lineno, line in enumerate(f, 1) if line.strip())
            for k, lineno in enumerate(numbers):
                if k == index:
                    return f"{path}:{lineno}"
    return source


def find_prompt_key(row: dict, source: str) -> str:
    """``prompt``, else ``question``, else the row's only text column; an error naming the settings otherwise."""
    for key in PROMPT_COLUMNS:
        if key in row:
            return key
    text = [k for k, v in row.items() if isinstance(v, str)]
    if len(text) == 1:
        return text[0]
    raise ValueError(f"{source}: no 'prompt' or 'question' column and {len(text)} text columns ({sorted(row)}); set "
                   f"data.prompt_key to the column holding the prompt, and data.adapter (plain: the column as it is; "
                   f"gsm8k: GSM8K's question and '#### N' answer)")
