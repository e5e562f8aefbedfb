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
  that is no torch program; ``X-Unirl-Weights-Version`` names them.
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's request and answer shapes
  (``model``, ``prompt`` / ``messages``, ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``,
  ``seed``, ``logprobs``: the sampled tokens' log-probs; top alternatives are not returned).

Every error body is ``{"error": {"message": ..., "type": ...}}``, OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from unirl.serving.guards import Guards, Refused

#: The environment variable holding the shared token when ``--token`` is not given (the trainer's
#: client sends it too).
TOKEN_ENV = "UNIRL_ROLLOUT_TOKEN"


class BadRequest(Exception):
    """A request the server cannot answer as asked (400), with what was expected."""


class RolloutService:
    """The engine behind the endpoints: one call at a time, and the version of the weights it holds."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.tokenizer
        self.lock = threading.Lock()
        self.weights_version: str | None = None  # None: the weights the server loaded at start

    def generate(self, prompt_ids: list[list[int]], **sampling) -> list[list[Any]]:
        with self.lock:
            return self.engine.generate(prompt_ids, **sampling)

    def load_weights(self, data: bytes, version: str | None) -> int:
        from safetensors.torch import load

        try:
            weights = load(data)
        except Exception as err:  # safetensors' own error type: not a safetensors file
            raise BadRequest(f"POST /weights takes a safetensors file of the policy's weights: {err}") from None
        with self.lock:
            self.engine.load_weights(iter(weights.items()))
            self.weights_version = version
        return len(weights)

    def connect(self, request: dict) -> dict:
        """Join a trainer's weight group (``unirl.rollout.weight_channel``); a new trainer replaces the old one."""
        from unirl.rollout.weight_channel import WeightGroup

        host, port = request.get("host"), request.get("port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise BadRequest("POST /weights/connect takes {\"host\": str, \"port\": int}")
        self.group = WeightGroup(host, port, rank=1, timeout_s=float(request.get("timeout_s") or 600))
        return {"connected": True}

    def receive_weights(self, request: dict) -> dict:
        """The tensors a trainer broadcasts over its group, loaded into the engine between generations."""
        specs = request.get("tensors")
        if getattr(self, "group", None) is None:
            raise BadRequest("no trainer connected its weight group: POST /weights/connect first")
        if not isinstance(specs, list) or not all(isinstance(s, dict) and {"name", "shape", "dtype"} <= set(s) for s in specs):
            raise BadRequest("POST /weights/receive takes {\"tensors\": [{\"name\", \"shape\", \"dtype\"}], \"version\"}")
        with self.lock:
            weights = self.group.receive(specs)
            self.engine.load_weights(iter(weights))
            self.weights_version = request.get("version")
        return {"loaded": len(weights), "weights_version": self.weights_version}


def make_app(service: RolloutService, guards: Guards, weight_guards: Guards) -> FastAPI:
    """The ASGI app over ``service``; ``weight_guards`` carry the larger body limit of ``POST /weights``."""
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
            return error(request, 400, str(err))
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

    _weight_routes(app, service, guarded, weight_guards)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await guarded(request, lambda body, _: _openai(service, _json(body), chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await guarded(request, lambda body, _: _openai(service, _json(body), chat=True))

    @app.exception_handler(HTTPException)
    async def no_such_path(request: Request, exc: HTTPException):
        if exc.status_code not in (404, 405):
            return error(request, exc.status_code, str(exc.detail))
        return error(request, 404, f"no such path {request.method} {request.url.path!r}; use GET /health, GET "
                                   f"/v1/models, POST /generate, /weights, /v1/completions or /v1/chat/completions")

    return app


def _weight_routes(app: FastAPI, service: RolloutService, guarded, weight_guards: Guards) -> None:
    """``POST /weights`` (a safetensors body, under ``weight_guards``' larger limit), ``/weights/connect``
    and ``/weights/receive`` (the trainer's gloo group)."""

    @app.post("/weights")
    async def weights(request: Request):
        async def load(body: bytes, req: Request) -> dict:
            version = req.headers.get("x-unirl-weights-version")
            count = await asyncio.to_thread(service.load_weights, body, version)
            return {"loaded": count, "weights_version": version}

        return await guarded(request, load, weight_guards)

    @app.post("/weights/connect")
    async def weights_connect(request: Request):
        return await guarded(request, lambda body, _: asyncio.to_thread(service.connect, _json(body)))

    @app.post("/weights/receive")
    async def weights_receive(request: Request):
        return await guarded(request, lambda body, _: asyncio.to_thread(service.receive_weights, _json(body)))


def _json(body: bytes) -> dict:
    try:
        request = json.loads(body)
    except ValueError as err:
        raise BadRequest(f"the body is not JSON: {err}") from None
    if not isinstance(request, dict):
        raise BadRequest("the body must be a JSON object")
    return request


def _field(request: dict, name: str, kind: type | tuple, default: Any = None, *, low: float | None = None) -> Any:
    """``request[name]`` checked against ``kind`` (and ``>= low``), or ``default`` when absent or null."""
    value = request.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(f"{name!r} must be {names}, got {value!r}")
    if low is not None and value < low:
        raise BadRequest(f"{name!r} must be >= {low}, got {value!r}")
    return value


def _sampling(request: dict, *, max_tokens_key: str | tuple[str, ...], default_max: int) -> dict:
    keys = (max_tokens_key,) if isinstance(max_tokens_key, str) else max_tokens_key
    max_tokens = next((_field(request, k, int, low=1) for k in keys if request.get(k) is not None), default_max)
    temperature = float(_field(request, "temperature", (int, float), 1.0, low=0))
    stop = request.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest(f"'stop' must be a string or a list of strings, got {stop!r}")
    return dict(n=_field(request, "n", int, 1, low=1), max_new_tokens=max_tokens,
                temperature=temperature if temperature > 0 else 1.0, greedy=temperature == 0,
                top_p=float(_field(request, "top_p", (int, float), 1.0)), top_k=_field(request, "top_k", int, -1),
                stop=stop, seed=_field(request, "seed", int))


async def _generate(service: RolloutService, request: dict) -> dict:
    prompts = request.get("prompt_ids")
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p and all(
            isinstance(t, int) for t in p) for p in prompts)):
        raise BadRequest("'prompt_ids' must be a non-empty list of non-empty lists of token ids")
    sampling = _sampling(request, max_tokens_key="max_new_tokens", default_max=256)
    sampling["greedy"] = bool(request.get("greedy", False)) or sampling["greedy"]
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
        return [list(ids)]
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
        return [tok(p).input_ids for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p)
                                                   for p in prompt):
        return prompt
    raise BadRequest("'prompt' must be a non-empty string, a list of strings, token ids or lists of token ids")


async def _openai(service: RolloutService, request: dict, chat: bool) -> dict:
    model = request.get("model")
    if model is not None and model != service.model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {service.model_name!r} (GET /v1/models)")
    prompts = _prompts(service, request, chat)
    sampling = _sampling(request, max_tokens_key=("max_completion_tokens", "max_tokens") if chat else "max_tokens",
                         default_max=256 if chat else 16)
    want_logprobs = bool(request.get("logprobs")) if chat else request.get("logprobs") is not None
    gens = await asyncio.to_thread(service.generate, prompts, **sampling)
    choices, completion_tokens = [], 0
    for group in gens:
        for g in group:
            index = len(choices)
            completion_tokens += len(g.response_ids)
            reason = "stop" if g.finished or (sampling["stop"] and len(g.response_ids) < sampling["max_new_tokens"]) else "length"
            tokens = [service.tokenizer.decode([t]) for t in g.response_ids] if want_logprobs else []
            if chat:
                logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                        for t, lp in zip(tokens, g.logprobs)]} if want_logprobs else None
                choices.append({"index": index, "message": {"role": "assistant", "content": g.text},
                                "logprobs": logprobs, "finish_reason": reason})
            else:
                logprobs = {"tokens": tokens, "token_logprobs": list(g.logprobs), "top_logprobs": None,
                            "text_offset": _offsets(tokens)} if want_logprobs else None
                choices.append({"index": index, "text": g.text, "logprobs": logprobs, "finish_reason": reason})
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": service.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


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
    weight_guards = Guards.from_settings("serve-rollout", max_body_mb=max_weights_mb, body_timeout_s=body_timeout_s,
                                         token=token, token_env=TOKEN_ENV)
    if host not in ("127.0.0.1", "localhost", "::1") and guards.token is None:
        raise ValueError(f"serve-rollout: --host {host} exposes the policy beyond this machine; give a --token "
                         f"(or ${TOKEN_ENV}) that every client must send")
    path = resolve(model) if resolve is not None else model
    engine = VLLMEngine(path, dtype=dtype, seed=seed,
                        gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                        enforce_eager=enforce_eager, max_model_len=max_model_len,
                        kv_cache_bytes=None if kv_cache_gb is None else int(kv_cache_gb * (1 << 30)))
    service = RolloutService(engine, served_name or model)
    return AppServer(make_app(service, guards, weight_guards), host, port, grace_s=grace_s)
