"""The one way the ``serve-*`` commands run their HTTP server once it is built."""

from __future__ import annotations


def serve_until_interrupted(server, what: str) -> None:
    """Print ``serving <what> at http://host:port`` (the line scripts and tests wait for), serve until
    Ctrl-C or SIGTERM's ``KeyboardInterrupt``, and close the socket."""
    host, port = server.server_address[:2]
    print(f"serving {what} at http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
