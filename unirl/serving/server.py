"""The server base that ``unirl serve-reward``, ``unirl serve-tool``, the LLM judge's test server and
``unirl serve-rollout`` share: an ASGI app served by uvicorn on a socket bound at once (``AppServer``), with
the standard library servers' methods, so a caller may serve in a thread and stop it from another. What
every one of them refuses before a request reaches it is ``unirl.serving.guards``.
"""

from __future__ import annotations

import socket
import threading

import uvicorn


class AppServer:
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
                    raise RuntimeError("the server could not start serving; see the errors above")
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` (running in another thread) and wait until it has returned."""
        self._stop_requested = True
        self._server.should_exit = True
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
