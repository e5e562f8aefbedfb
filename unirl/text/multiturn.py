"""The multi-turn rollout (``rollout.tools``): generate until a tool call or the end, run the calls of
the whole batch together, append the observation, go on.

For each of the N = B*G samples::

    context = prompt
    for turn in 1 .. max_turns:
        turn_ids = engine.generate(context, stop=format.stop)     # trained: mask 1, engine log-probs
        parsed = format.parse(decode(turn_ids))
        if an answer, no call, or the turn was cut by max_new_tokens: done
        if turn == max_turns: done, truncated (it still wanted a tool)
        observation = format.observation(run(parsed.calls))       # conditioned on: mask 0, never trained
        context += turn_ids + tokens(observation)

Every turn of every active sample is one ``engine.generate`` call (vLLM keeps the earlier turns in
its prefix cache, so a turn computes only its new tokens), and every call of a turn of the batch
goes to the ``ToolRunner`` at once (concurrent, bounded, with a timeout). ``max_total_tokens`` bounds
prompt + response (observations included): a sample that reaches it is cut there and truncated.

The response of a sample is ``turn_1 obs_1 turn_2 obs_2 ... turn_k``; ``loss_mask`` is 0 on the
observations. The observation is tokenized on its own and appended, so the tokens the policy is
trained on are exactly those it generated and saw (re-tokenizing the joined text could merge tokens
across the boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unirl.agents.observations import cap_text, longest_token_chars
from unirl.tools.calling import ToolRunner
from unirl.tools.formats import CallFormat, Turn
from unirl.tools.registry import ToolError


@dataclass
class Trajectory:
    """One sample's response over all its turns."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: generated (trained), 0: tool observation
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 at observations
    turns: int = 0
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments", "error"} of each call
    tool_latency_s: float = 0.0
    #: Tool results cut at max_observation_tokens.
    observations_truncated: int = 0
    answer: str | None = None
    #: Ended by the model (an answer, or a turn with no call that ended with EOS or a stop string).
    finished: bool = False
    #: Cut by max_new_tokens, max_total_tokens, or max_turns while it still called tools.
    truncated: bool = False
    done: bool = False

    @property
    def observation_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    @property
    def tool_errors(self) -> int:
        return sum(c["error"] is not None for c in self.tool_calls)


def multi_turn_generate(engine, tokenizer, fmt: CallFormat, runner: ToolRunner, prompt_ids: list[list[int]], *,
                        n: int, max_turns: int, max_new_tokens: int, max_total_tokens: int | None,
                        temperature: float, top_p: float = 1.0, top_k: int = -1, greedy: bool = False,
                        max_observation_tokens: int | None = None,
                        truncated_text: str = " ...(truncated)") -> list[list[Trajectory]]:
    """``n`` trajectories per prompt (1 when ``greedy``), grouped by prompt like ``engine.generate``'s.
    A tool result longer than ``max_observation_tokens`` tokens is cut there and ends with
    ``truncated_text`` before the format wraps it."""
    n = 1 if greedy else n
    groups = [[Trajectory(list(p)) for _ in range(n)] for p in prompt_ids]
    flat = [t for g in groups for t in g]
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, stop=fmt.stop)
    chars_per_token = longest_token_chars(tokenizer) if max_observation_tokens is not None else 0
    for turn in range(1, max_turns + 1):
        active = [t for t in flat if not t.done]
        if not active:
            break
        budgets = [_budget(t, max_new_tokens, max_total_tokens) for t in active]
        for t, b in zip(active, budgets):
            if b <= 0:  # no room left for another turn
                t.done, t.truncated = True, True
        active = [t for t, b in zip(active, budgets) if b > 0]
        budgets = [b for b in budgets if b > 0]
        if not active:
            break
        if turn == 1:  # one request per prompt with n samples each: vLLM shares the prompt's prefill
            gens = [g for gs in engine.generate(prompt_ids, n=n, max_new_tokens=max(budgets), **sampling) for g in gs]
        else:
            gens = [gs[0] for gs in engine.generate([t.prompt_ids + t.ids for t in active], n=1,
                                                    max_new_tokens=max(budgets), **sampling)]
        pending = _read_turn(active, gens, budgets, tokenizer, fmt, last_turn=turn == max_turns)
        if pending:
            _observe(pending, runner, tokenizer, fmt, max_observation_tokens, truncated_text, chars_per_token,
                     max_total_tokens)
    return groups


def _read_turn(active: list[Trajectory], gens, budgets: list[int], tokenizer, fmt: CallFormat, *,
               last_turn: bool) -> list[tuple[Trajectory, list, bool]]:
    """Each active trajectory extended by its turn's generation (cut to its budget) and ended where the
    turn answered, was cut, called nothing, or called a tool with no turn left to read the result.
    Returns the others: (trajectory, its calls, whether the turn ended with EOS)."""
    pending = []
    for t, g, budget in zip(active, gens, budgets):
        ids, logps = list(g.response_ids[:budget]), list(g.logprobs[:budget])
        t.ids += ids
        t.loss_mask += [1] * len(ids)
        t.logprobs += logps
        t.turns += 1
        eos = g.finished and len(ids) == len(g.response_ids)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        stopped = eos or any(text.endswith(s) for s in fmt.stop)
        parsed = _parse(fmt, text)
        if parsed.answer is not None:
            t.answer, t.done, t.finished = parsed.answer, True, True
        elif not stopped:  # cut by max_new_tokens or max_total_tokens mid-turn
            t.done, t.truncated = True, True
        elif not parsed.calls:
            t.done, t.finished = True, True
        elif last_turn:  # it still wants a tool, and has no turn left to read the result
            t.done, t.truncated = True, True
        else:
            pending.append((t, parsed.calls, eos))
    return pending


def _observe(pending: list[tuple[Trajectory, list, bool]], runner: ToolRunner, tokenizer, fmt: CallFormat,
             max_observation_tokens: int | None, truncated_text: str, chars_per_token: int,
             max_total_tokens: int | None) -> None:
    """Every pending call of the batch run together; each result capped, wrapped by the format and
    appended to its trajectory as masked tokens (cut, and the sample ended, where no room is left)."""
    calls = [c for _, cs, _ in pending for c in cs]
    results = iter(runner.run(calls))
    for t, cs, eos in pending:
        mine = [next(results) for _ in cs]
        t.tool_calls += [{"name": c.name, "arguments": c.arguments, "error": r.error} for c, r in zip(cs, mine)]
        t.tool_latency_s += sum(r.latency_s for r in mine)
        texts = [cap_text(tokenizer, r.text, max_observation_tokens, truncated_text, chars_per_token) for r in mine]
        t.observations_truncated += sum(text != r.text for text, r in zip(texts, mine))
        obs = tokenizer(_observation(fmt, texts, eos), add_special_tokens=False).input_ids
        if max_total_tokens is not None:
            room = max_total_tokens - len(t.prompt_ids) - len(t.ids)
            if len(obs) >= room:  # no room to answer after it: cut, and the sample ends here
                obs, t.done, t.truncated = obs[:max(room, 0)], True, True
        t.ids += obs
        t.loss_mask += [0] * len(obs)
        t.logprobs += [0.0] * len(obs)


def _parse(fmt: CallFormat, text: str):
    """``fmt.parse(text)``, checked: a format's own failure is one error naming it."""
    try:
        parsed = fmt.parse(text)
    except Exception as err:
        raise ToolError(f"call format {type(fmt).__name__}: parse raised {type(err).__name__}: {err} "
                        f"(on a turn ending {text[-80:]!r})") from err
    if not isinstance(parsed, Turn):
        raise ToolError(f"call format {type(fmt).__name__}: parse must return a unirl.tools.formats.Turn, "
                        f"got {type(parsed).__name__}")
    return parsed


def _observation(fmt: CallFormat, texts: list[str], eos: bool) -> str:
    """``fmt.observation(...)``, checked: a format's own failure is one error naming it."""
    try:
        obs = fmt.observation(texts, eos)
    except Exception as err:
        raise ToolError(f"call format {type(fmt).__name__}: observation raised {type(err).__name__}: {err}") from err
    if not isinstance(obs, str):
        raise ToolError(f"call format {type(fmt).__name__}: observation must return a string, "
                        f"got {type(obs).__name__}")
    return obs


def _budget(t: Trajectory, max_new_tokens: int, max_total_tokens: int | None) -> int:
    if max_total_tokens is None:
        return max_new_tokens
    return min(max_new_tokens, max_total_tokens - len(t.prompt_ids) - len(t.ids))
