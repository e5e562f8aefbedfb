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
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterable

import torch

from unirl.rollout.engine import CallSeeds, Generation

#: The environment variable with the server's token (``unirl serve-rollout --token``).
TOKEN_ENV = "UNIRL_ROLLOUT_TOKEN"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def token_path(port: int) -> Path:
    """Where a loopback server started without a token leaves the one it made for its weight routes (0600),
    for a trainer of the same user on this machine: ``~/.cache/unirl/rollout-tokens/<port>``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "unirl" / "rollout-tokens" / str(port)


def write_token(token: str, port: int) -> Path:
    """The weight routes' token made at start, in ``token_path(port)`` readable by this user only (0600, in a
    0700 directory); the trainer's client reads it when it has no ``$UNIRL_ROLLOUT_TOKEN``."""
    path = token_path(port)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path.parent, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a file left by an earlier server keeps its mode through O_CREAT
        with os.fdopen(fd, "w") as f:
            f.write(token)
    except OSError as err:
        raise OSError(f"cannot write the weight routes' token to {path} ({err.strerror}); give --token (or "
                      f"${TOKEN_ENV}) and the same to the trainer") from None
    return path


def trainer_vocab(tokenizer, policy=None) -> int | None:
    """The ids a trainer can embed: its policy's embedding rows (past the tokenizer's length on models whose
    embedding is padded), else the tokenizer's length; None when neither is known."""
    embed = getattr(policy, "get_input_embeddings", lambda: None)() if policy is not None else None
    rows = getattr(embed, "num_embeddings", None)
    return max(rows or 0, len(tokenizer) if tokenizer is not None else 0) or None


def _token(url: str) -> str | None:
    """``$UNIRL_ROLLOUT_TOKEN``, else the token a loopback server at ``url`` wrote (``token_path``), else None."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    parts = urllib.parse.urlsplit(url)
    path = token_path(parts.port or 80) if parts.hostname in LOOPBACK else None
    return path.read_text().strip() or None if path is not None and path.is_file() else None


class RolloutServerError(ConnectionError):
    """The rollout server cannot be reached or answered with an error; the message is one line that names it."""


class ServerEngine:
    """Samples from, and pushes weights to, ``unirl serve-rollout`` at ``url``."""

    weights_format = "hf_checkpoint"
    shares_policy = False

    def __init__(self, url: str, *, timeout_s: float = 600.0, token: str | None = None, processes: int = 1,
                 vocab_size: int | None = None, seed: int | None = None):
        """``vocab_size``: the trainer's vocabulary; an answer with a token id outside it is refused (None: not
        checked). ``seed``: the run's, which seeds a training batch's calls (``seeds``, a ``CallSeeds``: the
        server's own generator is not the trainer's to save); None: unseeded calls use the server's generator."""
        if processes > 1:
            raise ValueError("rollout.engine=server takes one trainer process at present (each would push its "
                             "weights to the one server); use rollout.engine=vllm with several processes")
        self.url, self.timeout, self.vocab_size = url.rstrip("/"), timeout_s, vocab_size
        self.token = token or _token(self.url)
        self.seeds = None if seed is None else CallSeeds(seed)
        self.version = 0
        health = self._call("GET", "/health", None, timeout=30.0)
        self.model_name = health.get("model")
        # The weight routes need the token: a missing or wrong one is reported here, at once (it was a 120 s
        # wait for a weight group the server never joined); the answer lists what a push must hold.
        self.served = self._call("GET", "/weights", None, timeout=30.0).get("tensors")  # None: it takes no push
        self.group = self._connect()

    def _connect(self):
        """Open the weight group (rank 0, a free port on the address the server reaches us at) while the server joins it."""
        import threading

        from unirl.rollout.weight_channel import WeightGroup

        server = urllib.parse.urlsplit(self.url)
        with socket.create_connection((server.hostname, server.port or 80), timeout=30) as probe:
            host = probe.getsockname()[0]  # this machine's address on the way to the server
        probe_store = socket.socket()
        probe_store.bind((host, 0))
        port = probe_store.getsockname()[1]
        probe_store.close()
        joined: list = []
        wait = min(self.timeout, 120.0)
        thread = threading.Thread(target=lambda: joined.append(self._try("POST", "/weights/connect", json.dumps(
            {"host": host, "port": port, "timeout_s": wait}).encode())), daemon=True)
        thread.start()
        try:
            group = WeightGroup(host, port, rank=0, timeout_s=wait)
        except RuntimeError as err:  # torch.distributed's message carries a C++ stack after its first line
            thread.join(timeout=5)
            if joined and isinstance(joined[0], Exception):
                raise joined[0] from None
            raise RolloutServerError(f"rollout server {self.url} did not join the weight group at {host}:{port} "
                                     f"within {wait:g} s ({str(err).strip().splitlines()[0][:200]})") from None
        thread.join()
        if isinstance(joined[0], Exception):
            raise joined[0]
        return group

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False, stop: list[str] | None = None,
                 seed: int | None = None) -> list[list[Generation]]:
        if seed is None and self.seeds is not None:
            seed = self.seeds.take()
        body = {"prompt_ids": prompt_ids, "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "top_k": top_k, "greedy": greedy, "stop": stop, "seed": seed}
        out = self._call("POST", "/generate", json.dumps(body).encode(), content_type="application/json")
        try:
            return check_answer(out, len(prompt_ids), 1 if greedy else n, max_new_tokens, self.vocab_size)
        except ValueError as err:
            raise RolloutServerError(f"rollout server {self.url} answered POST /generate with {err}; nothing was "
                                     f"trained on it (is the server's model the trainer's?)") from None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push the weights (HF checkpoint names): their description over HTTP, the tensors over the gloo
        group; returns once the server has reloaded them."""
        import threading

        from unirl.rollout.weight_channel import check_specs, describe

        weights = list(weights)
        specs = describe(weights)
        if self.served is not None:  # (None: the server refuses every push and says why)
            served = {n: (tuple(t["shape"]), getattr(torch, t["dtype"], torch.uint8)) for n, t in self.served.items()}
            try:
                check_specs(specs, served, f"rollout server {self.url} serves another model")
            except ValueError as err:  # before the push: the server would refuse it, and nothing is sent
                raise RolloutServerError(str(err)) from None
        self.version += 1
        answer: list = []
        body = json.dumps({"tensors": specs, "version": str(self.version)}).encode()
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
            if err.code == 401:
                port = urllib.parse.urlsplit(self.url).port or 80
                raise RolloutServerError(f"rollout server {self.url} refused the token on {method} {path} (401): set "
                                         f"${TOKEN_ENV} to the server's --token (a server on this machine started "
                                         f"without one wrote its own to {token_path(port)})") from None
            raise RolloutServerError(f"rollout server {self.url}: {method} {path} answered {err.code}: {message}") from None
        except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError, OSError) as err:
            why = getattr(err, "reason", err)
            raise RolloutServerError(f"rollout server {self.url} unreachable during {method} {path} ({why}); is "
                                     f"`unirl serve-rollout` running there?") from None


def check_answer(out: dict, prompts: int, per_prompt: int, max_new_tokens: int, vocab_size: int | None
                 ) -> list[list[Generation]]:
    """``/generate``'s answer as generations, or a ValueError saying what is wrong with it: ``prompts`` groups
    of ``per_prompt`` samples, each at most ``max_new_tokens`` ids in the vocabulary with one log-prob (a
    number <= 0, or NaN/-inf as an engine may give) per id."""
    groups = out.get("generations") if isinstance(out, dict) else None
    if not isinstance(groups, list):
        raise ValueError("no 'generations' list")
    if len(groups) != prompts:
        raise ValueError(f"{len(groups)} groups of generations for {prompts} prompts")
    result = []
    for i, group in enumerate(groups):
        if not isinstance(group, list) or len(group) != per_prompt:
            raise ValueError(f"prompt {i}'s group holding {len(group) if isinstance(group, list) else group!r} "
                             f"samples, not {per_prompt}")
        result.append([_generation(g, f"prompt {i}'s sample {j}", max_new_tokens, vocab_size)
                       for j, g in enumerate(group)])
    return result


def _generation(g, where: str, max_new_tokens: int, vocab_size: int | None) -> Generation:
    if not isinstance(g, dict):
        raise ValueError(f"{where} not a JSON object")
    ids, lps, text, finished = g.get("response_ids"), g.get("logprobs"), g.get("text"), g.get("finished")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{where}'s response_ids not a list of integers")
    bad = next((t for t in ids if t < 0 or vocab_size is not None and t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"{where} holding token id {bad}, outside the trainer's vocabulary 0..{(vocab_size or 1) - 1}")
    if len(ids) > max_new_tokens:
        raise ValueError(f"{where} {len(ids)} tokens long, over max_new_tokens={max_new_tokens}")
    if not isinstance(lps, list) or len(lps) != len(ids) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
        raise ValueError(f"{where} with {len(lps) if isinstance(lps, list) else lps!r} log-probs for {len(ids)} tokens "
                         f"(one number per token)")
    if not isinstance(text, str) or not isinstance(finished, bool):
        raise ValueError(f"{where}'s text or finished missing")
    return Generation(ids, [float(x) for x in lps], text, finished)
