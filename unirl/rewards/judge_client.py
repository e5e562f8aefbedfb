"""A client for any OpenAI-compatible chat endpoint (``vllm serve``, SGLang, a hosted API): the judge rewards' transport.

``ChatClient.ask_all(conversations)`` sends one ``POST <url>/v1/chat/completions`` per conversation,
at most ``concurrency`` at once (threads: the time is spent waiting on the server, which batches
concurrent requests itself, as ``vllm serve`` does), and returns the answers' texts in order. Each
request has a ``timeout``; connection failures, timeouts and 429/5xx answers are retried ``retries``
times with exponential backoff (``backoff``, doubled each time, as FlowGRPO's UnifiedReward client
waits between attempts). Any other answer that is not a chat completion is a ``RewardError`` at once,
naming the endpoint and what came back. Answers are cached (``cache_size`` most recent, in memory) by
the request itself (model, messages, max_tokens, temperature): the same rubric, prompt and answer
(or image) is asked once, however often a group or an evaluation repeats it. Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from unirl.rewards.registry import RewardError

#: Answers worth another attempt: rate limited, or the server is there but failing or not ready.
_RETRY_STATUSES = (429, 500, 502, 503, 504)


class ChatClient:
    """``POST /v1/chat/completions`` to ``url`` for ``model``.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``; a trailing ``/v1`` is accepted).
        model: the served model's name (``vllm serve NAME`` serves it as NAME).
        timeout: seconds one request may take.
        retries: further attempts after a connection failure, a timeout or a 429/5xx answer.
        backoff: seconds before the first retry, doubled for each further one.
        concurrency: requests in flight at once, at most.
        max_tokens, temperature: of each completion (temperature 0: the judge's most likely answer).
        api_key_env: the environment variable holding a bearer token, if the endpoint wants one.
        cache_size: answers kept in memory, keyed by the whole request (0: none). A judge sampling at
            temperature > 0 then answers a repeated request as it did the first time.
    """

    def __init__(self, url: str, model: str, *, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0,
                 concurrency: int = 8, max_tokens: int = 512, temperature: float = 0.0, api_key_env: str | None = None,
                 cache_size: int = 4096):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RewardError(f"judge url must start with http:// or https://, got {url!r}")
        if timeout <= 0 or retries < 0 or backoff < 0 or concurrency < 1 or max_tokens < 1 or cache_size < 0:
            raise RewardError(f"judge {url}: timeout must be > 0, retries, backoff and cache_size >= 0, concurrency "
                              f"and max_tokens >= 1 (got {timeout}, {retries}, {backoff}, {cache_size}, {concurrency}, "
                              f"{max_tokens})")
        self.endpoint = url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        self.model, self.timeout, self.retries, self.backoff = model, float(timeout), int(retries), float(backoff)
        self.concurrency, self.max_tokens, self.temperature = int(concurrency), int(max_tokens), float(temperature)
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self.api_key:
            raise RewardError(f"judge {url}: api_key_env={api_key_env!r} is not set in the environment")
        self.cache_size, self.cache_hits, self.requests = int(cache_size), 0, 0  # requests: those sent to the server
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def ask_all(self, conversations: Sequence[list[dict]]) -> list[str]:
        """The answer to each conversation (a list of chat messages), in order."""
        if len(conversations) <= 1 or self.concurrency == 1:
            return [self.ask(c) for c in conversations]
        with ThreadPoolExecutor(min(self.concurrency, len(conversations)), thread_name_prefix="unirl-judge") as pool:
            return list(pool.map(self.ask, conversations))

    def ask(self, messages: list[dict]) -> str:
        """The text of the first choice of one chat completion (from the cache when asked before)."""
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                           "temperature": self.temperature}, sort_keys=True).encode()
        key = hashlib.sha256(body).hexdigest()
        with self._lock:
            if key in self._cache:
                self.cache_hits += 1
                self._cache.move_to_end(key)
                return self._cache[key]
            self.requests += 1
        text = self._completion_text(self._post(body))
        if self.cache_size:
            with self._lock:
                self._cache[key] = text
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return text

    def _completion_text(self, answer: dict[str, Any]) -> str:
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            raise RewardError(f"judge {self.endpoint} answered something that is not a chat completion "
                              f"(no choices[0].message.content): {json.dumps(answer)[:300]}")
        return text

    def _post(self, body: bytes) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.endpoint, data=body, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                text = err.read().decode("utf-8", "replace")[:300]
                if err.code not in _RETRY_STATUSES:
                    raise RewardError(f"judge {self.endpoint} answered HTTP {err.code}: {text}") from None
                last = f"HTTP {err.code}: {text}"
                continue
            except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                continue
            try:
                answer = json.loads(raw)
            except ValueError:
                raise RewardError(f"judge {self.endpoint} answered garbage (not JSON): {raw[:200]!r}") from None
            if not isinstance(answer, dict):
                raise RewardError(f"judge {self.endpoint} answered garbage: expected a JSON object, got {raw[:200]!r}")
            return answer
        raise RewardError(f"judge {self.endpoint} failed {self.retries + 1} attempt(s) with a {self.timeout:g}s "
                          f"timeout; the last: {last}")
