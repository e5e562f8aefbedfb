"""The rollout layer's contract: what an engine does, the registry that builds one by name, and the
``Generation`` it returns.

An engine samples token ids for prompts of token ids and records the log-prob of each sampled token
under ``log_softmax(logits / temperature)`` (the trainer recomputes the same quantity; the loop logs the
gap as ``rollout/logprob_diff_*``). It takes new weights in place (``load_weights``: named tensors), may
free its device memory while the trainer updates (``sleep`` / ``wake_up``) and is closed at the end.

Engines are registered by name (``ENGINES``: ``vllm``, ``hf``, ``server`` in ``unirl/rollout/engines.py``, the
vision-language ``vlm``); ``rollout.engine`` names one, and ``build_engine`` (``unirl/rollout/engines.py``) is
the one place an environment or ``unirl eval`` gets one. A user registers another with ``@register_engine("name")`` on a builder taking an ``EngineContext``
(docs/architecture.md, "How to add an engine"; ``tests/test_rollout_layer.py`` adds one and trains with it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch

from unirl.registry import Registry


@dataclass
class Generation:
    response_ids: list[int]
    logprobs: list[float]  # engine log-prob of each response token
    text: str
    #: True when the response ended with EOS (False: cut at max_new_tokens).
    finished: bool
    #: The optimizer steps of the weights that sampled it, when the caller tracks them (a
    #: ``unirl.rollout.stream.VersionedEngine`` stamps it); None: the batch's version stands for it.
    version: int | None = None


@runtime_checkable
class Engine(Protocol):
    """What the trainer, the batch sources and the evaluation call on an engine. An engine whose random state
    lies outside the trainer (a rollout server) also has ``seeds``, a ``CallSeeds`` that seeds its unseeded
    calls of a training batch (optional: the batch sources look for it)."""

    #: The names ``load_weights`` takes: ``hf_checkpoint`` (Hugging Face checkpoint names, LoRA merged:
    #: vLLM, the rollout server) or ``module_state`` (the policy module's own ``state_dict`` names: the
    #: transformers engine's private copy of the policy).
    weights_format: str
    #: True when the engine samples from the trainer's live policy (the transformers engine without a
    #: copy): there is nothing to publish to it.
    shares_policy: bool

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False, stop: list[str] | None = None,
                 seed: int | None = None) -> list[list[Generation]]:
        """G = ``n`` generations per prompt (one when ``greedy``), grouped by prompt. ``seed``: sample from
        generators of this seed, leaving the engine's own random state (what training samples from) as it was:
        vLLM gives request i the seed ``seed + i * n`` (its j-th sample ``+ j``), the transformers engine one
        stream for the call; None: the engine's own random state."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take new weights in place (names in ``weights_format``); the next generation uses them."""

    def sleep(self) -> None:
        """Free device memory for the trainer's update (vLLM's ``rollout.sleep_level``); may do nothing."""

    def wake_up(self) -> None:
        """Undo ``sleep`` (the next ``load_weights`` also wakes the engine)."""

    def close(self) -> None:
        """Release the engine."""


#: ``call_seed``'s step between the seeds of successive calls (more than any call's prompts x samples).
CALL_SEED_STRIDE = 1_000_003


def call_seed(seed: int | None, call: int) -> int | None:
    """The seed of call ``call`` (0, 1, ...) of a seeded generation made of several engine calls (the turns of
    a multi-turn answer), so no two calls sample from the same seeds; None stays None."""
    return None if seed is None else seed + CALL_SEED_STRIDE * call


def batch_seed(seed: int, batch: int) -> int:
    """A 31-bit seed for training batch ``batch`` of a run seeded ``seed``: a hash, so distinct (seed, batch)
    pairs give unrelated seeds (``seed + batch`` would make run 0's batch 1 run 1's batch 0).

    >>> batch_seed(0, 3) == batch_seed(0, 3) != batch_seed(1, 3)
    True
    """
    digest = hashlib.blake2b(f"unirl/{seed}/{batch}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


class CallSeeds:
    """The seeds of a training batch's sampling calls, for an engine whose random state the trainer can neither
    save nor restore: a rollout server's lives in its own process, and a server started anew (after a crash,
    or on another machine) starts again from its own seed. Held by the trainer, they make the samples depend
    on the run's seed and the batch only, so a run resumed against a new server trains on the uninterrupted
    run's samples (issue 51: it differed in 27 of 33 figures). Call c (0, 1, ...: a multi-turn answer's turns,
    dynamic sampling's draws) of batch b samples from ``call_seed(batch_seed(seed, b), c)``.

    ``scoped(produce)`` wraps a source's ``produce(batch, ...)`` so each batch's calls are counted from 0
    (``unirl.rollout.sources.build_source``); a call outside a batch (none but the batches' are made on the
    trainer's behalf: an evaluation gives its own seed) takes None, the server's own generator."""

    def __init__(self, seed: int):
        self.seed = seed
        self._batch: int | None = None
        self._calls = 0

    def take(self) -> int | None:
        """The seed of the next call of the batch being produced; None outside a batch."""
        if self._batch is None:
            return None
        self._calls += 1
        return call_seed(batch_seed(self.seed, self._batch), self._calls - 1)

    def scoped(self, produce: Callable[..., Any]) -> Callable[..., Any]:
        """``produce(batch, *args)`` with ``batch``'s calls seeded (the sources call it from one thread at a
        time: the producer holds ``engine_lock`` while it produces, as an evaluation does while it samples)."""
        def seeded(batch: int, *args, **kwargs):
            self._batch, self._calls = batch, 0
            try:
                return produce(batch, *args, **kwargs)
            finally:
                self._batch = None
        return seeded


@dataclass
class EngineContext:
    """What a registered builder gets to make an engine.

    ``cfg``: the run's config (its ``rollout`` block, and ``model``/``data`` for sizing); ``model_path``:
    the directory the policy was loaded from; ``policy``: returns the live (unwrapped) policy module, for
    engines that sample from the trainer's weights; ``purpose``: ``train`` (rollouts; may sleep) or ``eval``;
    ``sequences``: the most sequences one call samples (vLLM sizes its CPU cache by it); ``own_weights``:
    the engine must sample from weights the trainer's updates do not touch (asynchronous rollouts: a
    copy, loaded by ``load_weights``); ``processor``: a vision-language policy's processor."""

    cfg: Any
    model_path: str
    tokenizer: Any
    accelerator: Any
    policy: Callable[[], torch.nn.Module] | None = None
    purpose: str = "train"
    sequences: int = 1
    seed: int = 0
    own_weights: bool = False
    processor: Any = None


#: Engines that load ``ctx.model_path`` themselves (no trainer-side policy): ``unirl eval`` leaves them the device.
LOADS_WEIGHTS: set[str] = set()
#: Engines that take the policy's weights under Hugging Face names with LoRA merged (``hf_checkpoint``).
TAKES_HF_WEIGHTS: set[str] = set()


EngineBuilder = Callable[[EngineContext], Engine]
ENGINES: Registry[EngineBuilder] = Registry("rollout engine")


def register_engine(name: str, *, loads_weights: bool = False, hf_weights: bool = False
                    ) -> Callable[[EngineBuilder], EngineBuilder]:
    """Register ``builder(ctx: EngineContext) -> Engine`` as the rollout engine ``name`` (``rollout.engine``);
    ``loads_weights``: it loads ``ctx.model_path`` itself (as vLLM), never the trainer's module; ``hf_weights``:
    it takes the policy's weights under Hugging Face names, LoRA merged."""
    if loads_weights:
        LOADS_WEIGHTS.add(name)
    if hf_weights:
        TAKES_HF_WEIGHTS.add(name)
    return ENGINES.register(name)


def eos_token_ids(tokenizer, generation_config=None) -> frozenset[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's ``eos_token_id``
    (one id or a list: Qwen2.5-Instruct's lists ``<|im_end|>`` and ``<|endoftext|>``). vLLM and
    ``generate`` stop on all of them, so a response ending on any one is finished, not truncated."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    listed = getattr(generation_config, "eos_token_id", None)
    ids.update([listed] if isinstance(listed, int) else (listed or ()))
    return frozenset(ids)


