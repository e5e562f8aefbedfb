"""The rollout server, ``unirl serve-rollout MODEL``: vLLM in its own process (its own devices), which a
trainer with ``rollout.engine: server`` samples from and pushes its weights to, and which an agent
loop can call as an OpenAI-compatible endpoint while the policy trains.

The server is an ASGI app (FastAPI) run by uvicorn (``AppServer``, shared with ``serve-reward``),
behind the same guards (``unirl.serving.guards``): bound to 127.0.0.1 unless ``--host`` says
otherwise, a bearer token (``--token`` or ``$UNIRL_ROLLOUT_TOKEN``) on every request but ``/health``,
request bodies over ``--max-body-mb`` refused (413; weights over ``--max-weights-mb``), bodies slower
than ``--body-timeout-s`` refused (408). One engine serves one request at a time (a lock): a weight
push never lands inside a generation, and generations queue.

- ``GET /health`` -> ``{"status": "ok", "model", "weights_version"}``; ``GET /v1/models``.
- ``POST /generate`` (the trainer's): ``{"prompt_ids": [[int]], "n", "max_new_tokens", "temperature",
  "top_p", "top_k", "greedy", "stop", "seed"}`` -> ``{"generations": [[{"response_ids", "logprobs",
  "text", "finished"}]]}``, the engine's ``generate`` (log-probs of the tempered distribution).
- ``POST /weights/connect`` ``{"host", "port"}``: join the trainer's two-process gloo group
  (``unirl.rollout.weight_channel``); ``POST /weights/receive`` ``{"tensors": [{"name", "shape", "dtype"}],
  "version"}``: receive the tensors the trainer broadcasts over it and reload them in place
  (``VLLMEngine.load_weights``). What the trainer uses: ~10x faster than a file over HTTP here.
- ``POST /weights``: the same from a safetensors file in the body (HF checkpoint names), for a pusher
  that is no torch program; ``X-Unirl-Weights-Version`` names them. ``GET /weights``: the served model's
  tensors (name, shape, dtype) every push is checked against before anything loads.
- The weight routes take a token even on loopback: without ``--token`` one is made at start and written
  (0600) to ``server_client.token_path(port)``, where a trainer of the same user reads it.
- Every field of a request is checked before the engine sees it (``unirl.rollout.server_requests``).
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's request and answer shapes
  (``model``, ``prompt`` / ``messages``, ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``,
  ``seed``, ``logprobs``: the sampled tokens' log-probs; top alternatives are not returned; vLLM's
  ``return_token_ids``: the prompt's and each choice's token ids, ``prompt_token_ids`` / ``token_ids``).

Every error body is ``{"error": {"message": ..., "type": ...}}``, OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from unirl.rollout.server_requests import BadRequest, check_prompt_ids, check_seed
from unirl.rollout.server_requests import field as _field, parse_json as _json, sampling as _sampling
from unirl.rollout.server_client import write_token
from unirl.rollout.weight_channel import ServedParams, check_specs, describe, served_params
from unirl.serving.guards import Guards, Refused

#: The environment variable holding the shared token when ``--token`` is not given (the trainer's
#: client sends it too).
TOKEN_ENV = "UNIRL_ROLLOUT_TOKEN"


#: The longest a trainer may ask the server to wait for its weight group (``POST /weights/connect``'s
#: ``timeout_s``): the trainer's own side waits at most 120 s (``ServerEngine``).
MAX_CONNECT_S = 300.0


class RolloutService:
    """The engine behind the endpoints: one call at a time, and the version of the weights it holds.

    ``params``: the served model's tensors (``weight_channel.served_params``), which every weight push is
    checked against before anything loads (None: pushes are refused, there is nothing to check them by).
    ``vocab_size``: prompt ids must lie below it (default: the tokenizer's length)."""

    def __init__(self, engine, model_name: str, params: ServedParams | None = None, vocab_size: int | None = None):
        self.engine, self.model_name, self.params = engine, model_name, params
        self.tokenizer = engine.tokenizer
        self.vocab_size = vocab_size or tokenizer_vocab(self.tokenizer)
        self.lock = threading.Lock()
        self.connecting = threading.Lock()  # one trainer joins at a time; a second is refused, not queued
        self.weights_version: str | None = None  # None: the weights the server loaded at start
        self.broken: str | None = None  # why the engine cannot serve (a load that failed half-way)

    def generate(self, prompt_ids: list[list[int]], **sampling) -> list[list[Any]]:
        with self.lock:
            if self.broken:
                raise BadRequest(self.broken, status=503)
            return self.engine.generate(prompt_ids, **sampling)

    def check_push(self, specs: list[dict]) -> None:
        """A 400 naming the first tensor the served model does not hold as described, before anything loads."""
        if self.params is None:
            raise BadRequest(f"this server cannot check pushed weights against {self.model_name!r} (its directory "
                             f"has no safetensors files), so it takes none")
        try:
            check_specs(specs, self.params, "weights")
        except ValueError as err:
            raise BadRequest(str(err)) from None

    def _load(self, weights) -> None:
        """Into the engine, under the lock; a load that fails after the checks leaves the engine half-loaded:
        it is marked broken (503 on every generation, saying to restart), never served from silently."""
        try:
            self.engine.load_weights(iter(weights))
        except Exception as err:
            self.broken = (f"a weight push failed while loading ({type(err).__name__}: {str(err)[:200]}); the engine "
                           f"holds a mix of old and new weights: restart `unirl serve-rollout`")
            raise

    # What the OpenAI endpoints call; the agent endpoint (``unirl.rollout.sessions.AgentService``) records sessions.
    def default_max_tokens(self, chat: bool) -> int:
        return 256 if chat else 16

    def admit(self, request: dict, headers, prompts: list[list[int]], sampling: dict) -> Any:
        """Check a call before it generates; returns what ``record`` needs (here nothing)."""
        return None

    async def agenerate(self, prompt_ids: list[list[int]], **sampling) -> list[list[Any]]:
        return await asyncio.to_thread(self.generate, prompt_ids, **sampling)

    def record(self, admitted: Any, prompts: list[list[int]], gens: list[list[Any]]) -> None:
        """After a call generated (here nothing is kept)."""

    def load_weights(self, data: bytes, version: str | None) -> int:
        from safetensors.torch import load

        try:
            weights = load(data)
        except Exception as err:  # safetensors' own error type: not a safetensors file
            raise BadRequest(f"POST /weights takes a safetensors file of the policy's weights: {err}") from None
        self.check_push(describe(list(weights.items())))
        with self.lock:
            self._load(weights.items())
            self.weights_version = version
        return len(weights)

    def connect(self, request: dict) -> dict:
        """Join a trainer's weight group (``unirl.rollout.weight_channel``); a new trainer replaces the old one.
        The wait is bounded (``MAX_CONNECT_S``) and one join runs at a time (a second is refused, 409)."""
        from unirl.rollout.weight_channel import WeightGroup

        host = _field(request, "host", str)
        port = _field(request, "port", int, low=1, high=65535)
        timeout = float(_field(request, "timeout_s", (int, float), 120.0, low=1, high=MAX_CONNECT_S))
        if host is None or port is None:
            raise BadRequest("POST /weights/connect takes {\"host\": str, \"port\": int, \"timeout_s\": number}")
        if not self.connecting.acquire(blocking=False):
            raise BadRequest("another trainer is joining its weight group now; try again when it has", status=409)
        try:
            self.group = WeightGroup(host, port, rank=1, timeout_s=timeout)
        except RuntimeError as err:  # torch.distributed's errors carry a C++ stack after their first line
            raise BadRequest(f"could not join the trainer's weight group at {host}:{port} within {timeout:g} s: "
                             f"{str(err).strip().splitlines()[0][:300]}", status=502) from None
        finally:
            self.connecting.release()
        return {"connected": True}

    def receive_weights(self, request: dict) -> dict:
        """The tensors a trainer broadcasts over its group, loaded into the engine between generations. A push
        that does not fit the served model is refused before a byte is received, and the group is dropped (the
        trainer's broadcast fails at once instead of waiting for a receiver that never comes)."""
        specs = request.get("tensors")
        group = getattr(self, "group", None)
        if group is None:
            raise BadRequest("no trainer connected its weight group: POST /weights/connect first")
        try:
            if not isinstance(specs, list) or not all(isinstance(s, dict) and {"name", "shape", "dtype"} <= set(s)
                                                      for s in specs):
                raise BadRequest("POST /weights/receive takes {\"tensors\": [{\"name\", \"shape\", \"dtype\"}], "
                                 "\"version\"}")
            self.check_push(specs)
        except BadRequest:
            self.group = None
            raise
        with self.lock:
            weights = group.receive(specs)
            self._load(weights)
            self.weights_version = request.get("version")
        return {"loaded": len(weights), "weights_version": self.weights_version}

    def served(self) -> dict:
        """``GET /weights``: what a push must hold (the served model's tensors) and the version now served."""
        tensors = None if self.params is None else {
            n: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")} for n, (shape, dtype) in self.params.items()}
        return {"weights_version": self.weights_version, "tensors": tensors}


def make_app(service: RolloutService, guards: Guards, weight_guards: Guards | None = None, extra_routes=None) -> FastAPI:
    """The ASGI app over ``service``; ``weight_guards`` carry the larger body limit of ``POST /weights`` (None:
    no weight routes, the agent endpoint's case); ``extra_routes(app, guarded)`` adds routes behind the same
    guards (the agent endpoint's sessions)."""
    app = FastAPI(title="serve-rollout", redirect_slashes=False, docs_url=None, redoc_url=None, openapi_url=None)

    def answer(request: Request, status: int, body: dict) -> JSONResponse:
        if status != 200:  # one line on stderr for each request that failed
            client = request.client.host if request.client else "?"
            sys.stderr.write(f"serve-rollout: {client} {request.method} {request.url.path} {status}: "
                             f"{body['error']['message'][:300]}\n")
        return JSONResponse(body, status_code=status)

    def error(request: Request, status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return answer(request, status, {"error": {"message": message, "type": kind}})

    async def guarded(request: Request, handler, guard: Guards = guards) -> JSONResponse:
        try:
            body = await guard.read_body(request)
        except Refused as err:
            return error(request, err.status, str(err))
        try:
            return answer(request, 200, await handler(body, request))
        except BadRequest as err:
            return error(request, err.status, str(err))
        except Exception as err:  # the engine failed: the server says so and goes on serving
            return error(request, 500, f"the engine failed: {type(err).__name__}: {err}", "server_error")

    @app.get("/health")
    async def health(request: Request):
        return answer(request, 200, {"status": "ok", "model": service.model_name,
                                     "weights_version": service.weights_version})

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            guards.check_token(request)
        except Refused as err:
            return error(request, err.status, str(err))
        return answer(request, 200, {"object": "list", "data": [
            {"id": service.model_name, "object": "model", "created": 0, "owned_by": "unirl"}]})

    @app.post("/generate")
    async def generate(request: Request):
        return await guarded(request, lambda body, _: _generate(service, _json(body)))

    if weight_guards is not None:
        _weight_routes(app, service, guarded, weight_guards)
    if extra_routes is not None:
        extra_routes(app, guarded)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await guarded(request, lambda body, req: _openai(service, _json(body), chat=False, headers=req.headers))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await guarded(request, lambda body, req: _openai(service, _json(body), chat=True, headers=req.headers))

    @app.exception_handler(HTTPException)
    async def no_such_path(request: Request, exc: HTTPException):
        if exc.status_code not in (404, 405):
            return error(request, exc.status_code, str(exc.detail))
        return error(request, 404, f"no such path {request.method} {request.url.path!r}; use GET /health, GET "
                                   f"/v1/models, POST /generate, /weights, /v1/completions or /v1/chat/completions")

    return app


def _weight_routes(app: FastAPI, service: RolloutService, guarded, weight_guards: Guards) -> None:
    """``POST /weights`` (a safetensors body), ``/weights/connect`` and ``/weights/receive`` (the trainer's gloo
    group) and ``GET /weights`` (what a push must hold), all behind ``weight_guards`` (their token and larger
    body limit). They run on threads of their own: a join waiting for a trainer that never comes does not take
    the threads generations run on (eight such joins once delayed every generation by ~78 s, issue 51)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="serve-rollout-weights")

    def off(fn, *args):
        return asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    @app.get("/weights")
    async def served(request: Request):
        return await guarded(request, lambda body, _: _now(service.served()), weight_guards)

    @app.post("/weights")
    async def weights(request: Request):
        async def load(body: bytes, req: Request) -> dict:
            version = req.headers.get("x-unirl-weights-version")
            count = await off(service.load_weights, body, version)
            return {"loaded": count, "weights_version": version}

        return await guarded(request, load, weight_guards)

    @app.post("/weights/connect")
    async def weights_connect(request: Request):
        return await guarded(request, lambda body, _: off(service.connect, _json(body)), weight_guards)

    @app.post("/weights/receive")
    async def weights_receive(request: Request):
        return await guarded(request, lambda body, _: off(service.receive_weights, _json(body)), weight_guards)


async def _now(value):
    return value


async def _generate(service: RolloutService, request: dict) -> dict:
    prompts = check_prompt_ids(request.get("prompt_ids"), service.vocab_size)
    sampling = _sampling(request, max_tokens_key="max_new_tokens", default_max=256)
    sampling["greedy"] = _field(request, "greedy", bool, False) or sampling["greedy"]
    check_seed(sampling, len(prompts))
    gens = await asyncio.to_thread(service.generate, prompts, **sampling)
    return {"generations": [[{"response_ids": g.response_ids, "logprobs": g.logprobs, "text": g.text,
                              "finished": g.finished} for g in group] for group in gens]}


def _prompts(service: RolloutService, request: dict, chat: bool) -> list[list[int]]:
    """The request's prompts as token ids: chat messages through the model's chat template; a
    completion's ``prompt`` as a string, a list of strings, token ids or lists of token ids."""
    tok = service.tokenizer
    if chat:
        messages = request.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise BadRequest("'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
        if not getattr(tok, "chat_template", None):
            raise BadRequest(f"model {service.model_name!r} has no chat template; use /v1/completions")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return check_prompt_ids([list(ids)], service.vocab_size, "messages")
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return check_prompt_ids([prompt], service.vocab_size, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
        return check_prompt_ids([tok(p).input_ids for p in prompt], service.vocab_size, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
        return check_prompt_ids(prompt, service.vocab_size, "prompt")
    raise BadRequest("'prompt' must be a non-empty string, a list of strings, token ids or lists of token ids")


async def _openai(service: RolloutService, request: dict, chat: bool, headers=None) -> dict:
    model = request.get("model")
    if model is not None and model != service.model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {service.model_name!r} (GET /v1/models)")
    prompts = _prompts(service, request, chat)
    sampling = _sampling(request, max_tokens_key=("max_completion_tokens", "max_tokens") if chat else "max_tokens",
                         default_max=service.default_max_tokens(chat))
    check_seed(sampling, len(prompts))
    want_logprobs = bool(request.get("logprobs")) if chat else request.get("logprobs") is not None
    token_ids = bool(request.get("return_token_ids"))  # vLLM's extension: the exact ids, token-in / token-out
    admitted = service.admit(request, headers or {}, prompts, sampling)
    gens = await service.agenerate(prompts, **sampling)
    service.record(admitted, prompts, gens)
    choices, completion_tokens = [], 0
    for group in gens:
        for g in group:
            completion_tokens += len(g.response_ids)
            choices.append(_choice(service, g, len(choices), sampling, chat, want_logprobs, token_ids))
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": service.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            **({"prompt_token_ids": prompts[0] if len(prompts) == 1 else prompts} if token_ids else {})}


def _choice(service: RolloutService, g, index: int, sampling: dict, chat: bool, want_logprobs: bool,
            token_ids: bool) -> dict:
    reason = "stop" if g.finished or (sampling["stop"] and len(g.response_ids) < sampling["max_new_tokens"]) else "length"
    tokens = [service.tokenizer.decode([t]) for t in g.response_ids] if want_logprobs else []
    if chat:
        logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(tokens, g.logprobs)]} if want_logprobs else None
        choice = {"index": index, "message": {"role": "assistant", "content": g.text}, "logprobs": logprobs,
                  "finish_reason": reason}
    else:
        logprobs = {"tokens": tokens, "token_logprobs": list(g.logprobs), "top_logprobs": None,
                    "text_offset": _offsets(tokens)} if want_logprobs else None
        choice = {"index": index, "text": g.text, "logprobs": logprobs, "finish_reason": reason}
    if token_ids:
        choice["token_ids"] = list(g.response_ids)
    return choice


def _offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def make_server(model: str, host: str = "127.0.0.1", port: int = 8100, *, served_name: str | None = None,
                dtype: str = "auto", seed: int = 0, max_model_len: int | None = None, gpu_memory_utilization: float = 0.3,
                tensor_parallel_size: int = 1, enforce_eager: bool = True, kv_cache_gb: float | None = None,
                max_body_mb: float = 64.0,
                max_weights_mb: float = 65536.0, body_timeout_s: float = 600.0, token: str | None = None,
                grace_s: float = 10.0, resolve=None):
    """A server (bound, not yet serving) with vLLM loaded on ``model`` (a directory or a hub name; ``resolve``
    turns another name into one: ``unirl serve-rollout`` passes the text models' resolver, so ``tiny`` and the
    named models serve too). ``port=0`` picks a free port (``server.server_address[1]``)."""
    from unirl.serving.server import AppServer
    from unirl.rollout.vllm import VLLMEngine

    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535 (0 picks a free one), got {port}")
    if kv_cache_gb is not None and not kv_cache_gb > 0:
        raise ValueError(f"--kv-cache-gb must be > 0 (GiB), got {kv_cache_gb}")
    guards = Guards.from_settings("serve-rollout", max_body_mb=max_body_mb, body_timeout_s=body_timeout_s, token=token,
                                  token_env=TOKEN_ENV)
    # The weight routes change what every client is served: they need a token even on loopback, one made
    # now when none is given, which ``token_path(port)`` hands to a trainer on this machine (``ServerEngine``).
    made_token = None if guards.token else secrets.token_urlsafe(32)
    weight_guards = Guards.from_settings("serve-rollout", max_body_mb=max_weights_mb, body_timeout_s=body_timeout_s,
                                         token=guards.token or made_token, token_env=TOKEN_ENV)
    if host not in ("127.0.0.1", "localhost", "::1") and guards.token is None:
        raise ValueError(f"serve-rollout: --host {host} exposes the policy beyond this machine; give a --token "
                         f"(or ${TOKEN_ENV}) that every client must send")
    path = resolve(model) if resolve is not None else model
    engine = VLLMEngine(path, dtype=dtype, seed=seed,
                        gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                        enforce_eager=enforce_eager, max_model_len=max_model_len,
                        kv_cache_bytes=None if kv_cache_gb is None else int(kv_cache_gb * (1 << 30)))
    service = RolloutService(engine, served_name or model, params=served_params(_local_dir(path)))
    server = AppServer(make_app(service, guards, weight_guards), host, port, grace_s=grace_s)
    server.token_file = None if made_token is None else write_token(made_token, server.server_address[1])
    return server


def tokenizer_vocab(tokenizer) -> int:
    """The ids a tokenizer knows: its length, or one past the largest id of its vocabulary (a tokenizer with no
    length)."""
    try:
        return len(tokenizer)
    except TypeError:
        return max(tokenizer.get_vocab().values()) + 1


def _local_dir(path: str) -> str:
    """The directory vLLM loaded ``path`` from: itself, or a hub name's snapshot in the local cache."""
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)
    except Exception:  # not in the cache as a hub snapshot: served_params finds no files and pushes are refused
        return path
