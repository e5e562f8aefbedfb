"""Tools (unirl/tools/): named like rewards, called concurrently with timeouts and errors turned into
observations, and the two call formats."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from unirl.tools import ToolError, list_tools, load_tool, tool_name
from unirl.tools.calculator import calculator
from unirl.tools.calling import ToolCall, ToolRunner
from unirl.tools.formats import CALL_FORMATS, HermesFormat, SearchR1Format


# ------------------------------------------------------------------ naming and loading
def test_builtins_are_listed_with_their_source():
    names = {t.name: t for t in list_tools()}
    assert {"search", "calculator"} <= set(names)
    assert names["calculator"].source == "built-in"


def test_rewards_and_tools_share_one_registry_type_and_resolver():
    from unirl.plugins import Plugins
    from unirl.rewards.registry import REWARDS
    from unirl.tools.registry import TOOLS

    assert type(REWARDS) is type(TOOLS) is Plugins
    assert (REWARDS.group, TOOLS.group) == ("unirl.rewards", "unirl.tools")


def test_a_broken_tool_file_is_a_tool_error_naming_the_tool(tmp_path):
    # The resolver was the rewards': a tool file with a syntax error came out as "reward ...: syntax error".
    path = tmp_path / "broken_tool.py"
    path.write_text("def lookup(key:\n    return key\n")
    with pytest.raises(ToolError, match=rf"^tool '{path}:lookup': {path}:1: syntax error: "):
        load_tool(f"{path}:lookup")
    raising = tmp_path / "raising_tool.py"
    raising.write_text("raise RuntimeError('no index')\n")
    with pytest.raises(ToolError, match=rf"^tool '{raising}:f': importing {raising} failed: RuntimeError: no index$"):
        load_tool(f"{raising}:f")


def test_file_and_module_specs_and_kwargs_bind(tmp_path):
    path = tmp_path / "lookup.py"
    path.write_text("def lookup(key, *, table='x'):\n    return f'{table}:{key}'\n")
    tool = load_tool(f"{path}:lookup", table="codes")
    assert tool(key="alice") == "codes:alice"
    assert tool_name(f"{path}:lookup") == "lookup"
    assert load_tool("unirl.tools.calculator:calculator")(expression="1+1") == "2"


def test_unknown_tool_bad_kwarg_missing_file_are_named(tmp_path):
    with pytest.raises(ToolError, match="unknown tool 'serch'.*Did you mean 'search'"):
        load_tool("serch")
    with pytest.raises(ToolError, match="tool 'search' has no parameter 'topk'.*Did you mean 'top_k'"):
        load_tool("search", corpus="x.jsonl", topk=3)
    with pytest.raises(ToolError, match="tool 'calculator' has no parameter 'precision'"):
        load_tool("calculator", precision=3)
    with pytest.raises(ToolError, match="file not found"):
        load_tool(f"{tmp_path}/nope.py:fn")


def test_entry_point_tool_is_loaded_by_name(monkeypatch):
    import importlib.metadata as md

    from unirl.tools import registry

    ep = md.EntryPoint(name="echo_tool", value="tests.fixtures_tools_echo:echo", group="unirl.tools")
    monkeypatch.setattr(md, "entry_points", lambda group=None: [ep] if group == "unirl.tools" else [])
    monkeypatch.setattr(ep.__class__, "load", lambda self: (lambda text: text.upper()), raising=False)
    monkeypatch.setattr(registry.TOOLS, "entry_points_seen", set())
    monkeypatch.setattr(registry.TOOLS, "info", dict(registry.TOOLS.info))
    monkeypatch.setattr(registry.TOOLS, "_items", dict(registry.TOOLS._items))
    assert load_tool("echo_tool")(text="hi") == "HI"
    assert "entry point" in registry.TOOLS.info["echo_tool"].source


# ------------------------------------------------------------------ calculator
@pytest.mark.parametrize("expr, expected", [("2*(3+4)/7", "2"), ("-3 + 2**10", "1021"), ("7 // 2 + 7 % 2", "4"),
                                            ("1/4", "0.25")])
def test_calculator(expr, expected):
    assert calculator(expr) == expected


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "x + 1", "9**9**9", "(1).real", "1/0"])
def test_calculator_refuses_what_is_not_safe_arithmetic(expr):
    with pytest.raises((ValueError, ZeroDivisionError)):
        calculator(expr)


# ------------------------------------------------------------------ calling
def test_errors_become_counted_observations_and_the_run_goes_on():
    async def slow(x):
        await asyncio.sleep(5)
        return "late"

    def boom(x):
        raise RuntimeError("disk on fire")

    runner = ToolRunner({"slow": slow, "boom": boom, "num": lambda x: 3, "ok": lambda x: f"<{x}>"},
                        timeout_s=0.2, error_text="[error: {error}]")
    results = runner.run([ToolCall("ok", {"x": 1}), ToolCall("slow", {"x": 1}), ToolCall("boom", {"x": 1}),
                          ToolCall("num", {"x": 1}), ToolCall("nope", {}), ToolCall(None, error="unparsable call: x"),
                          ToolCall("ok", {"y": 2})])
    assert results[0].text == "<1>" and results[0].error is None
    assert "timed out after 0.2 s" in results[1].error and results[1].text.startswith("[error: tool 'slow' timed out")
    assert "RuntimeError: disk on fire" in results[2].error
    assert "returned a int, not a string" in results[3].error
    assert "unknown tool 'nope'" in results[4].error
    assert results[5].text == "[error: unparsable call: x]"
    assert "TypeError" in results[6].error  # a wrong argument name is the tool raising
    runner.close()


def test_a_slow_tool_called_32_times_takes_about_one_call():
    """32 calls of a 0.5 s tool, sync and async, 32 at a time: far less than 32 x 0.5 s. The bound is
    generous (no timing assert in the strict sense: 16 s is what running them one by one would take)."""
    def sync_slow(q):
        time.sleep(0.5)
        return q

    async def async_slow(q):
        await asyncio.sleep(0.5)
        return q

    for fn in (sync_slow, async_slow):
        runner = ToolRunner({"t": fn}, timeout_s=30, max_concurrency=32)
        start = time.perf_counter()
        results = runner.run([ToolCall("t", {"q": str(i)}) for i in range(32)])
        elapsed = time.perf_counter() - start
        assert [r.text for r in results] == [str(i) for i in range(32)]
        assert elapsed < 8.0, f"{fn.__name__}: 32 calls took {elapsed:.1f} s: not concurrent"
        runner.close()


def test_concurrency_is_bounded():
    live, peak, lock = [0], [0], threading.Lock()

    def tool(q):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        return q

    runner = ToolRunner({"t": tool}, max_concurrency=3)
    runner.run([ToolCall("t", {"q": "a"}) for _ in range(12)])
    assert peak[0] == 3
    runner.close()


# ------------------------------------------------------------------ formats
def test_search_r1_format():
    fmt = CALL_FORMATS.get("search_r1")()
    turn = fmt.parse("<think>who?</think>\n<search> code of Alice </search>")
    assert [(c.name, c.arguments) for c in turn.calls] == [("search", {"query": "code of Alice"})]
    assert fmt.parse("I know. <answer> 4821 </answer>").answer == "4821"
    assert fmt.parse("no tags at all").calls == [] and fmt.parse("no tags at all").answer is None
    bad = fmt.parse("<search>code of")
    assert bad.calls[0].error.startswith("unparsable call")
    assert fmt.observation(["Doc 1(Title: A) x\n"], True) == "\n\n<information>Doc 1(Title: A) x</information>\n\n"
    assert "</search>" in SearchR1Format.stop and "</answer>" in SearchR1Format.stop


# A chat template in Qwen2.5's layout, re-typed here: tool results become a user turn of
# <tool_response> blocks, consecutive ones joined.
QWEN_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


class _TemplateOnly:
    chat_template = QWEN_LIKE
    eos_token = "<|im_end|>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        import jinja2

        return jinja2.Environment().from_string(self.chat_template).render(messages=messages,
                                                                         add_generation_prompt=add_generation_prompt)


def test_hermes_format_parses_calls_and_renders_tool_messages_with_the_template():
    fmt = HermesFormat(_TemplateOnly())
    text = ('<tool_call>\n{"name": "search", "arguments": {"query": "Alice"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"}</tool_call><|im_end|>')
    turn = fmt.parse(text)
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("search", {"query": "Alice"}, None), ("calculator", {"expression": "1+2"}, None)]
    assert fmt.observation(["A", "3"], ended_with_eos=True) == (
        "\n<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert fmt.observation(["A"], ended_with_eos=False).startswith("<|im_end|>\n<|im_start|>user")
    assert fmt.parse("<tool_call>{not json}</tool_call>").calls[0].error.startswith("unparsable call: not JSON")
    assert fmt.parse('<tool_call>{"arguments": {}}</tool_call>').calls[0].error.startswith("unparsable call")
    assert fmt.parse("It is <answer>4821</answer>").answer == "4821"


def test_hermes_on_a_base_model_shows_each_result_as_hermes_tool_response_block():
    """A tokenizer without a chat template (the tiny toys, a base model): the run stopped at its start; now each
    result is the block the templates put inside their tool turn (above: ``<tool_response>\\nA\\n</tool_response>``)."""
    class NoTemplate:
        chat_template = None
        eos_token = "<eos>"

    fmt = HermesFormat(NoTemplate())
    assert fmt.observation(["A", "3"], ended_with_eos=False) == (
        "\n<tool_response>\nA\n</tool_response>\n\n<tool_response>\n3\n</tool_response>\n")
    assert fmt.parse('<tool_call>{"name": "define", "arguments": {"word": "epoch"}}</tool_call>').calls[0].arguments == {
        "word": "epoch"}
    with pytest.raises(ValueError, match="needs the policy's tokenizer"):
        HermesFormat(None)


# ------------------------------------------------------------------ bad results and bad settings (issue 37)
def test_a_result_with_lone_surrogates_is_valid_text_for_the_tokenizer():
    runner = ToolRunner({"bad": lambda q: "a\udc80b", "pair": lambda q: "\ud83d\ude00"}, timeout_s=5)
    bad, pair = runner.run([ToolCall("bad", {"q": 1}), ToolCall("pair", {"q": 1})])
    runner.close()
    assert bad.text == "a\ufffdb" and bad.error is None
    assert pair.text == "\U0001F600"
    bad.text.encode("utf-8")  # what a tokenizer or a JSON log does with it


@pytest.mark.parametrize("key, value, match", [
    ("max_turns", 0, "rollout: max_turns must be >= 1, got 0"),
    ("tool_concurrency", -2, "rollout: tool_concurrency must be >= 1, got -2"),
    ("tool_timeout_s", 0, "rollout: tool_timeout_s must be > 0, got 0"),
    ("max_total_tokens", -1, "rollout: max_total_tokens must be >= 1 or null, got -1"),
    ("tool_error_text", "'Error: {err}'", r"rollout: tool_error_text 'Error: \{err\}': only the placeholder \{error\}"),
    ("tool_error_text", "'Error: {'", "rollout: tool_error_text 'Error: {': only the placeholder"),
])
def test_tool_settings_out_of_range_are_refused_at_load_naming_the_key(key, value, match):
    from unirl.cli import load_run_config
    from unirl.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_run_config("text", "tiny_search", [f"rollout.{key}={value}"])
    with pytest.raises(ValueError, match="only the placeholder"):
        ToolRunner({}, error_text="{oops}")
