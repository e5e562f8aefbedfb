"""The retrying JSON-over-HTTP client that the remote reward (``http://`` rewards), the remote tool and other
clients of our servers share: connection failures, timeouts and 502/503/504 answers (a server that is
restarting, or whose queue is full) are retried with a doubling backoff (at most ``MAX_BACKOFF`` apart) until
``retries`` or ``retry_for`` runs out; any other error answer, or an answer that is not a JSON object, fails at
once. Every failure is one ``error`` (the caller's exception type) naming the server and what it answered.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

#: HTTP statuses that mean "the server is there but not ready": worth another attempt.
RETRY_STATUSES = (502, 503, 504)


class JSONClient:
    """Requests to ``url`` (``http://host:port``) with a bearer ``token`` (default: ``$token_env``).

    Args:
        timeout: seconds each attempt may take.
        retries: the most further attempts after a failure worth retrying (None: as many as ``retry_for`` allows).
        backoff: seconds before the first retry, doubled for each further one (at most ``MAX_BACKOFF``).
        retry_for: no retry starts later than this many seconds after the first attempt.
        error: the exception type raised; ``what``: how messages name the server (``reward server``);
        ``unreachable_hint``: what an unreachable server's message suggests.
    """

    MAX_BACKOFF = 5.0

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int | None = None, backoff: float = 0.5,
                 retry_for: float = 30.0, token: str | None = None, token_env: str | None = None,
                 error: type[Exception] = ConnectionError, what: str = "server", unreachable_hint: str = ""):
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff, self.retry_for = float(timeout), retries, float(backoff), float(retry_for)
        self.token = token or (os.environ.get(token_env) if token_env else None) or None
        self.error, self.what, self.hint = error, what, unreachable_hint

    def request(self, method: str, path: str, body: bytes | None = None, *, doing: str | None = None) -> dict:
        """``method path`` with a JSON ``body``: the answer's JSON object, after the retries the settings allow;
        ``doing`` says what the request was for in the error after the last retry (``score the batch``)."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        start = time.monotonic()
        last, answered, attempts = "", False, 0
        while True:
            if attempts:
                wait = min(self.backoff * 2 ** (attempts - 1), self.MAX_BACKOFF)
                if ((self.retries is not None and attempts > self.retries)
                        or time.monotonic() + wait - start > self.retry_for):
                    break
                time.sleep(wait)
            attempts += 1
            request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                text = err.read().decode("utf-8", "replace")
                try:
                    message = json.loads(text)["error"]
                except (ValueError, KeyError, TypeError):
                    message = text[:300]
                if err.code in RETRY_STATUSES:  # busy (its queue is full) or not ready: try again
                    last, answered = f"HTTP {err.code}: {message}", True
                    continue
                raise self.error(f"{self.what} {self.url} answered HTTP {err.code}: {message}") from None
            except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                answered = False
                continue
            try:
                answer = json.loads(raw)
            except ValueError:
                raise self.error(f"{self.what} {self.url} answered garbage (not JSON): {raw[:200]!r}") from None
            if not isinstance(answer, dict):
                raise self.error(f"{self.what} {self.url} answered garbage: expected a JSON object, got {raw[:200]!r}")
            return answer
        spent = time.monotonic() - start
        if answered:
            raise self.error(f"{self.what} {self.url} did not {doing or f'answer {method} {path}'} in {attempts} attempt(s); "
                             f"the last was answered {last} ({spent:.1f} s in all)")
        raise self.error(f"{self.what} {self.url} is unreachable: {attempts} attempt(s) with a {self.timeout:g}s "
                         f"timeout failed, the last with {last} ({spent:.1f} s in all).{self.hint}")
