"""Rewards over HTTP, the server half: ``unirl serve-reward NAME`` hosts a reward that runs use as
``http://host:port``. The protocol and the client are in ``rewards/remote_client.py`` (re-exported
here).

The server is an ASGI app (FastAPI) run by uvicorn. Every ``POST /score`` goes through one
``BatchQueue`` (``rewards/batching.py``): concurrent requests are joined into one reward call of at
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
import hmac
import json
import socket
import sys
import threading
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from unirl.rewards.batching import BatchQueue, QueueFull
from unirl.rewards.loading import load_reward, reward_info
from unirl.rewards.models import ModelReward
from unirl.rewards.registry import RewardError
from unirl.rewards.remote_client import RemoteReward, decode_sample, encode_sample
from unirl.rewards.scoring import score_requests

__all__ = ["RemoteReward", "RewardServer", "decode_sample", "encode_sample", "make_app", "make_server"]


#: The environment variable holding the shared token when ``--token`` / ``token=`` is not given.
TOKEN_ENV = "UNIRL_REWARD_TOKEN"


def make_server(spec: str, host: str = "127.0.0.1", port: int = 8000, kwargs: dict | None = None, *,
                max_batch: int = 256, max_wait_ms: float = 2.0, max_queue: int = 1024, max_body_mb: float = 64.0,
                body_timeout_s: float = 30.0, token: str | None = None, grace_s: float = 10.0) -> RewardServer:
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
    import os

    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535 (0 picks a free one), got {port}")
    if max_body_mb <= 0 or body_timeout_s <= 0 or grace_s < 0:
        raise ValueError(f"max_body_mb and body_timeout_s must be > 0 and grace_s >= 0, "
                         f"got {max_body_mb}, {body_timeout_s}, {grace_s}")
    token = token or os.environ.get(TOKEN_ENV) or None
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
    app = make_app(spec, meta, queue, settings=set(kwargs or {}), max_body=int(max_body_mb * 2**20),
                   body_timeout=body_timeout_s, token=token)
    return RewardServer(app, host, port, grace_s=grace_s)


class BodyTooLarge(ValueError):
    pass


def make_app(spec: str, meta: dict, queue: BatchQueue, *, settings: set[str] = frozenset(), max_body: int = 64 * 2**20,
             body_timeout: float = 30.0, token: str | None = None) -> FastAPI:
    """The ASGI app: ``/info``, ``/health`` and ``/score`` over ``queue``, which it starts and stops.
    ``settings``: the server's kwargs, which a request may not name; ``max_body`` bytes,
    ``body_timeout`` seconds and ``token``: see ``make_server``."""

    @asynccontextmanager
    async def lifespan(app):
        queue.start()
        yield
        await queue.stop()

    app = FastAPI(title=f"serve-reward {spec}", lifespan=lifespan, redirect_slashes=False,
                  docs_url=None, redoc_url=None, openapi_url=None)
    guard = RequestGuard(f"serve-reward {spec}", max_body=max_body, body_timeout=body_timeout, token=token)

    @app.get("/info")
    @app.get("/info/")
    async def info(request: Request):
        return guard.refused(request) or guard.answer(request, 200, meta)

    @app.get("/health")
    @app.get("/health/")
    async def health(request: Request):
        return guard.answer(request, 200, {"status": "ok", **queue.stats(), "max_batch": queue.max_batch,
                                           "max_wait_ms": queue.max_wait * 1000, "max_queue": queue.max_queue})

    @app.post("/score")
    @app.post("/score/")
    async def score(request: Request):
        item = await guard.read(request, _parse)
        if isinstance(item, JSONResponse):  # refused, too large, too slow or malformed
            return item
        return await _score(request, item, guard, queue, spec, settings)

    @app.exception_handler(HTTPException)
    async def no_such_path(request: Request, exc: HTTPException):
        if exc.status_code not in (404, 405):
            return guard.answer(request, exc.status_code, {"error": str(exc.detail)})
        use = "POST /score" if request.method == "POST" else "GET /info, GET /health or POST /score"
        return guard.answer(request, 404, {"error": f"no such path {request.url.path!r}; use {use}"})

    return app


class RequestGuard:
    """What every request to a server meets before its work: the token (401), the body's size (413) and
    arrival time (408), its parsing (400); and one line on stderr for each request that failed.
    ``where`` starts that line (``serve-reward gsm8k``)."""

    def __init__(self, where: str, *, max_body: int, body_timeout: float, token: str | None):
        self.where, self.max_body, self.body_timeout, self.token = where, max_body, body_timeout, token

    def answer(self, request: Request, status: int, body: dict) -> JSONResponse:
        if status != 200:  # one line on stderr for each request that failed
            client = request.client.host if request.client else "?"
            first = body["error"].splitlines()[0][:300] if body.get("error") else ""
            sys.stderr.write(f"{self.where}: {client} {request.method} {request.url.path} {status}: {first}\n")
        return JSONResponse(body, status_code=status)

    def refused(self, request: Request) -> JSONResponse | None:
        """401 unless the request carries the token (when the server has one)."""
        if self.token is None:
            return None
        sent = request.headers.get("authorization", "")
        if hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
            return None
        return self.answer(request, 401, {"error": "missing or wrong token: send 'Authorization: Bearer <token>' "
                                                   f"(the client sends kwargs.token or ${TOKEN_ENV})"})

    async def read(self, request: Request, parse) -> Any:
        """``await parse(body)`` of an allowed request, or the error response that refuses it."""
        denied = self.refused(request)
        if denied is not None:
            return denied
        try:
            body = await asyncio.wait_for(_read_body(request, self.max_body), self.body_timeout)
        except BodyTooLarge as err:
            return self.answer(request, 413, {"error": str(err)})
        except TimeoutError:
            return self.answer(request, 408, {"error": f"the request body did not arrive within {self.body_timeout:g} s"})
        try:
            return await parse(body)
        except Exception as err:
            return self.answer(request, 400, {"error": f"malformed request: {type(err).__name__}: {err}"})


async def _score(request: Request, item: tuple[list, dict], guard: RequestGuard, queue: BatchQueue, spec: str,
                 settings: set[str]) -> JSONResponse:
    """A parsed ``/score`` request through the queue: 200 with the scores, or why not."""
    named = sorted(settings & set(item[1]))
    if named:  # the reward is called with the columns as keyword arguments: they would replace the server's
        return guard.answer(request, 400, {"error": f"request column(s) {', '.join(map(repr, named))} are settings "
                                                    f"of this server (serve-reward --kwargs); a request may not change them"})
    try:
        scores = await queue.submit(item)
    except QueueFull as err:
        return guard.answer(request, 503, {"error": f"reward server busy: {err}; try again later "
                                                    f"(or serve with a larger --max-queue)"})
    except RewardError as err:
        return guard.answer(request, 500, {"error": str(err)})
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # not a RewardError: a bug of the server, or the reward called sys.exit
        return guard.answer(request, 500, {"error": f"reward {spec!r}: the server failed: {type(err).__name__}: {err}"})
    return guard.answer(request, 200, {"scores": scores})


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (``BodyTooLarge``) as soon as it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {int(declared)} bytes is over the server's limit of {limit} "
                           f"(serve-reward --max-body-mb)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is over the server's limit of {limit} bytes (serve-reward --max-body-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


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


class RewardServer:
    """uvicorn serving an app on a socket bound at once, with the methods of the standard library's
    servers (``server_address``, ``serve_forever``, ``shutdown``, ``server_close``), so a caller
    may serve in a thread and stop it from another.

    In the main thread, SIGINT and SIGTERM stop it gracefully (the requests in flight are answered),
    then act as usual (``KeyboardInterrupt``; termination).
    """

    def __init__(self, app, host: str, port: int, grace_s: float = 10.0):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(2048)  # connections wait here, not dropped, while the server starts
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()[:2]
        # log_config=None: leave the process's logging alone; uvicorn's warnings still reach stderr.
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=grace_s)
        self._server = uvicorn.Server(config)
        self._stop_requested = False
        self._stopped = threading.Event()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until ``shutdown()``. ``poll_interval`` is accepted for the standard library's
        signature; uvicorn looks for a shutdown every 0.1 s."""
        self._stopped.clear()
        try:
            if not self._stop_requested:
                self._server.run(sockets=[self.socket])
                if not self._server.started and not self._stop_requested:
                    raise RuntimeError("serve-reward could not start serving; see the errors above")
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` (running in another thread) and wait until it has returned."""
        self._stop_requested = True
        self._server.should_exit = True
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
