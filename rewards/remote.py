"""Rewards over HTTP, the server half: ``unirl serve-reward NAME`` hosts a reward that runs use as
``http://host:port``. The protocol and the client are in ``rewards/remote_client.py`` (re-exported
here).
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rewards.loading import load_reward, reward_info
from rewards.models import ModelReward
from rewards.registry import RewardError
from rewards.remote_client import RemoteReward, decode_sample, encode_sample
from rewards.scoring import score_batch

__all__ = ["RemoteReward", "decode_sample", "encode_sample", "make_server"]


# ----------------------------------------------------------------------------------------------
# Server
# ----------------------------------------------------------------------------------------------


def make_server(spec: str, host: str = "127.0.0.1", port: int = 8000, kwargs: dict | None = None) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for the reward ``spec`` with ``kwargs`` bound.

    ``spec`` is anything ``load_reward`` takes. A model reward loads its model here, before the
    port opens, so the first request does not time out on a download. ``port=0`` picks a free port
    (``server.server_address[1]``).
    """
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
