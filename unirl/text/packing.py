"""One copy of each prompt and no padding in the trainer's forward (``model.share_prompt``).

GRPO samples G responses per prompt, and the trainer's log-prob pass usually sees each as its own
row ``[left-padded prompt | right-padded response]``: the prompt's tokens go through every layer G
times and every row is as long as the longest sample. Causal attention makes the prompt's hidden
states independent of what follows it, so one copy serves all its responses. A micro-batch becomes
one row of its real tokens only:

    tokens = [p_1 .. p_P | a_1 .. a_La | b_1 .. b_Lb | q_1 .. q_Q | c_1 .. c_Lc | ...]
    pos    = [0  .. P-1  | P .. P+La-1 | P .. P+Lb-1 | 0  .. Q-1 | Q .. Q+Lc-1 | ...]

The linear layers, norms and MLPs (most of a step's compute) run over these tokens only. Attention
runs per block (``packed_attention``): a prompt's tokens attend causally to the prompt, a response's
tokens to their prompt and causally to their own earlier tokens, each block gathered into a small
padded batch for ``scaled_dot_product_attention``. Every token therefore sees exactly the keys, values
and positions it sees in its own padded row, and the log-probs and gradients are the padded layout's
up to float rounding (``tests/test_packing.py``).

The model's attention implementation is set to ``unirl_packed`` at setup: it computes block attention
when the forward is given ``unirl_blocks`` and is transformers' ``sdpa`` otherwise (generation,
evaluation), with ``sdpa``'s masks. Models whose attention is not ``sdpa`` or that have sliding
windows are refused by ``check_packable`` rather than trained on other log-probs.

Vision-language models (Qwen2-VL, Qwen2.5-VL) pack the same way with two additions, both supplied by
the caller (``unirl/text/vlm_env.py``): ``keys`` keep two prompts apart whose tokens are the same but
whose pictures differ (image placeholders are one token id), and ``prompt_positions`` gives each distinct
prompt its 3-D multimodal rotary positions (M-RoPE: temporal, height, width), computed by the model's own
``get_rope_index`` on that prompt alone. Its responses continue from the prompt's largest position + 1 on
all three axes, transformers' rule for text after a prompt (its ``rope_deltas``), so ``position_ids`` is
``[3, 1, T]`` and every token gets the position it gets in its own padded row. The block attention
replaces the language model's attention only; the vision tower keeps its own (``use_packed_attention``)
and sees each distinct prompt's pictures once, in packed order (``PackedBatch.prompt_samples``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

import torch
import torch.nn.functional as F

#: The attention implementation name registered with transformers.
PACKED_ATTENTION = "unirl_packed"


@dataclass
class AttentionBlocks:
    """Which tokens of the packed row attend to which, as B blocks padded to O queries and K keys.

    Block b's queries are tokens ``queries[b, :o_b]``; its keys are ``keys[b, :c_b + o_b]``: c_b
    context tokens (its prompt, for a response block; none for a prompt block) visible to every
    query, then the queries themselves, causally. ``inverse[t]`` is where token t's output lands in
    the flattened ``[B * O]`` block outputs."""

    queries: torch.Tensor  # [B, O] token indices (padding: 0)
    keys: torch.Tensor  # [B, K] token indices (padding: 0)
    mask: torch.Tensor  # [B, 1, O, K] bool: True where a query attends
    inverse: torch.Tensor  # [T]

    def to(self, device) -> "AttentionBlocks":
        return AttentionBlocks(self.queries.to(device), self.keys.to(device), self.mask.to(device),
                               self.inverse.to(device))


@dataclass
class PackedBatch:
    """n samples as one row of T tokens; ``source[i, j]`` is the token whose hidden state predicts
    response token j of sample i (the prompt's last token for j = 0, else the sample's token j-1).
    Padded response positions (j >= the sample's length) point at token 0; their values are whatever
    the caller's response mask makes of them. ``position_ids`` is ``[A, 1, T]`` when the caller gave
    A-axis prompt positions (3 for M-RoPE), else ``[1, T]``. ``prompt_samples[k]`` is the first sample
    of the k-th distinct prompt in the row (where a VLM takes that prompt's pictures from)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T] or [A, 1, T]
    source: torch.Tensor  # [n, R]
    blocks: AttentionBlocks
    prompt_samples: list[int]


def response_lengths(token_mask: torch.Tensor) -> torch.Tensor:
    """[n] the number of real response tokens. ``token_mask`` marks every real token of the response,
    generated and tool-observation tokens alike (``response_attention_mask`` of a multi-turn rollout);
    it is right-padded (ones, then zeros). The loss mask may have holes where observations are: which
    tokens are trained does not change which tokens are there."""
    lengths = token_mask.sum(-1).long()  # [n]
    expected = torch.arange(token_mask.shape[1], device=token_mask.device)[None] < lengths[:, None]
    if not torch.equal(token_mask.bool(), expected):
        bad = int((token_mask.bool() != expected).any(-1).nonzero()[0])
        raise ValueError(f"sample {bad}: the response's tokens must be right-padded (ones, then zeros); got "
                         f"{token_mask[bad].tolist()}. A loss mask with holes (tool observations) goes beside "
                         f"it, as response_mask, not in its place")
    return lengths


#: A prompt's own positions, ``(its first sample's index, its tokens) -> [A, p]`` (3 axes for M-RoPE).
PromptPositions = Callable[[int, list[int]], torch.Tensor]


def pack_shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                        response_mask: torch.Tensor, *, keys: Optional[Sequence[Hashable]] = None,
                        prompt_positions: Optional[PromptPositions] = None) -> PackedBatch:
    """Pack n samples (left-padded prompts [n, P], right-padded responses [n, R]) into one row that
    holds each distinct prompt once, followed by its samples' responses in the samples' order.
    Samples share a prompt when its tokens are the same (whatever their group ids say) and, given
    ``keys`` (one per sample, e.g. a digest of a VLM sample's pictures), their keys are equal too.
    ``response_mask`` marks the responses' real tokens (see ``response_lengths``): for a multi-turn
    rollout, pass its ``response_attention_mask``, not the loss mask with holes.

    A prompt's positions are 0 .. p-1, or ``prompt_positions(i, tokens)`` ([A, p], A axes) for its
    first sample i; its responses continue from the prompt's largest position + 1 on every axis."""
    n, P = prompt_ids.shape
    R = response_ids.shape[1]
    if keys is not None and len(keys) != n:
        raise ValueError(f"pack_shared_prompts got {len(keys)} keys for {n} samples")
    prompt_len = prompt_mask.sum(-1).long().tolist()  # left-padded: the real tokens are the last ones
    resp_len = response_lengths(response_mask).tolist()
    prompts, responses = prompt_ids.tolist(), response_ids.tolist()

    by_prompt: dict[tuple, list[int]] = {}  # (prompt tokens[, key]) -> its samples, in order
    for i in range(n):
        if prompt_len[i] == 0:
            raise ValueError(f"sample {i} has an empty prompt: its first response token has no context to come from")
        tokens_i = tuple(prompts[i][P - prompt_len[i]:])
        by_prompt.setdefault(tokens_i if keys is None else (tokens_i, keys[i]), []).append(i)

    tokens: list[int] = []
    positions: list[torch.Tensor] = []  # [A, length] per piece of the row
    source = torch.zeros((n, R), dtype=torch.long)
    block_queries: list[range] = []  # each block's query tokens
    block_context: list[range] = []  # each block's always-visible context tokens
    for samples in by_prompt.values():
        first_sample = samples[0]
        prompt = prompts[first_sample][P - prompt_len[first_sample]:]
        start, p = len(tokens), len(prompt)
        own = torch.arange(p)[None] if prompt_positions is None else \
            _prompt_positions(prompt_positions(first_sample, prompt), p, first_sample)  # [A, p]
        after = int(own.max()) + 1  # 1-D: p
        tokens.extend(prompt)
        positions.append(own)
        prompt_tokens = range(start, start + p)
        block_queries.append(prompt_tokens)
        block_context.append(range(0))
        for i in samples:
            length, first = resp_len[i], len(tokens)
            if length == 0:
                continue
            tokens.extend(responses[i][:length])
            positions.append((torch.arange(length) + after)[None].expand(own.shape[0], -1))
            block_queries.append(range(first, first + length))
            block_context.append(prompt_tokens)
            # Token 0 is predicted by the prompt's last token, token j by the sample's token j-1.
            source[i, 0] = start + p - 1
            source[i, 1:length] = torch.arange(first, first + length - 1)

    device = prompt_ids.device
    blocks = _attention_blocks(block_context, block_queries, len(tokens)).to(device)
    position_ids = torch.cat(positions, dim=1)  # [A, T]
    if prompt_positions is not None:
        position_ids = position_ids[:, None]  # [A, 1, T]: the model's multi-axis layout
    return PackedBatch(torch.tensor([tokens], device=device), position_ids.to(device), source.to(device), blocks,
                       [samples[0] for samples in by_prompt.values()])


def _prompt_positions(positions: torch.Tensor, length: int, sample: int) -> torch.Tensor:
    """The caller's positions of sample ``sample``'s prompt, checked to be ``[A, length]`` integers."""
    if positions.ndim != 2 or positions.shape[1] != length or positions.is_floating_point():
        raise ValueError(f"prompt_positions for sample {sample}: expected integer positions [axes, {length}], got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    return positions.long().cpu()


def _attention_blocks(context: list[range], queries: list[range], num_tokens: int) -> AttentionBlocks:
    """The blocks of a packed row: block b's queries are the tokens ``queries[b]``, which see every
    token of ``context[b]`` and, causally, each other."""
    B = len(queries)
    O = max(len(q) for q in queries)
    K = max(len(c) + len(q) for c, q in zip(context, queries))
    query_idx = torch.zeros((B, O), dtype=torch.long)
    key_idx = torch.zeros((B, K), dtype=torch.long)
    inverse = torch.empty(num_tokens, dtype=torch.long)
    for b, (c, q) in enumerate(zip(context, queries)):
        query_idx[b, :len(q)] = torch.arange(q.start, q.stop)
        key_idx[b, :len(c)] = torch.arange(c.start, c.stop)
        key_idx[b, len(c):len(c) + len(q)] = torch.arange(q.start, q.stop)
        inverse[q.start:q.stop] = b * O + torch.arange(len(q))
    ctx = torch.tensor([len(c) for c in context])[:, None, None]  # [B, 1, 1]
    own = torch.tensor([len(q) for q in queries])[:, None, None]
    qi, ki = torch.arange(O)[None, :, None], torch.arange(K)[None, None, :]
    mask = (qi < own) & ((ki < ctx) | ((ki - ctx <= qi) & (ki < ctx + own)))  # [B, O, K]
    mask |= (qi >= own) & (ki == 0)  # padded queries look at one key: no empty softmax row
    return AttentionBlocks(query_idx, key_idx, mask[:, None], inverse)


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     unirl_blocks: AttentionBlocks | None = None, **kwargs):
    """transformers attention function: block attention over a packed row when ``unirl_blocks`` is
    given (query [1, H, T, d], key and value [1, H_kv, T, d]), else transformers' ``sdpa``.
    Returns ``([1, T, H, d], None)`` as ``sdpa`` does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if unirl_blocks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    blocks = unirl_blocks
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got a batch of {query.shape[0]}")
    H, T, d = query.shape[1], query.shape[2], query.shape[3]
    if T != blocks.inverse.shape[0]:  # e.g. a vision tower switched to this function: it must keep its own
        raise ValueError(f"packed attention got {T} tokens for a packed row of {blocks.inverse.shape[0]} "
                         f"({type(module).__name__})")
    q = query[0].transpose(0, 1)[blocks.queries].transpose(1, 2)  # [B, H, O, d]
    k = key[0].transpose(0, 1)[blocks.keys].transpose(1, 2)  # [B, H_kv, K, d]
    v = value[0].transpose(0, 1)[blocks.keys].transpose(1, 2)
    if k.shape[1] != H:  # grouped-query attention: each key/value head serves H / H_kv query heads
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=blocks.mask, dropout_p=dropout, scale=scaling)
    out = out.transpose(1, 2).reshape(-1, H, d)[blocks.inverse]  # [T, H, d]
    return out.unsqueeze(0), None


def use_packed_attention(model) -> None:
    """Register ``packed_attention`` (with ``sdpa``'s masks) with transformers and switch ``model`` to
    it: a vision-language model's language model only, its vision tower keeping its own attention
    (which attends within each picture, and is handed the forward's keyword arguments, ``unirl_blocks``
    included). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, sdpa_mask)
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        model.set_attn_implementation(PACKED_ATTENTION)
    else:  # per sub-config ("" is the top-level config)
        model.set_attn_implementation({"": PACKED_ATTENTION, "text_config": PACKED_ATTENTION,
                                       "vision_config": vision._attn_implementation})


#: Vision-language models whose packed rows get their 3-D rotary positions right: their ``get_rope_index``
#: (transformers) places a prompt's images and text, and text after the prompt continues at its largest
#: position + 1 (Qwen2.5-VL's index differs from Qwen2-VL's for videos only, which unirl does not feed).
PACKABLE_VLMS = ("qwen2_vl", "qwen2_5_vl")


def check_packable(config) -> None:
    """Refuse, naming the setting, a model whose attention block attention would not reproduce."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", PACKED_ATTENTION):
        raise ValueError(f"model.share_prompt=true computes attention per packed block in place of the model's "
                         f"{impl!r} attention, which it reproduces only for 'sdpa': load the model with sdpa "
                         f"attention or set model.share_prompt=false")
    if getattr(config, "vision_config", None) is not None:
        if config.model_type not in PACKABLE_VLMS:
            raise ValueError(f"model.share_prompt=true packs a vision-language model's rows with the 3-D rotary "
                             f"positions of {', '.join(PACKABLE_VLMS)} only; {config.model_type} may place its "
                             f"positions otherwise: set model.share_prompt=false")
        config = config.get_text_config()  # packing replaces the language model's attention
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types or (window is not None and not layer_types):
        raise ValueError(f"model.share_prompt=true replaces the model's attention masks, and this model has "
                         f"sliding-window attention (sliding_window={window}) that the packed blocks would not "
                         f"apply: set model.share_prompt=false")
