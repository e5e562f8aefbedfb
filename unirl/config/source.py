"""The run-level ``source`` block: where each step's batch comes from (``unirl/rollout/sources.py``), and the
endpoint through which your own agent's sessions become the batches (``unirl/rollout/sessions.py``).
``RunConfig`` (``unirl.config.schema``) holds it for every environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from unirl.config.checks import check_range


@dataclass
class AgentEndpointConfig:
    """Training from your own agent (``source.agent``; docs/agents.md, ``unirl/rollout/sessions.py``): the run
    serves the policy it trains as an OpenAI-compatible endpoint (``/v1/completions``,
    ``/v1/chat/completions``), records every call of a session token for token, and trains on the sessions
    your agent ends with a reward (``POST /v1/sessions/{id}/reward``). Set ``port`` to switch it on."""

    #: The port to serve on; null: no endpoint (batches come from the run's own sampler); 0: a free port
    #: (the address is printed and written to ``<output_dir>/agent_endpoint.json``).
    port: Optional[int] = None
    #: Bound to loopback; another address exposes the policy beyond this machine and needs ``token``.
    host: str = "127.0.0.1"
    #: The bearer token every request must carry (default ``$UNIRL_AGENT_TOKEN``; none: loopback only).
    token: Optional[str] = None
    #: Request bodies over this are refused (413).
    max_body_mb: float = 4.0
    #: Request bodies that have not arrived within this are refused (408).
    body_timeout_s: float = 30.0
    #: The most tokens one call may generate (null: ``rollout.max_new_tokens``); a call asking more is refused.
    max_tokens: Optional[int] = None
    #: The longest prompt a call may send, in tokens (a session's context grows with its calls).
    max_context_tokens: int = 4096
    #: Sessions open at once; a call opening one more is refused (429).
    max_open_sessions: int = 1024
    #: Calls one session may make; one more is refused (400).
    max_calls_per_session: int = 64
    #: A session with no call or reward for this long is dropped (``agent/sessions_expired``).
    session_timeout_s: float = 600.0
    #: The longest a step waits for its sessions before the run stops with a line saying how many came.
    wait_s: float = 1800.0

    def __post_init__(self):
        if self.port is not None:
            check_range(self, "port", low=0, high=65535)
        for name in ("max_body_mb", "body_timeout_s", "session_timeout_s", "wait_s"):
            check_range(self, name, low=0, low_open=True)
        for name in ("max_context_tokens", "max_open_sessions", "max_calls_per_session"):
            check_range(self, name, low=1)
        check_range(self, "max_tokens", low=1, optional=True)


@dataclass
class SourceConfig:
    """Where each step's batch comes from (``unirl/rollout/sources.py``, docs/async.md): sampled when the step
    asks (the default), ahead of it in a producer thread (``max_staleness``), or by rollout servers on other
    processes or machines (``urls``). Text only: diffusion samples with the policy itself."""

    #: Asynchronous rollouts: 0 is the synchronous loop (each step samples with the weights it trains);
    #: k >= 1 generates step s's batch with the weights after step s-k in a producer thread while the trainer
    #: updates (verl's one-step-off at 1, TRL's ``max_staleness``), at most ``trainer.total_steps``; the PPO ratio is then taken against the
    #: engine's log-probs unless ``bypass_mode: false``.
    max_staleness: int = 0
    #: verl's ``rollout_correction.bypass_mode``: the PPO ratio is taken against the rollout engine's
    #: log-probs (the behaviour policy) instead of the trainer's recomputed ones, so the clip bounds the
    #: policy's move from the weights that sampled the batch; ``algo.tis_cap`` then weights nothing (the ratio
    #: carries the correction; its figures are still logged). null: true exactly when ``max_staleness >= 1``
    #: (TRL's AsyncGRPO anchors its ratio at the sampler's log-probs; without it a one-step-stale batch let
    #: the tiny recipe collapse, docs/async.md), false otherwise (verl's default, the decoupled proximal
    #: policy). Text only (diffusion samples with the policy).
    bypass_mode: Optional[bool] = None
    #: Rollout servers (``unirl serve-rollout``, ``http://host:port``) that generate the batches, a share of
    #: each batch's prompts per server, the weights published to all of them; empty: the run's own engine
    #: (``rollout.engine``). The servers' token: ``$UNIRL_ROLLOUT_TOKEN``.
    urls: list[str] = field(default_factory=list)
    #: Episodes (``rollout.environment``) played as a stream (``unirl/agents/stream.py``): each batch takes
    #: the first groups to finish while later prompts' episodes play on, turns sent to the engine as they
    #: become ready, episodes spanning weight versions within ``max_staleness`` (>= 1 for an overlap with the
    #: update) and each token tagged with its version. Not bit-for-bit reproducible; false: the lock-step
    #: rollout (reproducible).
    stream: bool = False
    #: The policy as an OpenAI-compatible endpoint that your own agent calls; the batches are its sessions.
    agent: AgentEndpointConfig = field(default_factory=AgentEndpointConfig)

    def __post_init__(self):
        check_range(self, "max_staleness", low=0)
        if self.stream and self.agent.port is not None:
            raise ValueError("source.stream plays the run's environment and source.agent.port serves your agent: "
                             "a run's batches come from one of them; set one")
        if (self.stream or self.agent.port is not None) and self.urls:
            raise ValueError("source.urls (rollout servers) cannot drive source.stream or source.agent yet; use the "
                             "run's own engine (rollout.engine)")
        for i, url in enumerate(self.urls):
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"urls[{i}] must start with http:// or https://, got {url!r}")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"urls: a server is listed twice ({self.urls}); each would get a share of the prompts")
