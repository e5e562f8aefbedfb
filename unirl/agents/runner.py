"""The episode runner: many episodes of a stateful environment played at once against a rollout engine.

Each episode is an asyncio task of its own::

    episode = make(row); prompt = encode(episode.reset() or row["prompt"])
    for turn in 1 .. max_turns:
        turn_ids = await batcher.generate(prompt + ids)     # trained: mask 1, the engine's log-probs
        answer = episode.step(decode(turn_ids))              # reward on the turn's last token
        if answer.done / answer.truncated / the turn was cut / turn == max_turns: over
        ids += turn_ids + tokens(wrap(answer.observation))   # conditioned on: mask 0, never trained
    episode.close()                                          # always: end, error, timeout, the run stopping

as ``unirl/text/multiturn.py`` plays tool calls: the observation is tokenized on its own and appended,
so the trained tokens are exactly those sampled; ``max_total_tokens`` bounds prompt + response;
observations longer than ``max_observation_tokens`` are cut (``turn_limits`` gives the four limits).

The turns of the episodes go to the engine together (``TurnBatcher``): an episode asks for its turn and
waits; once every episode still playing is waiting, their requests are one ``engine.generate`` call.
While some wait on their environment (an HTTP call, a subprocess), the others' requests wait with
them, so the batches are those of a lock-step loop and a run is reproducible. The batcher is the one
place that decides when a batch goes: sending the ready requests early (and the engine in a thread of
its own) lets generation overlap the environments' I/O, without changing the episodes' code.

An environment's failure ends only its episode (``unirl/agents/calls.py``); the engine's, or a first
observation too long for ``data.max_prompt_length``, stops the run: every open episode is closed first.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from unirl.agents.calls import EnvFailure, guarded, run_coroutine
from unirl.agents.protocol import EpisodeError, checked_step
from unirl.agents.observations import cap_text, longest_token_chars


@dataclass
class EpisodeTrace:
    """One episode: its prompt, its response over all turns (observations masked) and what it earned."""

    prompt: str = ""  # the first observation (the row's prompt when reset gave none or failed)
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: generated (trained), 0: observation
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 at observations
    #: Per turn: the environment's reward (0.0 where it gave none) and the index in ``ids`` of the turn's
    #: last generated token (the turn's end; -1 for a turn that generated nothing).
    turn_rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turns: int = 0
    #: Ended by the environment (``Step.done``).
    done: bool = False
    #: Cut: by the environment (``Step.truncated``), by max_turns, a turn's max_new_tokens,
    #: max_total_tokens, or an error.
    truncated: bool = False
    #: What went wrong (an environment's error or timeout), None when nothing did.
    error: str | None = None
    timed_out: bool = False
    #: close() failed or timed out (the episode was over: its tokens are trained as usual).
    close_error: str | None = None
    observations_truncated: int = 0
    #: Seconds spent in the environment's reset and steps, and the number of steps.
    env_seconds: float = 0.0
    steps: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # the last step's

    @property
    def episode_return(self) -> float:
        return sum(self.turn_rewards)

    @property
    def observation_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)


def run_episodes(engine, tokenizer, make: Callable[[dict], Any], rows: list[dict], *, encode: Callable[[str], list[int]],
                 n: int, max_turns: int, max_new_tokens: int, max_total_tokens: int | None, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False, max_observation_tokens: int | None = None,
                 truncated_text: str = " ...(truncated)", step_timeout_s: float = 30.0, concurrency: int = 64,
                 wrap_observation: Callable[[str, bool], str] | None = None, stop: list[str] | None = None,
                 name: str = "environment") -> list[list[EpisodeTrace]]:
    """``n`` episodes per row (1 when ``greedy``), grouped by row like ``engine.generate``'s samples.

    ``make(row)`` makes an episode (``unirl.agents.load_environment``); ``encode(text)`` turns its first
    observation into prompt ids (the chat template, the prompt-length check); ``wrap_observation(text,
    eos)`` what the policy is shown of a later observation after a turn that ended with EOS or not
    (default: the text as it is); ``stop`` ends a turn besides EOS. At most ``concurrency`` calls into the
    environment run at once, each at most ``step_timeout_s`` seconds."""
    n = 1 if greedy else n
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, stop=stop)
    limits = dict(max_turns=max_turns, max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens,
                  max_observation_tokens=max_observation_tokens, truncated_text=truncated_text, stop=stop or [],
                  chars_per_token=longest_token_chars(tokenizer) if max_observation_tokens is not None else 0)
    play = _Players(engine, tokenizer, make, encode, sampling, limits, step_timeout_s, concurrency,
                    wrap_observation or (lambda text, eos: text), name)
    traces = run_coroutine(play.all([row for row in rows for _ in range(n)]))
    return [traces[i * n:(i + 1) * n] for i in range(len(rows))]


class TurnBatcher:
    """The turns of many episodes, sent to the engine together (the module doc says when)."""

    def __init__(self, engine, sampling: dict, live: int):
        self.engine, self.sampling, self.live = engine, sampling, live
        self.pending: list[tuple[int, list[int], int, asyncio.Future]] = []  # (episode, context, budget, answer)

    async def generate(self, index: int, context: list[int], budget: int):
        """The episode's next turn (a ``Generation``, its tokens at most ``max(budgets)``)."""
        answer = asyncio.get_running_loop().create_future()
        self.pending.append((index, context, budget, answer))
        self._send_when_ready()
        return await answer

    def leave(self) -> None:
        """An episode is over: the others no longer wait for it."""
        self.live -= 1
        self._send_when_ready()

    def _send_when_ready(self) -> None:
        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = sorted(self.pending, key=lambda p: p[0]), []
        try:
            gens = self._generate([p[1] for p in batch], max(p[2] for p in batch))
        except BaseException as err:  # the engine's failure stops the run: every waiting episode gets it
            for *_, answer in batch:
                answer.set_exception(err)
            return
        for (*_, answer), gen in zip(batch, gens):
            answer.set_result(gen)

    def _generate(self, contexts: list[list[int]], max_new_tokens: int) -> list:
        """One engine call; runs of k equal contexts (a group's first turn) as one request with n = k,
        so vLLM shares the prompt's prefill, when every run has the same k."""
        runs = [1]
        for a, b in zip(contexts, contexts[1:]):
            runs[-1:] = [runs[-1] + 1] if a == b else [runs[-1], 1]
        k = runs[0]
        if k > 1 and all(r == k for r in runs):
            unique = contexts[::k]
            return [g for gs in self.engine.generate(unique, n=k, max_new_tokens=max_new_tokens, **self.sampling)
                    for g in gs]
        return [gs[0] for gs in self.engine.generate(contexts, n=1, max_new_tokens=max_new_tokens, **self.sampling)]


class _Players:
    """The episodes of one ``run_episodes`` call, each played by ``play``."""

    def __init__(self, engine, tokenizer, make, encode, sampling, limits, timeout_s, concurrency, wrap, name):
        self.engine, self.tokenizer, self.make, self.encode = engine, tokenizer, make, encode
        self.sampling, self.limits, self.timeout_s, self.wrap, self.name = sampling, limits, timeout_s, wrap, name
        self.concurrency = concurrency

    async def all(self, rows: list[dict]) -> list[EpisodeTrace]:
        self.calls = asyncio.Semaphore(self.concurrency)
        self.batcher = TurnBatcher(self.engine, self.sampling, live=len(rows))
        tasks = [asyncio.ensure_future(self.play(i, row)) for i, row in enumerate(rows)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # the run stops: the other episodes end (and are closed) before it does
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def play(self, index: int, row: dict) -> EpisodeTrace:
        trace, episode = EpisodeTrace(), None
        try:
            episode = await self.call(trace, self.make, row, what="making the episode")
            first = await self.call(trace, episode.reset, what="reset()")
            if first is not None and not isinstance(first, str):
                raise EnvFailure(f"reset() returned a {type(first).__name__}, not a string or None")
            trace.prompt = row["prompt"] if first is None else first
            trace.prompt_ids = self._prompt(index, trace.prompt)
            await self.turns(index, episode, trace)
        except EnvFailure as failure:
            trace.error, trace.timed_out, trace.truncated = failure.what, failure.timed_out, True
            print(f"unirl: {self.name}: episode {index} ({_row_name(row)}) ended at turn {trace.turns}: {failure.what}",
                  file=sys.stderr, flush=True)
        finally:
            self.batcher.leave()
            if not trace.prompt_ids:  # reset failed: the row's prompt stands for it
                trace.prompt = row["prompt"]
                trace.prompt_ids = self._prompt(index, trace.prompt)
            if episode is not None and callable(getattr(episode, "close", None)):
                await self.close(index, row, episode, trace)
        return trace

    async def turns(self, index: int, episode, trace: EpisodeTrace) -> None:
        lim = self.limits
        for turn in range(1, lim["max_turns"] + 1):
            budget = lim["max_new_tokens"] if lim["max_total_tokens"] is None else \
                min(lim["max_new_tokens"], lim["max_total_tokens"] - len(trace.prompt_ids) - len(trace.ids))
            if budget <= 0:  # no room left for another turn
                trace.truncated = True
                return
            gen = await self.batcher.generate(index, trace.prompt_ids + trace.ids, budget)
            ids = list(gen.response_ids[:budget])
            trace.ids += ids
            trace.loss_mask += [1] * len(ids)
            trace.logprobs += list(gen.logprobs[:budget])
            trace.turns += 1
            eos = gen.finished and len(ids) == len(gen.response_ids)
            action = self.tokenizer.decode(ids, skip_special_tokens=True)
            stopped = eos or any(action.endswith(s) for s in lim["stop"])
            answer = await self.call(trace, episode.step, action, what=f"step() of turn {turn}")
            try:
                step = checked_step(answer)
            except EpisodeError as err:  # the environment broke the contract: this episode ends
                raise EnvFailure(f"turn {turn}: {err}") from None
            trace.steps += 1
            trace.info = dict(step.info)
            trace.turn_rewards.append(float(step.reward or 0.0))
            trace.turn_ends.append(len(trace.ids) - 1 if ids else -1)  # an empty turn has no token to hold it
            if step.done or step.truncated or not stopped:  # a turn cut mid-way is truncated, whatever the answer
                trace.done, trace.truncated = step.done and not step.truncated, step.truncated or not stopped
                return
            if turn == lim["max_turns"]:  # no turn left to answer the observation
                trace.truncated = True
                return
            self._observe(trace, step.observation, eos)
            if trace.truncated:
                return

    def _observe(self, trace: EpisodeTrace, observation: str, eos: bool) -> None:
        lim = self.limits
        text = cap_text(self.tokenizer, observation, lim["max_observation_tokens"], lim["truncated_text"],
                       lim["chars_per_token"])
        trace.observations_truncated += text != observation
        obs = self.tokenizer(self.wrap(text, eos), add_special_tokens=False).input_ids
        if lim["max_total_tokens"] is not None:
            room = lim["max_total_tokens"] - len(trace.prompt_ids) - len(trace.ids)
            if len(obs) >= room:  # no room to answer after it: cut, and the episode ends here
                obs, trace.truncated = obs[:max(room, 0)], True
        trace.ids += obs
        trace.loss_mask += [0] * len(obs)
        trace.logprobs += [0.0] * len(obs)

    async def call(self, trace: EpisodeTrace, fn, *args, what: str):
        async with self.calls:
            start = time.perf_counter()
            try:
                return await guarded(fn, *args, what=what, timeout_s=self.timeout_s)
            finally:
                trace.env_seconds += time.perf_counter() - start

    async def close(self, index: int, row: dict, episode, trace: EpisodeTrace) -> None:
        """``episode.close()``, also when the run is being cancelled; a failure is one line and counted
        (the episode's tokens stay: it was over)."""
        try:
            await asyncio.shield(self.call(trace, episode.close, what="close()"))
        except EnvFailure as failure:
            trace.close_error = failure.what
            print(f"unirl: {self.name}: episode {index} ({_row_name(row)}): {failure.what}", file=sys.stderr, flush=True)
        except asyncio.CancelledError:
            pass

    def _prompt(self, index: int, text: str) -> list[int]:
        try:
            return list(self.encode(text))
        except ValueError as err:
            raise ValueError(f"{self.name}: episode {index}'s first observation: {err}") from err


def _row_name(row: dict) -> str:
    prompt = str(row.get("prompt", ""))
    return f"prompt {prompt[:40]!r}" + ("..." if len(prompt) > 40 else "")
