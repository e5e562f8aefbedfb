"""The trainer's side of the rollout server (``rollout.engine: server``, ``unirl.text.rollout_server``):
an engine with the colocated engines' ``generate`` / ``load_weights`` / ``close``, over HTTP.

Weights travel as one safetensors file per push (``POST /weights``): measured against a gloo process
group between the two processes in benchmarks/README.md ("Weight push"), it is as fast on one machine and
needs no rendezvous, ports or process-group lifetime shared by two programs started apart.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from typing import Iterable

import torch

from unirl.text.engines import Generation

#: The environment variable with the server's token (``unirl serve-rollout --token``).
TOKEN_ENV = "UNIRL_ROLLOUT_TOKEN"


class RolloutServerError(ConnectionError):
    """The rollout server cannot be reached or answered with an error; the message is one line that names it."""


class ServerEngine:
    """Samples from, and pushes weights to, ``unirl serve-rollout`` at ``url``."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, token: str | None = None):
        self.url, self.timeout = url.rstrip("/"), timeout_s
        self.token = token or os.environ.get(TOKEN_ENV) or None
        self.version = 0
        health = self._call("GET", "/health", None, timeout=30.0)
        self.model_name = health.get("model")

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False, stop: list[str] | None = None,
                 seed: int | None = None) -> list[list[Generation]]:
        body = {"prompt_ids": prompt_ids, "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "top_k": top_k, "greedy": greedy, "stop": stop, "seed": seed}
        out = self._call("POST", "/generate", json.dumps(body).encode(), content_type="application/json")
        return [[Generation(g["response_ids"], g["logprobs"], g["text"], g["finished"]) for g in group]
                for group in out["generations"]]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push the weights (HF checkpoint names) as one safetensors file; the server reloads them in place."""
        from safetensors.torch import save

        data = save({name: t.detach().to("cpu").contiguous() for name, t in weights})
        self.version += 1
        self._call("POST", "/weights", data, content_type="application/octet-stream",
                   headers={"X-Unirl-Weights-Version": str(self.version)})

    def close(self) -> None:
        pass

    def _call(self, method: str, path: str, body: bytes | None, *, content_type: str | None = None,
              headers: dict | None = None, timeout: float | None = None) -> dict:
        headers = dict(headers or {})
        if content_type:
            headers["Content-Type"] = content_type
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = err.reason
            raise RolloutServerError(f"rollout server {self.url}: {method} {path} answered {err.code}: {message}") from None
        except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError, OSError) as err:
            why = getattr(err, "reason", err)
            raise RolloutServerError(f"rollout server {self.url} unreachable during {method} {path} ({why}); is "
                                     f"`unirl serve-rollout` running there?") from None
