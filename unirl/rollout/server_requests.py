"""What the rollout server (``unirl.rollout.server``) accepts: every field of a request checked before the engine
sees it, so that a client's mistake is a 400 naming the field and what was expected, and a refused request
never reaches (or changes) the engine. vLLM's own checks come too late for a server: a seed past 64 bits
failed inside its engine core and hung every later generation (issue 51), and its out-of-vocabulary,
``top_p`` and empty-stop errors were answered 500, which clients retry.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: The largest seed a request may give: vLLM seeds request i's generator with ``seed + i * n`` (``VLLMEngine``),
#: a torch generator seed that must fit in 64 bits; the request's own offsets are taken off (``check_seed``).
MAX_SEED = 2**63 - 1


class BadRequest(Exception):
    """A request the server cannot answer as asked (400, or ``status``), with what was expected."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def parse_json(body: bytes) -> dict:
    """The body as a JSON object; a body nested past Python's recursion limit is a 400 too."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"the body is not JSON (or is nested too deeply): {str(err)[:200]}") from None
    if not isinstance(request, dict):
        raise BadRequest("the body must be a JSON object")
    return request


def field(request: dict, name: str, kind: type | tuple, default: Any = None, *, low: float | None = None,
          high: float | None = None) -> Any:
    """``request[name]`` checked against ``kind`` (a bool is no number), finite and in ``[low, high]``, or
    ``default`` when absent or null."""
    value = request.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(f"{name!r} must be {names}, got {_short(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"{name!r} must be a finite number, got {value!r}")
    if low is not None and value < low or high is not None and value > high:
        raise BadRequest(f"{name!r} must be in {low if low is not None else '-inf'}..{high if high is not None else 'inf'}, "
                         f"got {_short(value)}")
    return value


def sampling(request: dict, *, max_tokens_key: str | tuple[str, ...], default_max: int) -> dict:
    """The engine's sampling arguments from a request (``/generate``'s names or OpenAI's), each checked."""
    keys = (max_tokens_key,) if isinstance(max_tokens_key, str) else max_tokens_key
    max_tokens = next((field(request, k, int, low=1, high=2**31 - 1) for k in keys if request.get(k) is not None),
                      default_max)
    temperature = float(field(request, "temperature", (int, float), 1.0, low=0, high=1e6))
    top_p = request.get("top_p")
    if top_p is not None and not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool)
                                  and math.isfinite(top_p) and 0 < top_p <= 1):
        raise BadRequest(f"'top_p' must be a number in (0, 1], got {_short(top_p)}")
    stop = request.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"'stop' must be a non-empty string or a list of non-empty strings, got {_short(stop)}")
    return dict(n=field(request, "n", int, 1, low=1, high=4096), max_new_tokens=max_tokens,
                temperature=temperature if temperature > 0 else 1.0, greedy=temperature == 0,
                top_p=1.0 if top_p is None else float(top_p), top_k=field(request, "top_k", int, -1, low=-1, high=2**31 - 1),
                stop=stop or None, seed=field(request, "seed", int, low=0, high=MAX_SEED))


def check_seed(sampling_args: dict, prompts: int) -> None:
    """A seed whose last request's generator (``seed + (prompts - 1) * n + n - 1``) still fits in 64 bits."""
    seed = sampling_args["seed"]
    stride = 1 if sampling_args["greedy"] else sampling_args["n"]
    if seed is not None and seed + prompts * stride > MAX_SEED:
        raise BadRequest(f"'seed' must be in 0..{MAX_SEED - prompts * stride} for {prompts} prompt(s) x n={stride} "
                         f"(request i samples from seed + i * n, a 64-bit seed), got {seed}")


def check_prompt_ids(prompts: Any, vocab_size: int, name: str = "prompt_ids") -> list[list[int]]:
    """A non-empty list of non-empty lists of token ids in ``0..vocab_size - 1``."""
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p for p in prompts)):
        raise BadRequest(f"{name!r} must be a non-empty list of non-empty lists of token ids, got {_short(prompts)}")
    for i, p in enumerate(prompts):
        for t in p:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise BadRequest(f"{name!r}[{i}] holds {_short(t)}: token ids are integers in 0..{vocab_size - 1} "
                                 f"(this model's vocabulary)")
    return prompts


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
