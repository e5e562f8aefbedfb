"""The trainer's side of the rollout server (``rollout.engine: server``, ``unirl.rollout.server``):
an engine with the colocated engines' ``generate`` / ``load_weights`` / ``close``, over HTTP.

Weights travel over a two-process gloo group the client opens at start (``unirl.rollout.weight_channel``):
the names, shapes and dtypes go over HTTP, the tensors by broadcast. Measured in benchmarks/README.md
("Weight push"), it is about 10x faster than one safetensors file over HTTP on this CPU; the group is the
client's own (not the default process group), and a restarted trainer opens a new one.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from typing import Iterable

import torch

from unirl.rollout.engine import Generation

#: The environment variable with the server's token (``unirl serve-rollout --token``).
TOKEN_ENV = "UNIRL_ROLLOUT_TOKEN"


class RolloutServerError(ConnectionError):
    """The rollout server cannot be reached or answered with an error; the message is one line that names it."""


class ServerEngine:
    """Samples from, and pushes weights to, ``unirl serve-rollout`` at ``url``."""

    weights_format = "hf_checkpoint"
    shares_policy = False

    def __init__(self, url: str, *, timeout_s: float = 600.0, token: str | None = None, processes: int = 1):
        if processes > 1:
            raise ValueError("rollout.engine=server takes one trainer process at present (each would push its "
                             "weights to the one server); use rollout.engine=vllm with several processes")
        self.url, self.timeout = url.rstrip("/"), timeout_s
        self.token = token or os.environ.get(TOKEN_ENV) or None
        self.version = 0
        health = self._call("GET", "/health", None, timeout=30.0)
        self.model_name = health.get("model")
        self.group = self._connect()

    def _connect(self):
        """Open the weight group (rank 0, a free port on the address the server reaches us at) while the server joins it."""
        import threading
        import urllib.parse

        from unirl.rollout.weight_channel import WeightGroup

        server = urllib.parse.urlsplit(self.url)
        with socket.create_connection((server.hostname, server.port or 80), timeout=30) as probe:
            host = probe.getsockname()[0]  # this machine's address on the way to the server
        probe_store = socket.socket()
        probe_store.bind((host, 0))
        port = probe_store.getsockname()[1]
        probe_store.close()
        joined: list = []
        thread = threading.Thread(target=lambda: joined.append(self._try("POST", "/weights/connect", json.dumps(
            {"host": host, "port": port, "timeout_s": self.timeout}).encode())), daemon=True)
        thread.start()
        group = WeightGroup(host, port, rank=0, timeout_s=min(self.timeout, 120.0))
        thread.join()
        if isinstance(joined[0], Exception):
            raise joined[0]
        return group

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False, stop: list[str] | None = None,
                 seed: int | None = None) -> list[list[Generation]]:
        body = {"prompt_ids": prompt_ids, "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "top_k": top_k, "greedy": greedy, "stop": stop, "seed": seed}
        out = self._call("POST", "/generate", json.dumps(body).encode(), content_type="application/json")
        return [[Generation(g["response_ids"], g["logprobs"], g["text"], g["finished"]) for g in group]
                for group in out["generations"]]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push the weights (HF checkpoint names): their description over HTTP, the tensors over the gloo
        group; returns once the server has reloaded them."""
        import threading

        from unirl.rollout.weight_channel import describe

        weights = list(weights)
        self.version += 1
        answer: list = []
        body = json.dumps({"tensors": describe(weights), "version": str(self.version)}).encode()
        thread = threading.Thread(target=lambda: answer.append(self._try("POST", "/weights/receive", body)), daemon=True)
        thread.start()
        try:
            self.group.send(weights)
        except RuntimeError as err:  # gloo: the other side went away
            thread.join(timeout=5)
            raise (answer[0] if answer and isinstance(answer[0], Exception) else RolloutServerError(
                f"rollout server {self.url} lost during a weight push ({str(err).splitlines()[0][:200]})")) from None
        thread.join()
        if isinstance(answer[0], Exception):
            raise answer[0]

    def _try(self, method: str, path: str, body: bytes) -> dict | Exception:
        try:
            return self._call(method, path, body, content_type="application/json")
        except RolloutServerError as err:
            return err

    def sleep(self) -> None:  # the server's devices are its own
        pass

    def wake_up(self) -> None:
        pass

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
