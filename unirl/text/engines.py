"""Rollout engines for text: vLLM (colocated, weights synced every step) and transformers ``generate``.

Both return, for every prompt, G ``Generation``s holding the response token ids and the engine's
log-prob of each sampled token under ``log_softmax(logits / temperature)``; the trainer recomputes
the same quantity and the loop logs the gap (``rollout/logprob_diff_*``).

vLLM runs in the training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the trainer can
hand it new weights in place with ``collective_rpc("reload_weights")``; a script that starts it
needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch


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


def _generation_config(model_dir: str):
    """The directory's ``generation_config.json``, or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return None


class VLLMEngine:
    """A colocated ``vllm.LLM`` over the same model directory the trainer loaded."""

    def __init__(self, model_dir: str, *, dtype: str, seed: int, gpu_memory_utilization: float,
                 tensor_parallel_size: int, enforce_eager: bool, max_model_len: int | None):
        if not vllm_available():
            raise ImportError(
                "rollout.engine='vllm' but vLLM is not installed. Install it (`pip install -e .[vllm]` on "
                "CUDA, `pip install -e .[cpu]` on CPU) or set rollout.engine=hf explicitly."
            )
        # In-process engine core: needed for in-place weight sync from the trainer.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        #: The trainer's torch threads: vLLM may lower them for serving (see ``keep_trainer_threads``).
        self.trainer_threads = torch.get_num_threads()
        from vllm import LLM

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
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_ids = eos_token_ids(self.tokenizer, _generation_config(model_dir))  # vLLM stops on each
        from unirl.logs import silence_rotary_reload_warning

        silence_rotary_reload_warning()  # harmless and logged at every sync: see unirl/logs.py
        self.keep_trainer_threads()

    def keep_trainer_threads(self) -> None:
        """Give torch back the trainer's thread count if vLLM lowered it (its serving set-up reduces
        torch to one thread, which would run the trainer's forward and backward on one core). vLLM's
        CPU worker replaces ``torch.set_num_threads`` by a no-op, so ``torch._C``'s is called."""
        if torch.get_num_threads() < self.trainer_threads:
            torch._C.set_num_threads(self.trainer_threads)

    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False,
                 stop: list[str] | None = None) -> list[list[Generation]]:
        """``stop``: strings at which a sample stops, kept in its output (a multi-turn rollout's calls)."""
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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place (HF checkpoint names) and drop stale KV cache."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(weights))})
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        del self.llm


class HFEngine:
    """Sampling with transformers ``generate`` on the trainer's own model (no weight sync needed)."""

    def __init__(self, model_fn, tokenizer):
        self.model_fn = model_fn  # returns the current (unwrapped) policy
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], *, n: int, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int = -1, greedy: bool = False,
                 stop: list[str] | None = None) -> list[list[Generation]]:
        """``stop``: strings at which a sample stops, kept in its output (transformers' ``stop_strings``;
        the positions after a stopped sample are padding, cut here)."""
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
        out = model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device),
            do_sample=not greedy, temperature=None if greedy else temperature,
            top_p=None if greedy else top_p, top_k=None if greedy or top_k < 0 else top_k,
            max_new_tokens=max_new_tokens, num_return_sequences=n,
            pad_token_id=pad, eos_token_id=sorted(eos),
            output_logits=True, return_dict_in_generate=True,
            **({"stop_strings": list(stop), "tokenizer": self.tokenizer} if stop else {}),
        )
        model.train(was_training)
        seqs = out.sequences[:, width:]  # [P*n, R]
        logits = torch.stack(out.logits, dim=1).float()  # [P*n, R, V]
        scale = 1.0 if greedy else temperature
        lp = torch.log_softmax(logits / scale, dim=-1).gather(-1, seqs.unsqueeze(-1)).squeeze(-1)
        result = []
        for i in range(len(prompt_ids)):
            gens = []
            for j in range(n):
                row = seqs[i * n + j].tolist()
                length = next((k + 1 for k, tok in enumerate(row) if tok in eos), len(row))
                if stop and pad not in eos and pad in row[:length]:  # stopped at a stop string, then padded
                    length = row.index(pad)
                tokens = row[:length]
                gens.append(Generation(tokens, lp[i * n + j, :length].tolist(),
                                       self.tokenizer.decode(tokens, skip_special_tokens=True),
                                       finished=bool(tokens) and tokens[-1] in eos))
            result.append(gens)
        return result

    def load_weights(self, weights) -> None:  # samples from the live model
        pass

    def close(self) -> None:
        pass


def hf_checkpoint_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under HF checkpoint names (LoRA merged in), for ``VLLMEngine.load_weights``.

    With peft, the adapter is merged for the duration of the copy and unmerged afterwards.
    """
    peft_model = getattr(model, "peft_config", None) is not None
    if peft_model:
        model.merge_adapter()
    try:
        state = model.state_dict()
        out = []
        for name, tensor in state.items():
            if peft_model:
                if "lora_" in name:
                    continue
                name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            # The merged LoRA weights are unmerged below, so the engine needs copies; plain weights are
            # read by the engine before the trainer changes them again (no copy, ~90 MB a step saved
            # on the 22.6M-parameter benchmark model).
            out.append((name, tensor.detach().clone() if peft_model else tensor.detach()))
    finally:
        if peft_model:
            model.unmerge_adapter()
    return iter(out)
