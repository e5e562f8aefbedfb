"""The multi-turn rollout (unirl/text/multiturn.py) with a scripted engine and a character tokenizer:
observations appended with loss-mask holes, answers end a sample, max_turns / max_total_tokens truncate
and say so, tool errors become counted observations, a batch's calls run concurrently; and the
rollout tensors and metrics built from it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from unirl.rollout.engine import Generation
from unirl.text.multiturn import multi_turn_generate
from unirl.text.multiturn_rollout import multi_turn_metrics, trajectories_to_rollout
from unirl.tools.calling import ToolRunner
from unirl.tools.formats import SearchR1Format

EOS = 0


class CharTokenizer:
    pad_token_id = 1
    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i > 1 or not skip_special_tokens)

    def get_vocab(self):  # one character a token
        return {chr(i): i for i in range(2, 0x250)}


class ScriptedEngine:
    """Answers a context with ``script(context_text)``, cut at the first stop string (kept) and at
    ``max_new_tokens``; a reply ending in "$" ends with EOS. Log-prob of every token: -0.5."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, *, n, max_new_tokens, temperature, top_p=1.0, top_k=-1, greedy=False, stop=None):
        self.calls.append(len(prompt_ids))
        out = []
        for ids in prompt_ids:
            text = self.script("".join(chr(i) for i in ids))
            ends = [text.index(s) + len(s) for s in (stop or []) if s in text]
            eos = not ends and text.endswith("$")
            text = text[:min(ends)] if ends else text.rstrip("$")
            tokens = [ord(c) for c in text] + ([EOS] if eos else [])
            tokens = tokens[:max_new_tokens]
            out.append([Generation(tokens, [-0.5] * len(tokens), text, finished=bool(tokens) and tokens[-1] == EOS)
                        for _ in range(n)])
        return out


def searcher(context: str) -> str:
    if "<information>" not in context:
        return "<search>code of " + context.split("?")[0].split()[-1] + "</search> trailing"
    return "<answer>" + context.rsplit("is ", 1)[1].split(".")[0] + "</answer>"


def run(engine, prompts, tools, n=1, **kw):
    tok = CharTokenizer()
    kw = {"max_turns": 4, "max_new_tokens": 64, "max_total_tokens": None, "temperature": 1.0, **kw}
    runner = ToolRunner(tools, timeout_s=kw.pop("timeout_s", 5.0), error_text="[{error}]")
    try:
        return multi_turn_generate(engine, tok, SearchR1Format(), runner, [[ord(c) for c in p] for p in prompts],
                                   n=n, **kw)
    finally:
        runner.close()


def test_search_then_answer_with_the_observation_masked():
    codes = {"Alice": "4821", "Bob": "1234"}
    tools = {"search": lambda query: f"Doc 1(Title: X) The code is {codes[query.split()[-1]]}.\n"}
    groups = run(ScriptedEngine(searcher), ["Alice?", "Bob?"], tools, n=2)
    t = groups[0][1]
    text = "".join(chr(i) for i in t.ids)
    call = "<search>code of Alice</search>"
    obs = "\n\n<information>Doc 1(Title: X) The code is 4821.</information>\n\n"
    assert text == call + obs + "<answer>4821</answer>"
    assert t.loss_mask == [1] * len(call) + [0] * len(obs) + [1] * len("<answer>4821</answer>")
    assert t.logprobs[len(call):len(call) + len(obs)] == [0.0] * len(obs)
    assert (t.answer, t.turns, t.finished, t.truncated, t.observation_tokens) == ("4821", 2, True, False, len(obs))
    assert t.tool_calls == [{"name": "search", "arguments": {"query": "code of Alice"}, "error": None}]
    assert groups[1][0].answer == "1234"


def test_max_turns_and_max_total_tokens_truncate_and_say_so():
    always = ScriptedEngine(lambda ctx: "<search>again</search>")
    t = run(always, ["q?"], {"search": lambda query: "nothing"}, max_turns=3)[0][0]
    assert (t.turns, len(t.tool_calls), t.truncated, t.finished) == (3, 2, True, False)
    assert t.ids[-len("</search>"):] == [ord(c) for c in "</search>"]  # the last turn's call is not run
    t = run(always, ["q?"], {"search": lambda query: "nothing"}, max_turns=10, max_total_tokens=60)[0][0]
    assert t.truncated and len(t.prompt_ids) + len(t.ids) <= 60
    # a reply with neither a call nor an answer that ends with EOS: finished, not truncated
    t = run(ScriptedEngine(lambda ctx: "I give up$"), ["q?"], {"search": lambda query: ""})[0][0]
    assert (t.turns, t.finished, t.truncated, t.ids[-1]) == (1, True, False, EOS)
    # cut by max_new_tokens mid-turn: truncated
    t = run(ScriptedEngine(lambda ctx: "x" * 100), ["q?"], {"search": lambda query: ""}, max_new_tokens=8)[0][0]
    assert (len(t.ids), t.truncated) == (8, True)


def test_tool_errors_are_observations_and_counted():
    def broken(query):
        raise OSError("index gone")

    script = lambda ctx: "<answer>none</answer>" if "<information>" in ctx else "<search>x</search>"  # noqa: E731
    t = run(ScriptedEngine(script), ["q?"], {"search": broken})[0][0]
    text = "".join(chr(i) for i in t.ids)
    assert "<information>[tool 'search' raised OSError: index gone]</information>" in text
    assert t.tool_errors == 1 and t.answer == "none"
    t = run(ScriptedEngine(lambda ctx: "<answer>a</answer>" if "<information>" in ctx else "<search>unclosed$"),
            ["q?"], {"search": broken})[0][0]
    # an unclosed call is unparsable: an error observation (counted), and the model goes on
    assert t.tool_errors == 1 and t.tool_calls[0]["error"].startswith("unparsable call") and t.answer == "a"


def test_the_calls_of_a_batch_run_concurrently():
    def slow(query):
        time.sleep(0.5)
        return "ok"

    script = lambda ctx: "<answer>a</answer>" if "<information>" in ctx else "<search>x</search>"  # noqa: E731
    engine = ScriptedEngine(script)
    start = time.perf_counter()
    groups = run(engine, ["q?"] * 8, {"search": slow}, n=4)
    elapsed = time.perf_counter() - start
    assert sum(len(t.tool_calls) for g in groups for t in g) == 32
    assert elapsed < 8.0, f"32 calls of 0.5 s took {elapsed:.1f} s: not concurrent"  # one by one: 16 s
    assert engine.calls == [8, 32]  # turn 1: 8 prompts x n=4; turn 2: the 32 contexts in one call


def test_rollout_tensors_columns_and_metrics():
    tools = {"search": lambda query: "Doc 1(Title: X) The code is 7.\n"}
    groups = run(ScriptedEngine(searcher), ["Alice?", "Bob?"], tools, n=2)
    rows = [{"prompt": "Alice?", "answer": "7"}, {"prompt": "Bob?", "answer": "7"}]
    rollout = trajectories_to_rollout(rows, groups, CharTokenizer())
    t = rollout.tensors
    assert t["response_mask"].shape == t["response_attention_mask"].shape
    assert torch.equal(t["response_mask"] <= t["response_attention_mask"], torch.ones_like(t["response_mask"], dtype=torch.bool))
    assert (t["response_mask"] != t["response_attention_mask"]).any()
    assert rollout.columns["final_answer"] == ["7"] * 4 and rollout.columns["turns"] == [2] * 4
    assert rollout.samples[0].endswith("<answer>7</answer>")
    m = multi_turn_metrics(t)
    assert m["rollout/turns_mean"] == 2 and m["rollout/tool_calls_mean"] == 1 and m["rollout/truncated_frac"] == 0
    assert m["rollout/observation_tokens_mean"] == t["observation_tokens"][0] > 0 and m["rollout/tool_errors"] == 0


def test_max_observation_tokens_cuts_each_result_inside_the_format_and_counts_it():
    long = "Doc 1(Title: X) " + "abcdefghij" * 5  # 66 characters = 66 tokens of the character tokenizer
    tools = {"search": lambda query: long if "long" in query else "short"}
    script = lambda ctx: "<answer>a</answer>" if "<information>" in ctx else "<search>" + ctx.split("?")[0] + "</search>"  # noqa: E731
    groups = run(ScriptedEngine(script), ["long?", "short?"], tools, max_observation_tokens=20, truncated_text="~cut")
    cut, kept = groups[0][0], groups[1][0]
    text = "".join(chr(i) for i in cut.ids)
    # by hand: the first 20 characters of the result, the marker, then the format's closing tag
    assert "<information>Doc 1(Title: X) abcd~cut</information>" in text
    assert cut.observation_tokens == len("\n\n<information>Doc 1(Title: X) abcd~cut</information>\n\n")
    assert (cut.observations_truncated, kept.observations_truncated) == (1, 0)
    assert "<information>short</information>" in "".join(chr(i) for i in kept.ids)
    # a result of exactly the cap is kept whole; no cap keeps everything
    exact = run(ScriptedEngine(script), ["long?"], {"search": lambda query: long[:20]}, max_observation_tokens=20)[0][0]
    assert exact.observations_truncated == 0 and long[:20] + "</information>" in "".join(chr(i) for i in exact.ids)
    whole = run(ScriptedEngine(script), ["long?"], tools)[0][0]
    assert whole.observations_truncated == 0 and long + "</information>" in "".join(chr(i) for i in whole.ids)
    rows = [{"prompt": "long?"}, {"prompt": "short?"}]
    assert multi_turn_metrics(trajectories_to_rollout(rows, groups, CharTokenizer()).tensors)["rollout/observations_truncated"] == 1


def test_call_format_names_a_users_format_class(tmp_path):
    from unirl.text.config import RolloutConfig, ToolConfig
    from unirl.text.multiturn_rollout import build_tools
    from unirl.tools import ToolError
    from unirl.tools.formats import CALL_FORMATS, resolve_call_format

    (tmp_path / "fmt.py").write_text(
        "from unirl.tools.calling import ToolCall\n"
        "from unirl.tools.formats import CallFormat, Turn\n"
        "class Bang(CallFormat):\n"
        "    stop = ['!']\n"
        "    def parse(self, text):\n"
        "        return Turn(calls=[ToolCall('calculator', {'expression': text.rstrip('!')})]) if text.endswith('!') else Turn(answer=text)\n"
        "    def observation(self, results, ended_with_eos):\n"
        "        return '=' + results[0] + ';'\n"
        "def not_a_format():\n"
        "    pass\n")
    cfg = RolloutConfig(tools=[ToolConfig(name="calculator")], call_format=f"{tmp_path}/fmt.py:Bang")
    fmt, runner = build_tools(cfg, CharTokenizer())
    try:
        t = multi_turn_generate(ScriptedEngine(lambda ctx: "done$" if "=" in ctx else "6*7!"), CharTokenizer(), fmt, runner,
                                [[ord("q")]], n=1, max_turns=3, max_new_tokens=16, max_total_tokens=None,
                                temperature=1.0)[0][0]
    finally:
        runner.close()
    assert "".join(chr(i) for i in t.ids if i > 1) == "6*7!=42;done" and t.loss_mask.count(0) == len("=42;")
    assert resolve_call_format("search_r1") is CALL_FORMATS.get("search_r1")
    with pytest.raises(ToolError, match=r"unknown call format 'serch_r1'\. Did you mean 'search_r1'"):
        resolve_call_format("serch_r1")
    with pytest.raises(ToolError, match="expected a subclass of unirl.tools.formats.CallFormat"):
        resolve_call_format(f"{tmp_path}/fmt.py:not_a_format")


def test_the_observation_cap_reads_a_bounded_head_of_a_huge_result():
    """A 4 MB result with max_observation_tokens=20 tokenizes at most (20 + 1) characters per token of
    its head (a character tokenizer: one character a token), not the 4 MB; the cut is as before."""
    seen = []

    class Counting(CharTokenizer):
        def __call__(self, text, add_special_tokens=False):
            seen.append(len(text))
            return super().__call__(text, add_special_tokens)

    huge = "abcdefghij" * 400_000
    script = lambda ctx: "<answer>a</answer>" if "<information>" in ctx else "<search>q</search>"  # noqa: E731
    runner = ToolRunner({"search": lambda query: huge}, timeout_s=5)
    try:
        t = multi_turn_generate(ScriptedEngine(script), Counting(), SearchR1Format(), runner, [[ord("q")]], n=1,
                                max_turns=3, max_new_tokens=64, max_total_tokens=None, temperature=1.0,
                                max_observation_tokens=20, truncated_text="~cut")[0][0]
    finally:
        runner.close()
    assert "<information>" + huge[:20] + "~cut</information>" in "".join(chr(i) for i in t.ids)
    assert t.observations_truncated == 1 and seen[0] == 21 and max(seen) < 100  # the head, then the observation


class _Broken(SearchR1Format):
    def __init__(self, where):
        super().__init__()
        self.where = where

    def parse(self, text):
        if self.where == "parse":
            raise KeyError("tag")
        return None if self.where == "parse-type" else super().parse(text)

    def observation(self, results, ended_with_eos):
        return ["not", "a string"] if self.where == "observation" else super().observation(results, ended_with_eos)


@pytest.mark.parametrize("where, match", [
    ("parse", r"call format _Broken: parse raised KeyError: 'tag'"),
    ("parse-type", r"call format _Broken: parse must return a unirl.tools.formats.Turn, got NoneType"),
    ("observation", r"call format _Broken: observation must return a string, got list"),
])
def test_a_users_call_format_that_fails_is_one_error_naming_it(where, match):
    from unirl.tools import ToolError

    runner = ToolRunner({"search": lambda query: "r"}, timeout_s=5)
    try:
        with pytest.raises(ToolError, match=match):
            multi_turn_generate(ScriptedEngine(searcher), CharTokenizer(), _Broken(where), runner,
                                [[ord(c) for c in "what is x?"]], n=1, max_turns=3, max_new_tokens=64,
                                max_total_tokens=None, temperature=1.0)
    finally:
        runner.close()
