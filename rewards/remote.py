"""Rewards over HTTP: ``unirl serve-reward NAME`` hosts a reward, and the spec ``http://host:port``
uses it from a run.

Why: a reward model may need its own environment (conflicting dependency pins, another GPU, another
machine), as FlowGRPO's reward servers do. The protocol is small, JSON over HTTP (stdlib only):

- ``GET /info`` -> ``{"name", "modality", "description"}``.
- ``POST /score`` with ``{"samples": [...], "prompts": [...], "columns": {name: [...]}}`` ->
  ``{"scores": [float or null, ...]}``. A text sample is a JSON string; an image is
  ``{"png_base64": "..."}`` (PNG is lossless, so the server scores the very pixels the run made).
  A reward that raises or returns bad scores answers 500 with ``{"error": "..."}`` (the server's
  ``RewardError`` message: reward, sample, prompt); a malformed request answers 400.

The reward's settings are the server's (``serve-reward gsm8k --kwargs '{"method": "flexible"}'``);
a run's ``kwargs`` for an ``http://`` spec set the client: ``timeout`` (seconds per attempt) and
``retries``. Connection failures and timeouts are retried (``retries`` times, with a short
backoff); then, or at once for an answer that is not the protocol, a ``RewardError`` says which.
Errors the reward itself raised are not retried: they would recur.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from rewards.registry import RewardError, load_reward, reward_info, score_batch

#: HTTP statuses that mean "the server is there but not ready": worth another attempt.
_RETRY_STATUSES = (502, 503, 504)


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
        retries: further attempts after a connection failure, a timeout, or a 502/503/504.
        backoff: seconds before the first retry, doubled for each further one.
    """

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int = 2, backoff: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"a remote reward is named by http://host:port, got {url!r}")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise RewardError(f"reward {url!r}: timeout must be > 0 and retries, backoff >= 0 "
                              f"(got timeout={timeout}, retries={retries}, backoff={backoff})")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.__name__ = self.url

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, timeout={self.timeout}, retries={self.retries})"

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
        attempts = self.retries + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url + path, data=body, method=method,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                text = err.read().decode("utf-8", "replace")
                if err.code in _RETRY_STATUSES:
                    last = f"HTTP {err.code}"
                    continue
                try:
                    message = json.loads(text)["error"]
                except (ValueError, KeyError, TypeError):
                    message = text[:300]
                raise RewardError(f"reward server {self.url} answered HTTP {err.code}: {message}") from None
            except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                continue
            try:
                answer = json.loads(raw)
            except ValueError:
                raise RewardError(f"reward server {self.url} answered garbage (not JSON): {raw[:200]!r}") from None
            if not isinstance(answer, dict):
                raise RewardError(f"reward server {self.url} answered garbage: expected a JSON object, got {raw[:200]!r}")
            return answer
        raise RewardError(
            f"reward server {self.url} is unreachable: {attempts} attempt(s) with a {self.timeout:g}s timeout "
            f"failed, the last with {last}. Is `unirl serve-reward` running there?"
        )


# ----------------------------------------------------------------------------------------------
# Server
# ----------------------------------------------------------------------------------------------


def make_server(spec: str, host: str = "127.0.0.1", port: int = 8000, kwargs: dict | None = None) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for the reward ``spec`` with ``kwargs`` bound.

    ``spec`` is anything ``load_reward`` takes. A model reward loads its model here, before the
    port opens, so the first request does not time out on a download. ``port=0`` picks a free port
    (``server.server_address[1]``).
    """
    from rewards.models import ModelReward

    fn = load_reward(spec, **(kwargs or {}))
    if isinstance(fn, ModelReward):
        fn.ensure_loaded()
    try:
        info = reward_info(spec)
        meta = {"name": info.name, "modality": info.modality, "description": info.description}
    except RewardError:  # a file or module spec: not registered under a name
        meta = {"name": spec, "modality": getattr(fn, "modality", None), "description": ""}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/info":
                self._send(200, meta)
            else:
                self._send(404, {"error": f"no such path {self.path!r}; use GET /info or POST /score"})

        def do_POST(self):  # noqa: N802
            if self.path.rstrip("/") != "/score":
                self._send(404, {"error": f"no such path {self.path!r}; use POST /score"})
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                request = json.loads(self.rfile.read(length))
                samples = [decode_sample(s) for s in request["samples"]]
                columns = dict(request.get("columns") or {})
                if request.get("prompts") is not None:
                    columns["prompts"] = request["prompts"]
            except Exception as err:
                self._send(400, {"error": f"malformed request: {type(err).__name__}: {err}"})
                return
            try:
                scores = score_batch(fn, samples, name=spec, **columns)
            except RewardError as err:
                self._send(500, {"error": str(err)})
                return
            self._send(200, {"scores": scores})

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # one short line per request, on stderr
            sys.stderr.write(f"serve-reward {spec}: {self.address_string()} {format % args}\n")

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
