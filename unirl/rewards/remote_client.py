"""Rewards over HTTP, the client half: the wire format and ``RemoteReward``, what a spec
``http://host:port`` loads. The server half (``unirl serve-reward NAME``) is ``unirl/rewards/remote.py``.

Why: a reward model may need its own environment (conflicting dependency pins, another GPU, another
machine), as FlowGRPO's reward servers do. The protocol is small, JSON over HTTP (the client is
stdlib only):

- ``GET /info`` -> ``{"name", "modality", "description"}``; ``GET /health`` -> ``{"status": "ok", ...}``.
- ``POST /score`` with ``{"samples": [...], "prompts": [...], "columns": {name: [...]}}`` ->
  ``{"scores": [float or null, ...]}``. A text sample is a JSON string; an image is
  ``{"png_base64": "..."}`` (PNG is lossless, so the server scores the very pixels the run made).
  A reward that raises or returns bad scores answers 500 with ``{"error": "..."}`` (the server's
  ``RewardError`` message: reward, sample, prompt); a malformed request answers 400; a server
  whose queue is full answers 503.

The reward's settings are the server's (``serve-reward gsm8k --kwargs '{"method": "flexible"}'``);
a run's ``kwargs`` for an ``http://`` spec set the client: ``timeout`` (seconds per attempt),
``retry_for`` (seconds of retrying in all, default 30: longer than a server takes to restart),
``retries`` (a cap on the number of retries; null: none), ``backoff`` and ``token`` (the server's
shared secret, default ``$UNIRL_REWARD_TOKEN``, sent as ``Authorization: Bearer``). Connection
failures and timeouts are retried with a doubling backoff (at most 5 s apart), and so are
502/503/504 answers (a server whose queue is full answers 503): ``unirl.serving.client.JSONClient``; then,
or at once for an answer that is not the protocol, a ``RewardError`` says which. Errors the reward itself raised are not retried:
they would recur. A 400 naming one of the server's settings means the request tried to change it.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any, Sequence

from unirl.rewards.registry import RewardError
from unirl.serving.client import JSONClient


# ----------------------------------------------------------------------------------------------
# Wire format
# ----------------------------------------------------------------------------------------------


def encode_sample(sample: Any) -> Any:
    """A string as itself; a PIL image (or an HxWxC uint8 array) as ``{"png_base64": ...}``."""
    if isinstance(sample, str):
        return sample
    from PIL import Image

    if not isinstance(sample, Image.Image):
        if hasattr(sample, "__array__"):
            import numpy as np

            sample = Image.fromarray(np.asarray(sample))
        else:
            raise RewardError(f"remote rewards take strings or PIL images as samples, got {type(sample).__name__}")
    buffer = io.BytesIO()
    sample.save(buffer, format="PNG")
    return {"png_base64": base64.b64encode(buffer.getvalue()).decode("ascii")}


def decode_sample(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("png_base64"), str):
        from PIL import Image

        image = Image.open(io.BytesIO(base64.b64decode(value["png_base64"], validate=True)))
        image.load()
        return image
    raise ValueError(f"a sample must be a string or {{'png_base64': ...}}, got {str(value)[:80]!r}")


# ----------------------------------------------------------------------------------------------
# Client
# ----------------------------------------------------------------------------------------------


class RemoteReward:
    """A reward served by ``unirl serve-reward`` at ``url``, called like any reward function.

    Args:
        url: ``http://host:port`` of the server.
        timeout: seconds each attempt may take (connecting and scoring the batch).
        retries: the most further attempts after a connection failure, a timeout, or a 502/503/504
            (None: as many as ``retry_for`` allows).
        backoff: seconds before the first retry, doubled for each further one (at most ``MAX_BACKOFF``).
        retry_for: no retry starts later than this many seconds after the first attempt.
        token: the server's shared secret (default ``$UNIRL_REWARD_TOKEN``; None: send none).
    """

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int | None = None, backoff: float = 0.5,
                 retry_for: float = 30.0, token: str | None = None):
        import os

        if not url.startswith(("http://", "https://")):
            raise RewardError(f"a remote reward is named by http://host:port, got {url!r}")
        if timeout <= 0 or (retries is not None and retries < 0) or backoff < 0 or retry_for < 0:
            raise RewardError(f"reward {url!r}: timeout must be > 0 and retries, backoff, retry_for >= 0 "
                              f"(got timeout={timeout}, retries={retries}, backoff={backoff}, retry_for={retry_for})")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = None if retries is None else int(retries)
        self.backoff = float(backoff)
        self.retry_for = float(retry_for)
        self.token = token or os.environ.get("UNIRL_REWARD_TOKEN") or None
        self.__name__ = self.url
        self.client = JSONClient(
            self.url, timeout=self.timeout, retries=self.retries, backoff=self.backoff, retry_for=self.retry_for,
            token=self.token, error=RewardError, what="reward server",
            unreachable_hint=" Is `unirl serve-reward` running there? (kwargs.retry_for sets how long to keep trying)")

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, timeout={self.timeout}, retry_for={self.retry_for})"

    def info(self) -> dict:
        """The server's ``/info``: the reward's name, modality and description."""
        return self._request("GET", "/info", None)

    def __call__(self, samples: Sequence[Any], *, prompts: Sequence[str] | None = None, **columns: Any) -> list:
        payload = {"samples": [encode_sample(s) for s in samples],
                   "prompts": list(prompts) if prompts is not None else None, "columns": {}}
        for key, column in columns.items():
            try:
                json.dumps(column)
            except (TypeError, ValueError) as err:
                raise RewardError(f"reward {self.url!r}: column {key!r} cannot be sent as JSON ({err})") from err
            payload["columns"][key] = list(column) if isinstance(column, tuple) else column
        answer = self._request("POST", "/score", json.dumps(payload).encode())
        scores = answer.get("scores")
        if not isinstance(scores, list):
            raise RewardError(f"reward server {self.url} answered garbage: expected {{\"scores\": [...]}}, "
                              f"got {json.dumps(answer)[:200]}")
        if len(scores) != len(samples):
            raise RewardError(f"reward server {self.url} answered {len(scores)} scores for {len(samples)} samples")
        return scores

    def _request(self, method: str, path: str, body: bytes | None) -> dict:
        return self.client.request(method, path, body, doing="score the batch" if path == "/score" else None)
