"""Rewards over HTTP, the server half: ``unirl serve-reward NAME`` hosts a reward that runs use as
``http://host:port``. The protocol and the client are in ``unirl/rewards/remote_client.py`` (re-exported
here).

The server is an ASGI app (FastAPI) run by uvicorn. Every ``POST /score`` goes through one
``BatchQueue`` (``unirl/rewards/batching.py``): concurrent requests are joined into one reward call of at
most ``max_batch`` samples, taken when full or when the oldest request has waited ``max_wait_ms``;
one worker thread makes the calls, so a model reward never runs in two threads at once. When
``max_queue`` requests are waiting, one more is answered 503 (the client retries 502/503/504 with
backoff). Each request gets what scoring it alone gives (``score_requests``), errors included:

- ``GET /info`` -> ``{"name", "modality", "description"}``; ``GET /health`` -> ``{"status": "ok",
  "queued", "scoring", "batches", "answered", "max_batch", "max_wait_ms", "max_queue"}``.
- ``POST /score``: 200 ``{"scores": [...]}``; 400 for a malformed request; 500 with the
  ``RewardError`` message (reward, sample, prompt) when the reward raises or returns bad scores;
  503 when the queue is full. Every error body is ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from unirl.rewards.batching import BatchQueue, QueueFull
from unirl.serving.guards import TOKEN_ENV, Guards, Refused
from unirl.serving.server import AppServer
from unirl.rewards.loading import load_reward, reward_info
from unirl.rewards.models import ModelReward
from unirl.rewards.registry import RewardError
from unirl.rewards.remote_client import RemoteReward, decode_sample, encode_sample
from unirl.rewards.scoring import score_requests

__all__ = ["TOKEN_ENV", "RemoteReward", "decode_sample", "encode_sample", "make_app", "make_server"]


def make_server(spec: str, host: str = "127.0.0.1", port: int = 8000, kwargs: dict | None = None, *,
                max_batch: int = 256, max_wait_ms: float = 2.0, max_queue: int = 1024, max_body_mb: float = 64.0,
                body_timeout_s: float = 30.0, token: str | None = None, grace_s: float = 10.0) -> AppServer:
    """A server (bound, not yet serving) for the reward ``spec`` with ``kwargs`` bound.

    ``spec`` is anything ``load_reward`` takes. A model reward loads its model here, before the
    port opens, so the first request does not time out on a download. ``port=0`` picks a free port
    (``server.server_address[1]``). ``max_batch`` (samples per reward call; 1 never joins
    requests), ``max_wait_ms`` and ``max_queue`` (requests waiting) set the batching.

    ``kwargs`` are the server's: a request whose columns name one is refused (400). A request body
    over ``max_body_mb`` is refused (413), one that has not fully arrived after ``body_timeout_s``
    too (408). With a ``token`` (or ``$UNIRL_REWARD_TOKEN``) every request but ``/health`` must send
    ``Authorization: Bearer <token>`` (401 otherwise). On SIGTERM / SIGINT the requests in flight get
    ``grace_s`` seconds to finish; a reward call still running then is abandoned.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535 (0 picks a free one), got {port}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    guards = Guards.from_settings("serve-reward", max_body_mb=max_body_mb, body_timeout_s=body_timeout_s, token=token,
                                  settings=kwargs or {})
    # First, so that bad settings fail before a model loads; ``fn`` is bound below, before any call.
    queue = BatchQueue(lambda requests: score_requests(fn, requests, name=spec), size=lambda request: len(request[0]),
                       max_batch=max_batch, max_wait=max_wait_ms / 1000, max_queue=max_queue)
    fn = load_reward(spec, **(kwargs or {}))
    if isinstance(fn, ModelReward):
        fn.ensure_loaded()
    try:
        info = reward_info(spec)
        meta = {"name": info.name, "modality": info.modality, "description": info.description}
    except RewardError:  # a file or module spec: not registered under a name
        meta = {"name": spec, "modality": getattr(fn, "modality", None), "description": ""}
    return AppServer(make_app(spec, meta, queue, guards), host, port, grace_s=grace_s)


def make_app(spec: str, meta: dict, queue: BatchQueue, guards: Guards | None = None) -> FastAPI:
    """The ASGI app: ``/info``, ``/health`` and ``/score`` over ``queue``, which it starts and stops.
    ``guards``: the token, body limits and the server's settings (``unirl/serving/guards.py``; default:
    no token, 64 MB, 30 s)."""
    guards = guards or Guards("serve-reward")

    @asynccontextmanager
    async def lifespan(app):
        queue.start()
        yield
        await queue.stop()

    app = FastAPI(title=f"serve-reward {spec}", lifespan=lifespan, redirect_slashes=False,
                  docs_url=None, redoc_url=None, openapi_url=None)

    def answer(request: Request, status: int, body: dict) -> JSONResponse:
        if status != 200:  # one line on stderr for each request that failed
            client = request.client.host if request.client else "?"
            first = body["error"].splitlines()[0][:300] if body.get("error") else ""
            sys.stderr.write(f"serve-reward {spec}: {client} {request.method} {request.url.path} {status}: {first}\n")
        return JSONResponse(body, status_code=status)

    @app.get("/info")
    @app.get("/info/")
    async def info(request: Request):
        try:
            guards.check_token(request)
        except Refused as err:
            return answer(request, err.status, {"error": str(err)})
        return answer(request, 200, meta)

    @app.get("/health")
    @app.get("/health/")
    async def health(request: Request):
        return answer(request, 200, {"status": "ok", **queue.stats(), "max_batch": queue.max_batch,
                                     "max_wait_ms": queue.max_wait * 1000, "max_queue": queue.max_queue})

    @app.post("/score")
    @app.post("/score/")
    async def score(request: Request):
        return await _score(request, spec, guards, queue, answer)

    @app.exception_handler(HTTPException)
    async def no_such_path(request: Request, exc: HTTPException):
        if exc.status_code not in (404, 405):
            return answer(request, exc.status_code, {"error": str(exc.detail)})
        use = "POST /score" if request.method == "POST" else "GET /info, GET /health or POST /score"
        return answer(request, 404, {"error": f"no such path {request.url.path!r}; use {use}"})

    return app


async def _score(request: Request, spec: str, guards: Guards, queue: BatchQueue, answer) -> JSONResponse:
    """``POST /score``: the guarded body parsed, the columns checked, the batch queued; every failure is
    ``answer``ed with its status (413/408/401 from the guards, 400 malformed, 503 busy, 500 the reward)."""
    try:
        body = await guards.read_body(request)
    except Refused as err:
        return answer(request, err.status, {"error": str(err)})
    try:
        item = await _parse(body)
    except Exception as err:
        return answer(request, 400, {"error": f"malformed request: {type(err).__name__}: {err}"})
    try:  # the reward is called with the columns as keyword arguments: they would replace the server's
        guards.check_names(item[1], "column")
    except Refused as err:
        return answer(request, err.status, {"error": str(err)})
    try:
        scores = await queue.submit(item)
    except QueueFull as err:
        return answer(request, 503, {"error": f"reward server busy: {err}; try again later "
                                              f"(or serve with a larger --max-queue)"})
    except RewardError as err:
        return answer(request, 500, {"error": str(err)})
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # not a RewardError: a bug of the server, or the reward called sys.exit
        return answer(request, 500, {"error": f"reward {spec!r}: the server failed: {type(err).__name__}: {err}"})
    return answer(request, 200, {"scores": scores})


async def _parse(body: bytes) -> tuple[list, dict]:
    """``(samples, columns)`` of a ``POST /score`` body; images are decoded in a thread."""
    request = json.loads(body)
    raw = request["samples"]
    if all(isinstance(s, str) for s in raw):
        samples = list(raw)
    else:  # PNG decoding takes a while: off the event loop
        samples = await asyncio.to_thread(lambda: [decode_sample(s) for s in raw])
    columns = dict(request.get("columns") or {})
    if request.get("prompts") is not None:
        columns["prompts"] = request["prompts"]
    return samples, columns
