"""What an HTTP server of ours (``unirl serve-reward``, ``unirl serve-tool``) refuses before a request
reaches the reward or the tool: a missing or wrong shared token (401), a body over the size limit
(413), a body that has not fully arrived in time (408), and a request naming one of the server's own
settings (400: the server's ``--kwargs`` win, a client may not change them).

One ``Guards`` per server; the two servers answer with the same statuses and messages.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from dataclasses import dataclass
from typing import Iterable

from fastapi import Request

#: The environment variable holding the shared token when ``--token`` / ``token=`` is not given (the
#: client, ``unirl/rewards/remote_client.py``, reads the same one).
TOKEN_ENV = "UNIRL_REWARD_TOKEN"


class Refused(Exception):
    """A request refused by a guard: ``status`` and the message of the ``{"error": ...}`` body."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class BodyTooLarge(Refused):
    def __init__(self, message: str):
        super().__init__(413, message)


@dataclass(frozen=True)
class Guards:
    #: The command, for messages naming its flags (``serve-reward``).
    command: str
    max_body: int = 64 * 2**20
    body_timeout: float = 30.0
    token: str | None = None
    #: The server's bound kwargs, which a request may not name.
    settings: frozenset[str] = frozenset()
    #: The environment variable the token defaults to (``unirl serve-rollout``: ``UNIRL_ROLLOUT_TOKEN``).
    token_env: str = TOKEN_ENV

    @classmethod
    def from_settings(cls, command: str, *, max_body_mb: float, body_timeout_s: float, token: str | None,
                      settings: Iterable[str] = (), token_env: str = TOKEN_ENV) -> "Guards":
        """Checked settings; ``token`` defaults to ``$<token_env>`` (``$UNIRL_REWARD_TOKEN``; none when unset or empty)."""
        if not max_body_mb > 0 or not body_timeout_s > 0:
            raise ValueError(f"{command}: max_body_mb and body_timeout_s must be > 0, got {max_body_mb}, {body_timeout_s}")
        return cls(command, int(max_body_mb * 2**20), float(body_timeout_s), token or os.environ.get(token_env) or None,
                   frozenset(settings), token_env)

    def check_token(self, request: Request) -> None:
        """Refused (401) unless the request carries the token (when the server has one)."""
        if self.token is None:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
            raise Refused(401, "missing or wrong token: send 'Authorization: Bearer <token>' (the client sends "
                               f"kwargs.token or ${self.token_env})")

    async def read_body(self, request: Request) -> bytes:
        """The token checked, then the body, refused when too large (413) or too slow (408)."""
        self.check_token(request)
        try:
            return await asyncio.wait_for(self._read(request), self.body_timeout)
        except TimeoutError:
            raise Refused(408, f"the request body did not arrive within {self.body_timeout:g} s") from None

    def check_names(self, names: Iterable[str], what: str) -> None:
        """Refused (400) when the request names one of the server's settings (``what``: "column",
        "argument"); the call takes them as keyword arguments, so they would replace the server's."""
        named = sorted(self.settings & set(names))
        if named:
            raise Refused(400, f"request {what}(s) {', '.join(map(repr, named))} are settings of this server "
                               f"({self.command} --kwargs); a request may not change them")

    async def _read(self, request: Request) -> bytes:
        limit = self.max_body
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"request body of {int(declared)} bytes is over the server's limit of {limit} "
                               f"({self.command} --max-body-mb)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body is over the server's limit of {limit} bytes "
                                   f"({self.command} --max-body-mb)")
            chunks.append(chunk)
        return b"".join(chunks)
