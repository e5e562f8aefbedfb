"""Generation on other processes or machines: ``RemoteEngine`` spreads each ``generate`` call over several
rollout servers (``unirl serve-rollout``, ``source.urls``), a contiguous share of the prompts each, all at once,
and publishes the weights to every one of them. It is an ``Engine``: the inline source drives it as the
synchronous step, the threaded source (``source.max_staleness >= 1``) lets the servers generate ahead while the
trainer updates.

The prompts of a call are cut into as many contiguous shares as there are servers (the first ones one longer
when they do not divide), so each prompt's group is sampled whole by one server and the answers come back in
the prompts' order. A server that fails fails the call, naming it (``RolloutServerError``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from unirl.rollout.engine import CallSeeds, Generation


def shares(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous shares, the first ``n % parts`` one longer (empty ones dropped).

    >>> [list(r) for r in shares(5, 2)], shares(1, 3)
    ([[0, 1, 2], [3, 4]], [range(0, 1)])
    """
    size, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + size + (k < extra)
        if stop > start:
            out.append(range(start, stop))
        start = stop
    return out


class RemoteEngine:
    """Several rollout servers as one engine (module docstring)."""

    weights_format = "hf_checkpoint"
    shares_policy = False

    def __init__(self, urls: list[str], *, timeout_s: float = 600.0, token: str | None = None, processes: int = 1,
                 vocab_size: int | None = None, seed: int | None = None):
        """``seed``: the run's, which seeds a training batch's calls (``seeds``: ``unirl.rollout.engine.CallSeeds``),
        so the servers' own generators, which a restart resets, never decide a training sample."""
        from unirl.rollout.server_client import ServerEngine

        if not urls:
            raise ValueError("source.urls: give at least one rollout server (http://host:port)")
        if processes > 1:
            raise ValueError("source.urls takes one trainer process at present (each would push its weights to every "
                             "server); use rollout.engine=vllm with several processes")
        self.servers = [ServerEngine(url, timeout_s=timeout_s, token=token, vocab_size=vocab_size) for url in urls]
        self.seeds = None if seed is None else CallSeeds(seed)
        self.pool = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="unirl-remote")

    def generate(self, prompt_ids: list[list[int]], **sampling) -> list[list[Generation]]:
        """Each server answers its share of the prompts, all at once; the answers in the prompts' order. A
        ``seed`` is moved by each share's start, so prompt i samples from ``seed + i * n`` as on one server."""
        parts = shares(len(prompt_ids), len(self.servers))
        seed, step = sampling.pop("seed", None), 1 if sampling.get("greedy") else sampling.get("n", 1)
        if seed is None and self.seeds is not None:
            seed = self.seeds.take()
        futures = [self.pool.submit(server.generate, [prompt_ids[i] for i in part], **sampling,
                                    **({} if seed is None else {"seed": seed + part.start * step}))
                   for server, part in zip(self.servers, parts)]
        return [group for future in futures for group in future.result()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The same weights to every server, at once (each over its own weight channel)."""
        weights = list(weights)
        for future in [self.pool.submit(server.load_weights, weights) for server in self.servers]:
            future.result()

    def sleep(self) -> None:  # the servers' devices are their own
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.close()
