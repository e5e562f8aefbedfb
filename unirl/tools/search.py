"""``search``: BM25 over a local corpus, Search-R1's retriever with its output format.

The corpus is a JSONL file of ``{"id": ..., "contents": "Title\\ntext"}`` rows (Search-R1's and
FlashRAG's wiki-18 format: the first line of ``contents`` is the title), or a generated one
(``unirl://tiny_search/corpus``, the tiny search task's). BM25 is ``bm25s``
(https://github.com/xhluca/bm25s): pure Python over numpy sparse matrices, a pip install with no
Java (pyserini's Lucene index needs a JDK, which a CI runner or a laptop may not have), and it
retrieves a batch of queries in one pass. Its scoring is Lucene's BM25 variant; k1=0.9, b=0.4 are
pyserini's ``LuceneSearcher`` defaults, the BM25 that Search-R1's retriever server runs.

The observation is Search-R1's ``_passages2string``: ``Doc {i}(Title: {title}) {text}`` per passage,
one a line (https://github.com/PeterGriffinJin/Search-R1, ``search_r1/llm_agent/generation.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

# Without bm25s the tool is listed as unavailable (with the pip line). It is looked for, not imported:
# bm25s imports numba and llvmlite, and an llvmlite object imported before vLLM starts breaks vLLM
# 0.32's kernel-dispatcher scan of loaded modules (AttributeError in vllm/triton_utils/dispatcher.py).
# The index is built after the rollout engine (TextEnvironment.setup), so bm25s is imported then.
if importlib.util.find_spec("bm25s") is None:
    raise ModuleNotFoundError("No module named 'bm25s'", name="bm25s")

from unirl.tools.registry import ToolError, register_tool


def import_bm25s():
    """``bm25s``, with JAX kept off the GPU. Where jax is installed, importing bm25s imports it and runs a
    top-k, and JAX's default then takes 75% of a GPU's memory in that process (on a GPU machine, a
    training run's or a test worker's GPU: 105 GiB of an H200, every other process out of memory).
    JAX is given the CPU unless ``JAX_PLATFORMS`` says otherwise, and retrieval selects the top k with
    numpy (numba where bm25s scores with numba), never JAX, so results do not depend on whether jax is
    installed."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


def corpus_path(written: str) -> Path:
    """The corpus file: a path, or ``unirl://NAME`` for one bundled with unirl."""
    from unirl.data.paths import is_scheme, local_path

    try:
        path = local_path(written) if is_scheme(written) else Path(written).expanduser()
    except (ValueError, FileNotFoundError) as err:
        raise ToolError(f"search: corpus {written!r}: {err}") from None
    if not path.is_file():
        raise ToolError(f"search: corpus file not found: {path}")
    return path


def read_corpus(written: str | Path) -> list[dict]:
    """The rows of a JSONL corpus, or of a generated one (``unirl://tiny_search/corpus``); a row that is
    not a JSON object with a string ``contents`` is an error naming the file and its line number."""
    from unirl.data.paths import generated_rows, makes_rows

    written = str(written)
    if makes_rows(written):  # generated in code: no file, the row number names a bad row
        try:
            rows = generated_rows(written)
        except ValueError as err:
            raise ToolError(f"search: corpus {written!r}: {err}") from None
        for number, row in enumerate(rows, start=1):
            _check_row(row, f"{written} row {number}", json.dumps(row)[:80])
    else:
        path = corpus_path(written)
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ToolError(f"search: {path}:{number}: not JSON ({err.msg}): {line.strip()[:80]!r}") from None
                _check_row(row, f"{path}:{number}", line.strip()[:80])
                rows.append(row)
    if not rows:
        raise ToolError(f"search: corpus {written} has no rows")
    return rows


def _check_row(row, where: str, shown: str) -> None:
    if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
        raise ToolError(f"search: {where}: expected an object with a string 'contents' (and an 'id'), got {shown!r}")


def format_passages(passages: list[dict]) -> str:
    """Search-R1's format: ``Doc 1(Title: T) text`` a line, the title being the first line of contents."""
    lines = []
    for i, passage in enumerate(passages, start=1):
        title, _, text = passage["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)


@register_tool("search")
class Search:
    """BM25 search over a local JSONL corpus of {id, contents}; returns the top_k passages."""

    def __init__(self, corpus: str, top_k: int = 3, k1: float = 0.9, b: float = 0.4):
        bm25s = import_bm25s()
        if top_k < 1:
            raise ToolError(f"search: top_k must be >= 1, got {top_k}")
        self.rows = read_corpus(corpus)
        self.top_k = min(top_k, len(self.rows))
        self.retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
        self.retriever.index(bm25s.tokenize([r["contents"] for r in self.rows], stopwords="en", show_progress=False),
                             show_progress=False)

    @staticmethod
    def check(corpus: str, **kwargs) -> None:
        """The dry run's check: the corpus file is there (indexing it waits for the run); a generated
        corpus is generated (it is small)."""
        from unirl.data.paths import makes_rows

        read_corpus(corpus) if makes_rows(corpus) else corpus_path(corpus)

    def __call__(self, query: str) -> str:
        return self.call_batch([{"query": query}])[0]

    def call_batch(self, calls: list[dict]) -> list[str]:
        """One BM25 pass for a batch of calls (``{"query": ...}`` each)."""
        bm25s = import_bm25s()
        queries = [c["query"] for c in calls]
        bad = [q for q in queries if not isinstance(q, str)]
        if bad:
            raise ValueError(f"search: query must be a string, got {bad[0]!r}")
        tokens = bm25s.tokenize(queries, stopwords="en", show_progress=False)
        # numba's scoring selects with numba; otherwise numpy's selection, never JAX's (import_bm25s).
        selection = "numba" if self.retriever.backend == "numba" else "numpy"
        docs, _ = self.retriever.retrieve(tokens, k=self.top_k, show_progress=False,
                                          backend_selection=selection)  # [n, k] indices
        return [format_passages([self.rows[int(j)] for j in row]) for row in docs]
