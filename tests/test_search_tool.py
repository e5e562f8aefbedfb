"""The search tool: BM25 over a JSONL corpus in Search-R1's output format, bad rows named with their
line, the dry run's checks, and ``unirl serve-tool`` equal to the in-process tool under a bounded
loopback load (8 clients x 25 calls, a real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from unirl.tools import ToolError, load_tool
from unirl.tools.remote_client import RemoteTool

from machine import repo_env

# Builds BM25 indexes in this process, importing numba: see conftest.pytest_collection_modifyitems.
pytestmark = pytest.mark.imports_numba

REPO = Path(__file__).resolve().parents[1]
NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi"]


def write_corpus(path: Path) -> Path:
    with open(path, "w") as f:
        for i, name in enumerate(NAMES):
            f.write(json.dumps({"id": str(i), "contents": f"{name}\nThe code of {name} is {1000 + 37 * i}."}) + "\n")
    return path


def test_top_k_in_search_r1_format(tmp_path):
    search = load_tool("search", corpus=str(write_corpus(tmp_path / "c.jsonl")), top_k=2)
    text = search(query="what is the code of Grace?")
    lines = text.splitlines()
    assert lines[0] == "Doc 1(Title: Grace) The code of Grace is 1222."
    assert lines[1].startswith("Doc 2(Title: ") and len(lines) == 2 and text.endswith("\n")
    assert search.call_batch([{"query": "Bob code"}, {"query": "Erin"}])[1].startswith("Doc 1(Title: Erin)")


def test_numpys_selection_finds_what_numbas_does_and_jax_is_kept_off_the_gpu(tmp_path, monkeypatch):
    """Where numba is missing (a GPU machine's image), bm25s scores with numpy and the tool selects the top
    k with numpy, not JAX (which, imported by bm25s, would take 75% of a GPU): the same passages."""
    import bm25s

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    corpus = str(write_corpus(tmp_path / "c.jsonl"))
    numba = load_tool("search", corpus=corpus, top_k=3)
    assert os.environ["JAX_PLATFORMS"] == "cpu"  # set before bm25s (and with it jax) was imported
    numpy = load_tool("search", corpus=corpus, top_k=3)
    numpy.retriever = bm25s.BM25(k1=0.9, b=0.4, method="lucene", backend="numpy")
    numpy.retriever.index(bm25s.tokenize([r["contents"] for r in numpy.rows], stopwords="en", show_progress=False),
                          show_progress=False)
    queries = [{"query": f"the code of {name}"} for name in NAMES] + [{"query": "Grace Bob"}]
    assert numpy.call_batch(queries) == numba.call_batch(queries)


def test_a_bad_row_is_named_with_its_line(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl")
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"id": "x", "text": "no contents"}) + "\n")
    with pytest.raises(ToolError, match=r"c.jsonl:10: expected an object with a string 'contents'"):
        load_tool("search", corpus=str(path))
    path.write_text('{"id": 1, "contents": "A\\nx"}\n{not json\n')
    with pytest.raises(ToolError, match=r"c.jsonl:2: not JSON"):
        load_tool("search", corpus=str(path))


def test_dry_run_names_a_missing_corpus_an_unknown_tool_and_a_bad_kwarg(tmp_path):
    from unirl.config import load_config
    from unirl.preflight import preflight
    from unirl.text.config import TextConfig

    cfg = load_config(TextConfig, None, [
        "rollout.tools=[{name: search, kwargs: {corpus: /nonexistent/wiki.jsonl}}, {name: calculater}, "
        "{name: calculator, kwargs: {digits: 3}}]"])
    problems = "\n".join(preflight(cfg, "text").problems)
    assert "rollout.tools[0].name: search: corpus file not found: /nonexistent/wiki.jsonl" in problems
    assert "rollout.tools[1].name: unknown tool 'calculater'" in problems
    assert "rollout.tools[2].name: tool 'calculator' has no parameter 'digits'" in problems


def _serve(corpus: Path):
    env = repo_env()
    proc = subprocess.Popen([sys.executable, "-m", "unirl.cli", "serve-tool", "search", "--corpus", str(corpus),
                             "--port", "0", "--max-wait-ms", "20"], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.startswith("serving tool 'search' at http://"), line
    return proc, line.rsplit(" ", 1)[1].strip()


def test_served_search_equals_in_process_under_load(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl")
    local = load_tool("search", corpus=str(corpus))
    queries = [f"code of {NAMES[(c * 3 + r) % len(NAMES)]}" + (" please" if r % 2 else "") for c in range(8) for r in range(25)]
    expected = {q: local(query=q) for q in set(queries)}
    proc, url = _serve(corpus)
    try:
        remote = RemoteTool(url, timeout=30, retries=5)
        answers, errors = {}, []

        def client(c: int) -> None:
            for r in range(25):
                q = queries[c * 25 + r]
                try:
                    answers[(c, r)] = (q, remote(query=q))
                except Exception as err:  # recorded, asserted below
                    errors.append(repr(err))

        threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            health = json.loads(response.read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert errors == []
    assert len(answers) == 200 and all(text == expected[q] for q, text in answers.values())
    assert health["answered"] == 200 and health["queued"] == 0
    assert health["batches"] < 200, "concurrent calls were not joined into batched BM25 passes"


def test_search_r1_config_passes_its_dry_run_with_a_user_supplied_corpus(tmp_path):
    from unirl.cli import load_run_config
    from unirl.preflight import preflight

    corpus = write_corpus(tmp_path / "wiki.jsonl")
    data = tmp_path / "nq.jsonl"
    data.write_text(json.dumps({"prompt": "Question: who? Answer:", "golden_answers": ["x"]}) + "\n")
    overrides = [f"rollout.tools[0].kwargs.corpus={corpus}", f"data.train={data}", f"data.test={data}"]
    config = str(REPO / "docs" / "examples" / "search_r1.yaml")
    cfg = load_run_config("text", config, overrides, output_dir=str(tmp_path / "run"))
    report = preflight(cfg, "text")
    assert report.problems == []
    assert any("rollout.tools[0].name: search resolves" in line for line in report.passed)
    # without the user's corpus, the dry run names it
    cfg = load_run_config("text", config, overrides[1:], output_dir=str(tmp_path / "run"))
    assert any("corpus file not found: /path/to/wiki-18.jsonl" in p for p in preflight(cfg, "text").problems)


def test_dry_run_names_an_unknown_call_format_and_a_missing_format_file():
    from unirl.config import load_config
    from unirl.preflight import preflight
    from unirl.text.config import TextConfig

    def problems(call_format: str) -> str:
        cfg = load_config(TextConfig, None, ["rollout.tools=[{name: calculator}]", f"rollout.call_format={call_format}"])
        return "\n".join(preflight(cfg, "text").problems)

    assert "rollout.call_format: unknown call format 'hermez'. Did you mean 'hermes'" in problems("hermez")
    assert "rollout.call_format (format file): '/nonexistent/fmt.py' not found" in problems("/nonexistent/fmt.py:Mine")
    assert "call_format" not in problems("hermes")
    # search_r1 only calls search: a calculator would never be called (issue 37 item 15)
    assert "rollout.call_format 'search_r1' only calls 'search'" in problems("search_r1")


# ------------------------------------------------------------------ issue 37 item 15
def test_dry_run_refuses_a_tool_the_call_format_never_calls(tmp_path):
    from unirl.cli import load_run_config
    from unirl.preflight import preflight

    (tmp_path / "lookup.py").write_text("def lookup(query):\n    return 'x'\n")
    tools = f"rollout.tools=[{{name: '{tmp_path / 'lookup.py'}:lookup'}}]"
    problems = preflight(load_run_config("text", "tiny_search", [tools]), "text").problems
    assert any("rollout.call_format 'search_r1' only calls 'search', so the tool(s) 'lookup' would never be called"
               in p for p in problems), problems
    hermes = preflight(load_run_config("text", "tiny_search", [tools, "rollout.call_format=hermes"]), "text").problems
    assert not any("call_format" in p for p in hermes), hermes
    assert not any("call_format" in p for p in preflight(load_run_config("text", "tiny_search", []), "text").problems)


def test_the_write_your_own_tool_example_of_docs_tools_md_runs(tmp_path):
    """The docs' example as a user would take it: the file, the Python snippet (its printed lines are
    the comments beside them), and the dry run command."""
    import re
    import shlex

    section = (REPO / "docs" / "tools.md").read_text().split("## Write your own tool", 1)[1].split("\n## ", 1)[0]
    module, snippet = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    command = re.search(r"```console\n\$ (.*?)\n```", section, re.DOTALL).group(1)
    (tmp_path / "my_tools.py").write_text(module)
    env = repo_env()
    ran = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    expected = [line.split("# ", 1)[1].strip() for line in snippet.splitlines() if line.startswith("print(")]
    assert ran.stdout.splitlines() == expected
    argv = shlex.split(command)
    assert argv[:2] == ["unirl", "train"]
    dry = subprocess.run([sys.executable, "-m", "unirl.cli", *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=300)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert "rollout.tools[0].name: my_tools.py:define resolves" in dry.stdout


def test_search_over_the_tiny_search_corpus_finds_each_name():
    """The generated corpus of the tiny search task (unirl/text/tiny_search.py) answers each of its names."""
    from unirl.data.paths import generated_rows
    from unirl.tools.search import Search, read_corpus

    search = Search("unirl://tiny_search/corpus", top_k=1)
    for row in generated_rows("unirl://tiny_search/train") + generated_rows("unirl://tiny_search/test"):
        name = row["question"].split(".")[0]
        assert search(name) == f"Doc 1(Title: {name}) code {row['answer']}\n"
    with pytest.raises(ToolError, match=r"unirl://arithmetic/test\?n=2 row 1: expected an object with a string 'contents'"):
        read_corpus("unirl://arithmetic/test?n=2")


@pytest.mark.slow  # builds the tiny search model once a session (test_tiny_search_e2e shares it)
def test_multi_turn_tool_rollouts_run_ahead(tmp_path):
    """source.max_staleness with multi-turn search rollouts (docs/async.md); here because the tool's index
    imports numba in this process (the asynchronous loop's other tests: tests/test_async_rollout.py)."""
    from test_async_rollout import _run, _versions_follow_the_schedule

    extra = ["trainer.total_steps=3", "source.max_staleness=1", "trainer.prompts_per_step=4", "trainer.group_size=4"]
    trainer, rows = _run(tmp_path, "tools", *extra, config="tiny_search")
    _versions_follow_the_schedule(rows, 1)
    assert all("rollout/tool_calls_mean" in r for r in rows)
