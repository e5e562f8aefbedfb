"""How tool calls and their observations look in the text, one class per format (``rollout.call_format``).

A format says where a turn should stop (``stop``), what a finished turn asks for (``parse``: an
answer, calls, or nothing) and what text follows it (``observation``: the tools' outputs wrapped as
the model was taught to read them). A new format is one class registered in ``CALL_FORMATS``.

- ``search_r1``: Search-R1's tags (https://github.com/PeterGriffinJin/Search-R1,
  ``search_r1/llm_agent/generation.py``): the model writes ``<search>query</search>`` and is shown
  ``\\n\\n<information>{passages}</information>\\n\\n``; ``<answer>...</answer>`` ends the episode.
  Only the ``search`` tool is called this way.
- ``hermes``: the chat template's tool calls (Qwen2.5, Hermes): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, as many as the turn holds; each result becomes a ``tool`` message rendered by
  the tokenizer's own chat template, followed by its generation prompt.

A format of your own subclasses ``CallFormat``; ``rollout.call_format`` names it as a registered name
(``@CALL_FORMATS.register("mine")`` in a module imported first), ``path/file.py:Class`` or
``package.module:Class``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from unirl.registry import Registry
from unirl.tools.calling import ToolCall

CALL_FORMATS: Registry[type] = Registry("call format")

#: The stand-in assistant message whose end marks where the observation text starts.
_MARK = "<<unirl: end of the assistant's turn>>"


@dataclass
class Turn:
    """What one generated turn asks for."""

    calls: list[ToolCall] = field(default_factory=list)
    #: The final answer, when the turn gave one (the episode ends).
    answer: str | None = None


class CallFormat:
    """The interface; ``tokenizer`` is the policy's (a format that renders messages needs it)."""

    #: Strings at which generation stops so the calls can run (kept in the output).
    stop: list[str] = []
    #: The tool names this format can write a call to; None: any (the call names its tool).
    callable_tools: tuple[str, ...] | None = None

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def parse(self, text: str) -> Turn:
        raise NotImplementedError

    def observation(self, results: list[str], ended_with_eos: bool) -> str:
        """The text the model is shown after a turn whose calls returned ``results`` (in call order)."""
        raise NotImplementedError


def resolve_call_format(spec: str) -> type[CallFormat]:
    """The ``CallFormat`` subclass ``rollout.call_format`` names: a registered name, or
    ``path/file.py:Class`` / ``package.module:Class`` (registered or not)."""
    from unirl.plugins import resolve_object
    from unirl.tools.registry import ToolError

    if ":" not in spec:
        if spec not in CALL_FORMATS:
            raise ToolError(f"rollout.call_format: {CALL_FORMATS.unknown_message(spec)}. Or give path/file.py:Class "
                            f"or package.module:Class naming a CallFormat subclass")
        return CALL_FORMATS.get(spec)
    cls = resolve_object(spec, kind="call format", error=ToolError)
    if not (isinstance(cls, type) and issubclass(cls, CallFormat)):
        raise ToolError(f"rollout.call_format {spec!r}: expected a subclass of unirl.tools.formats.CallFormat, "
                        f"got {cls!r}")
    return cls


def uncallable_tools(fmt: type[CallFormat], names: list[str]) -> list[str]:
    """The tool names among ``names`` that ``fmt`` never calls (every call to them would be missing)."""
    allowed = fmt.callable_tools
    return [] if allowed is None else [n for n in names if n not in allowed]


def check_callable(fmt: type[CallFormat], names: list[str], spec: str) -> None:
    """Raise ``ToolError`` when ``rollout.call_format`` cannot call one of the configured tools."""
    from unirl.tools.registry import ToolError

    missing = uncallable_tools(fmt, names)
    if missing:
        raise ToolError(f"rollout.call_format {spec!r} only calls {', '.join(map(repr, fmt.callable_tools))}, so the "
                        f"tool(s) {', '.join(map(repr, missing))} would never be called: use call_format: hermes (the "
                        f"call names its tool), a CallFormat of your own, or name the tool {fmt.callable_tools[0]!r}")


@CALL_FORMATS.register("search_r1")
class SearchR1Format(CallFormat):
    stop = ["</search>", "</answer>"]
    callable_tools = ("search",)
    _ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
    #: Search-R1's observation for a turn with neither a search nor an answer in its tags.
    INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
               "</search>. If I want to give the final answer, I should put the answer between <answer> and "
               "</answer>. Let me try again.\n")

    def parse(self, text: str) -> Turn:
        match = self._ACTION.search(text)  # the first action of the turn, as Search-R1 takes it
        if match is None:
            if "<search>" in text:  # an opened but unfinished call: shown the error, counted
                return Turn(calls=[ToolCall(None, error=f"unparsable call: {text[text.index('<search>'):][:80]!r}")])
            return Turn()
        if match.group(1) == "answer":
            return Turn(answer=match.group(2).strip())
        return Turn(calls=[ToolCall("search", {"query": match.group(2).strip()})])

    def observation(self, results: list[str], ended_with_eos: bool) -> str:
        return "".join(f"\n\n<information>{r.strip()}</information>\n\n" for r in results)


@CALL_FORMATS.register("hermes")
class HermesFormat(CallFormat):
    """Hermes' tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the model's text, the
    results rendered as ``tool`` messages by the tokenizer's chat template. A tokenizer without a chat template
    (a base model, the tiny toys) gets each result as Hermes' own ``<tool_response>`` block, the text Qwen2.5's
    and Hermes-2-Pro's templates put inside their tool turn, without the turn's markup."""

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        if tokenizer is None:
            raise ValueError("rollout.call_format='hermes' needs the policy's tokenizer (its chat template renders "
                             "the tool messages)")

    def parse(self, text: str) -> Turn:
        calls = [self._call(body) for body in self._CALL.findall(text)]
        if not calls and "<tool_call>" in text:
            calls = [ToolCall(None, error=f"unparsable call (no </tool_call>): {text[text.index('<tool_call>'):][:80]!r}")]
        if calls:
            return Turn(calls=calls)
        answer = self._ANSWER.findall(text)
        return Turn(answer=answer[-1].strip() if answer else None)

    @staticmethod
    def _call(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            return ToolCall(None, error=f"unparsable call: not JSON ({err.msg}): {body.strip()[:80]!r}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall(None, error=f"unparsable call: expected {{\"name\": ..., \"arguments\": {{...}}}}, got {body.strip()[:80]!r}")
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return ToolCall(obj["name"], error=f"unparsable call: arguments must be an object, got {arguments!r:.80}")
        return ToolCall(obj["name"], arguments)

    def observation(self, results: list[str], ended_with_eos: bool) -> str:
        """The template's rendering of the tool messages and the next generation prompt: rendered after a
        stand-in user/assistant exchange, minus that exchange, so a template that adds a default system
        prompt to a conversation adds it to neither."""
        if not getattr(self.tokenizer, "chat_template", None):  # a base model: Hermes' blocks as plain text
            return "".join(f"\n<tool_response>\n{r}\n</tool_response>\n" for r in results)
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
        tools = [{"role": "tool", "content": r} for r in results]
        prefix = self.tokenizer.apply_chat_template(base, tokenize=False)
        full = self.tokenizer.apply_chat_template(base + tools, tokenize=False, add_generation_prompt=True)
        end = prefix.index(_MARK) + len(_MARK)
        if not full.startswith(prefix[:end]):
            raise ValueError("the chat template renders a conversation differently once tool messages follow; "
                             "call_format='hermes' cannot append tool results to it")
        text = full[end:]  # the assistant's end of turn, then the tool messages
        eos = self.tokenizer.eos_token or ""
        if ended_with_eos and eos and text.startswith(eos):
            text = text[len(eos):]  # the model already wrote it
        return text
