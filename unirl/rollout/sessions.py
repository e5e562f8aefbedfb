"""Training from your own agent (``source.agent``): the policy the run trains, served as an OpenAI-compatible
endpoint; every call of a session recorded token for token; the sessions your agent ends with a reward
become the batches (the feed of a ``unirl.rollout.stream.StreamSource``). docs/agents.md shows an agent.

**A session** is the calls that carry one id: the ``X-Unirl-Session`` header, else the request's ``user``
field (the ``openai`` client's ``user=``; a client that uses ``user`` for something else sends the header).
A call without either is answered and not recorded (``agent/unrecorded_calls``). A recorded call takes one
prompt and ``n = 1`` (run n sessions for n samples), at most ``source.agent.max_tokens`` new tokens and a
prompt of at most ``max_context_tokens``. What is kept of a call is exact: the prompt's token ids as the
server built them (the chat template, or the tokenizer on the completion's text), the sampled token ids,
their log-probs under the sampling distribution and the weight version that sampled them.

``POST /v1/sessions/{id}/reward`` ends a session: ``{"reward": float, "group": str, "columns": {...}}``.
``reward`` is what the ``session_reward`` reward gives (list it in the run's ``rewards``); without it the
run's rewards score the session's text with ``columns`` as the data row's (a registered reward function).
``group``: sessions that answer the same task (GRPO's group; default: sessions whose first prompt is the
same). A group is finished when ``trainer.group_size`` of its sessions are; each step trains on
``trainer.prompts_per_step`` finished groups. A session idle for ``session_timeout_s`` is dropped.

**One masked trajectory per session, cut where the tokens do not chain.** A call whose prompt begins with
the previous call's prompt and completion, token for token, continues the session's trajectory: the new
prompt tokens after that completion (the environment's answer, the next user message, the chat template's
framing) are appended as observations (masked out of the loss, as an environment's are) and its completion
as trained tokens. Why: the group's baseline then counts sessions, not calls (a session of four calls would
weigh four times in its group's mean as four samples); the shared context is one forward, not one per call;
and it is what unirl's own episodes train on. A call whose prompt does not begin that way (the agent
rewrote or summarised its history, re-tokenised the completion's text differently, dropped the end-of-turn
token the text does not show, or the chat template drops earlier reasoning) starts a new trajectory of the
same session: stitching it on would train its tokens under a context the sampler never saw. Each
trajectory is a sample of the session's group with the session's reward (``agent/prefix_breaks`` counts
the cuts, ``agent/samples_per_session`` their effect).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import Request  # at module level: FastAPI resolves the route's annotations from the globals

from unirl.env import Rollout
from unirl.rollout.engine import Generation
from unirl.rollout.batcher import TurnBatcher
from unirl.rollout.server import BadRequest, RolloutService, _json, make_app
from unirl.rollout.trajectories import Trajectory, padded

#: The environment variable holding the endpoint's token when ``source.agent.token`` is not set.
TOKEN_ENV = "UNIRL_AGENT_TOKEN"
SESSION_HEADER = "x-unirl-session"


@dataclass
class Call:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    version: int
    finished: bool  # ended with EOS (not cut at max_tokens)


@dataclass
class Session:
    id: str
    calls: list[Call] = field(default_factory=list)
    last: float = field(default_factory=time.monotonic)


@dataclass
class Ended:
    """A session with its reward, as trajectories (``chain``)."""

    id: str
    trajectories: list[Trajectory]
    finished: list[bool]  # each trajectory's last call ended with EOS
    reward: float | None
    columns: dict[str, Any]
    breaks: int


def chain(calls: list[Call]) -> tuple[list[Trajectory], list[bool], int]:
    """A session's calls as trajectories (module docstring), each one's last call's ``finished``, and the
    number of cuts."""
    out: list[Trajectory] = []
    finished: list[bool] = []
    for call in calls:
        here = out[-1] if out else None
        context = None if here is None else here.prompt_ids + here.ids
        if context is not None and len(call.prompt_ids) >= len(context) and call.prompt_ids[:len(context)] == context:
            shown = call.prompt_ids[len(context):]
            here.ids += shown
            here.loss_mask += [0] * len(shown)
            here.logprobs += [0.0] * len(shown)
            here.versions += [-1] * len(shown)
        else:
            here = Trajectory(prompt_ids=list(call.prompt_ids))
            out.append(here)
            finished.append(False)
        here.ids += call.response_ids
        here.loss_mask += [1] * len(call.response_ids)
        here.logprobs += list(call.logprobs)
        here.versions += [call.version] * len(call.response_ids)
        finished[-1] = call.finished
    return out, finished, len(out) - 1 if out else 0


class SessionBook:
    """The open sessions, their limits, and the groups sessions end into (one thread: the server's loop)."""

    def __init__(self, cfg, groups, *, group_size: int, reads_reward: bool):
        self.cfg, self.groups, self.group_size, self.reads_reward = cfg, groups, group_size, reads_reward
        self.open: dict[str, Session] = {}
        self.pending: dict[Any, list[Ended]] = {}  # group key -> ended sessions not yet a whole group
        self.finished_groups = 0
        self.counts = dict.fromkeys(("calls", "unrecorded_calls", "sessions_ended", "sessions_expired", "samples",
                                     "prefix_breaks"), 0)

    def session_for(self, session_id: str) -> Session:
        """The open session ``session_id`` (a new one if it is not open), its limits checked."""
        self.expire()
        session = self.open.get(session_id)
        if session is None:
            if len(self.open) >= self.cfg.max_open_sessions:
                raise BadRequest(f"{len(self.open)} sessions are open, source.agent.max_open_sessions="
                                 f"{self.cfg.max_open_sessions}: end some with POST /v1/sessions/{{id}}/reward", 429)
            session = self.open[session_id] = Session(session_id)
        if len(session.calls) >= self.cfg.max_calls_per_session:
            raise BadRequest(f"session {session_id!r} made {len(session.calls)} calls, source.agent."
                             f"max_calls_per_session={self.cfg.max_calls_per_session}")
        return session

    def record(self, session: Session, prompt_ids: list[int], gen) -> None:
        session.calls.append(Call(list(prompt_ids), list(gen.response_ids), list(gen.logprobs),
                                  -1 if gen.version is None else gen.version, bool(gen.finished)))
        session.last = time.monotonic()
        self.counts["calls"] += 1

    def end(self, session_id: str, body: dict) -> dict:
        """``POST /v1/sessions/{id}/reward``: the session ends; its group may be finished."""
        self.expire()
        reward, group, columns = body.get("reward"), body.get("group"), body.get("columns") or {}
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not math.isfinite(reward)):
            raise BadRequest(f"'reward' must be a finite number, got {reward!r}")
        if reward is None and self.reads_reward:
            raise BadRequest("this run's rewards list session_reward: post {\"reward\": number}")
        if reward is not None and not self.reads_reward:
            raise BadRequest("this run scores sessions with its own rewards, none of which reads a posted reward: "
                             "list session_reward in rewards, or post the columns its rewards read")
        if group is not None and not isinstance(group, str):
            raise BadRequest(f"'group' must be a string, got {group!r}")
        if not isinstance(columns, dict):
            raise BadRequest(f"'columns' must be a JSON object, got {columns!r}")
        if {"session_reward", "session_id"} & set(columns):
            raise BadRequest("'columns' may not name session_reward or session_id (the endpoint writes them)")
        session = self.open.pop(session_id, None)
        if session is None:
            raise BadRequest(f"no open session {session_id!r}: it made no call, already ended, or expired "
                             f"(source.agent.session_timeout_s={self.cfg.session_timeout_s:g})", 404)
        trajectories, finished, breaks = chain(session.calls)
        ended = Ended(session_id, trajectories, finished, None if reward is None else float(reward), columns, breaks)
        key = group if group is not None else tuple(session.calls[0].prompt_ids)
        members = self.pending.setdefault(key, [])
        members.append(ended)
        self.counts["sessions_ended"] += 1
        self.counts["samples"] += len(trajectories)
        self.counts["prefix_breaks"] += breaks
        if len(members) == self.group_size:
            del self.pending[key]
            self.finished_groups += 1
            self.groups.put(self.finished_groups, members)
        return {"session": session_id, "calls": len(session.calls), "samples": len(trajectories),
                "prefix_breaks": breaks, "group_sessions": len(members) % self.group_size or self.group_size}

    def expire(self) -> None:
        now = time.monotonic()
        for sid in [sid for sid, s in self.open.items() if now - s.last > self.cfg.session_timeout_s]:
            del self.open[sid]
            self.counts["sessions_expired"] += 1


class AgentService(RolloutService):
    """The OpenAI endpoints over the run's engine (a ``VersionedEngine``), recording sessions in ``book``;
    concurrent calls are batched (an eager ``TurnBatcher``)."""

    def __init__(self, engine, model_name: str, book: SessionBook, *, max_tokens: int, max_context_tokens: int):
        super().__init__(engine, model_name)
        self.book, self.max_tokens, self.max_context_tokens = book, max_tokens, max_context_tokens
        self.batcher: TurnBatcher | None = None  # made in the server's event loop

    def default_max_tokens(self, chat: bool) -> int:
        return self.max_tokens

    def admit(self, request: dict, headers, prompts: list[list[int]], sampling: dict) -> Session | None:
        header, user = headers.get(SESSION_HEADER), request.get("user")
        if header is not None and user is not None and header != user:
            raise BadRequest(f"the {SESSION_HEADER} header ({header!r}) and 'user' ({user!r}) name two sessions")
        session_id = header if header is not None else user
        if sampling["max_new_tokens"] > self.max_tokens:
            raise BadRequest(f"max_tokens={sampling['max_new_tokens']} is over this endpoint's {self.max_tokens} "
                             f"(source.agent.max_tokens)")
        longest = max(len(p) for p in prompts)
        if longest > self.max_context_tokens:
            raise BadRequest(f"the prompt has {longest} tokens, over source.agent.max_context_tokens="
                             f"{self.max_context_tokens}")
        if session_id is None:
            self.book.counts["unrecorded_calls"] += 1
            return None
        if not isinstance(session_id, str) or not session_id:
            raise BadRequest(f"a session id must be a non-empty string, got {session_id!r}")
        if len(prompts) != 1 or sampling["n"] != 1:
            raise BadRequest("a recorded call takes one prompt and n=1 (run n sessions for n samples)")
        return self.book.session_for(session_id)

    async def agenerate(self, prompt_ids: list[list[int]], **sampling) -> list[list[Any]]:
        """A single-prompt call through the batcher (calls sampled alike share an engine call, each cut to
        its own ``max_tokens``: the first tokens of a longer sample are a sample of that many); others alone."""
        if len(prompt_ids) != 1 or sampling["n"] != 1:
            return await super().agenerate(prompt_ids, **sampling)
        if self.batcher is None:
            self.batcher = TurnBatcher(self.engine, eager=True)
        rest = {k: v for k, v in sampling.items() if k not in ("n", "max_new_tokens")}
        budget = sampling["max_new_tokens"]
        gen = await self.batcher.generate(0, prompt_ids[0], budget, sampling=rest)
        if len(gen.response_ids) > budget:
            gen = Generation(gen.response_ids[:budget], gen.logprobs[:budget],
                             self.tokenizer.decode(gen.response_ids[:budget], skip_special_tokens=True), False,
                             gen.version)
        return [[gen]]

    def generate(self, prompt_ids: list[list[int]], **sampling) -> list[list[Any]]:
        return self.engine.generate(prompt_ids, **sampling)  # the versioned engine holds its own lock

    def record(self, admitted: Session | None, prompts: list[list[int]], gens: list[list[Any]]) -> None:
        if admitted is not None:
            self.book.record(admitted, prompts[0], gens[0][0])


def sessions_to_rollout(groups: list[list[Ended]], tokenizer) -> Rollout:
    """The finished groups' sessions as N samples (one per trajectory; ``group_ids`` by group), with the
    columns the rewards read: ``session_reward``, ``session_id`` and each session's posted ``columns``."""
    flat = [(g, ended, k) for g, members in enumerate(groups) for ended in members for k in range(len(ended.trajectories))]
    trajectories = [ended.trajectories[k] for _, ended, k in flat]
    tok = padded(trajectories, tokenizer.pad_token_id)
    names = sorted({name for _, ended, _ in flat for name in ended.columns})
    columns = {name: [ended.columns.get(name) for _, ended, _ in flat] for name in names}
    columns.update(session_reward=[ended.reward for _, ended, _ in flat], session_id=[ended.id for _, ended, _ in flat])
    return Rollout(
        tensors={**{k: tok[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                                        "response_attention_mask")},
                 "finished": torch.tensor([ended.finished[k] for _, ended, k in flat])},
        engine_logp=tok["engine_logp"], token_version=tok.get("token_version"),
        group_ids=torch.tensor([g for g, _, _ in flat]),
        prompts=[tokenizer.decode(t.prompt_ids) for t in trajectories],
        samples=[tokenizer.decode(t.ids, skip_special_tokens=True) for t in trajectories],
        columns=columns,
    )


def session_routes(app, book: SessionBook, guarded) -> None:
    """``POST /v1/sessions/{id}/reward`` behind the endpoint's guards."""

    @app.post("/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request):
        async def end(body: bytes, _) -> dict:
            return book.end(session_id, _json(body))

        return await guarded(request, end)


class SessionFeed:
    """The agent endpoint as a stream's feed (``unirl.rollout.stream.Feed``): serves the policy on ``cfg.host``
    and ``cfg.port`` (``source.agent``), records the sessions, and puts each finished group in the source's
    queue. ``reads_reward``: the run's rewards list ``session_reward``."""

    def __init__(self, cfg, engine, *, model_name: str, group_size: int, max_tokens: int, reads_reward: bool,
                 output_dir: str | None = None):
        from unirl.serving.guards import Guards

        self.cfg, self.engine, self.model_name, self.group_size = cfg, engine, model_name, group_size
        self.max_tokens, self.reads_reward, self.output_dir = max_tokens, reads_reward, output_dir
        self.guards = Guards.from_settings("source.agent", max_body_mb=cfg.max_body_mb, body_timeout_s=cfg.body_timeout_s,
                                           token=cfg.token, token_env=TOKEN_ENV)
        if cfg.host not in ("127.0.0.1", "localhost", "::1") and self.guards.token is None:
            raise ValueError(f"source.agent.host={cfg.host} exposes the policy beyond this machine; set source.agent."
                             f"token (or ${TOKEN_ENV}), which every request must then carry")
        self.server = self.book = None
        self.url = None
        self._last = dict.fromkeys(("calls", "sessions_ended", "samples", "prefix_breaks"), 0)

    def start(self, groups, first_batch: int, may_start) -> None:
        from unirl.serving.server import AppServer

        self.book = SessionBook(self.cfg, groups, group_size=self.group_size, reads_reward=self.reads_reward)
        service = AgentService(self.engine, self.model_name, self.book, max_tokens=self.max_tokens,
                               max_context_tokens=self.cfg.max_context_tokens)
        app = make_app(service, self.guards, None, extra_routes=lambda app, guarded: session_routes(app, self.book, guarded))
        self.server = AppServer(app, self.cfg.host, self.cfg.port)
        threading.Thread(target=self.server.serve_forever, name="unirl-agent-endpoint", daemon=True).start()
        host, port = self.server.server_address
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
        print(f"unirl: source.agent: the policy serves {self.model_name!r} at {self.url}; end each session with "
              f"POST {self.url}/sessions/<id>/reward", file=sys.stderr, flush=True)
        if self.output_dir is not None:
            Path(self.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.output_dir) / "agent_endpoint.json").write_text(json.dumps(
                {"url": self.url, "model": self.model_name, "token_env": TOKEN_ENV if self.guards.token else None}))

    def to_rollout(self, items: list) -> Rollout:
        return sessions_to_rollout(items, self.engine.tokenizer)

    def waiting(self, finished: int, needed: int, waited_s: float) -> str:
        book = self.book
        return (f"source.agent: {finished} of the {needed} groups of {self.group_size} sessions a step trains ended "
                f"within {waited_s:g} s (source.agent.wait_s; {len(book.open)} sessions open, {book.counts['calls']} "
                f"calls recorded, {book.counts['sessions_ended']} sessions ended); is your agent calling {self.url} "
                f"and ending its sessions with POST {self.url}/sessions/<id>/reward?")

    def metrics(self) -> dict[str, float]:
        counts = dict(self.book.counts)
        new = {k: counts[k] - self._last[k] for k in self._last}
        self._last = {k: counts[k] for k in self._last}
        ended = max(new["sessions_ended"], 1)
        return {"agent/sessions_ended": float(new["sessions_ended"]), "agent/calls_per_session": new["calls"] / ended,
                "agent/samples_per_session": new["samples"] / ended, "agent/prefix_breaks": float(new["prefix_breaks"]),
                "agent/sessions_open": float(len(self.book.open)),
                "agent/sessions_expired": float(counts["sessions_expired"]),
                "agent/unrecorded_calls": float(counts["unrecorded_calls"])}

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
