"""The transformers engine: ``generate`` on the trainer's own policy (nothing to sync), or on a private
copy of it (asynchronous rollouts), with the sampled tokens' log-probs kept as they are sampled.
"""

from __future__ import annotations

import copy

import torch

from unirl.rollout.engine import Generation, eos_token_ids


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
    """Sampling with transformers ``generate`` on the trainer's own model (no weight sync needed), or on a
    private copy of it (``own_copy``: asynchronous rollouts sample while the trainer updates, and
    ``load_weights`` puts a published version into the copy)."""

    #: The policy module's own ``state_dict`` names (the copy is the policy's module, LoRA and all).
    weights_format = "module_state"

    def __init__(self, model_fn, tokenizer, cache: str = "dynamic", max_cache_len: int | None = None):
        self.model_fn = model_fn  # returns the current (unwrapped) policy
        self.tokenizer = tokenizer
        self.own: torch.nn.Module | None = None  # the private copy, when the engine has one
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
                # This class's own method, not ``self.generate``: a subclass's (the VLM's, which adds its
                # extra_inputs again) or a wrapper's would run twice for one call.
                return HFEngine.generate(self, prompt_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
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

    @property
    def shares_policy(self) -> bool:
        """Samples from the trainer's live policy: there are no weights to publish to it."""
        return self.own is None

    @classmethod
    def with_own_copy(cls, policy: torch.nn.Module, tokenizer, device, **kwargs) -> "HFEngine":
        """An engine sampling from a frozen copy of ``policy`` on ``device`` that the trainer's updates do
        not touch; ``load_weights`` (module state names) replaces the copy's weights."""
        engine = cls(lambda: engine.own, tokenizer, **kwargs)
        engine.own = copy.deepcopy(policy).eval().requires_grad_(False).to(device)
        return engine

    def load_weights(self, weights) -> None:
        """Into the private copy; an engine sampling from the live policy has nothing to load."""
        if self.own is not None:
            self.own.load_state_dict(dict(weights))

    def sleep(self) -> None:  # the trainer's own memory: nothing to free
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass
