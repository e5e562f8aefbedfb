"""One copy of each prompt in the trainer's forward: a micro-batch packed as [prompt, response 1, ...].

GRPO samples G responses per prompt, and the trainer's log-prob pass usually sees each as its own
row ``[left-padded prompt | right-padded response]``: the prompt's tokens go through every layer G
times and every row is as long as the longest sample. Causal attention makes the prompt's hidden
states independent of what follows it, so one copy serves all its responses:

    row    = [p_1 .. p_P | a_1 .. a_La | b_1 .. b_Lb | ... | pad]
    pos    = [0  .. P-1  | P .. P+La-1 | P .. P+Lb-1 | ... | 0  ]
    may attend to: the prompt, and the earlier tokens of its own segment

The block mask and position ids make every response token see exactly the context it sees in its own
padded row (the prompt, then its own earlier tokens, at the same positions), so the log-probs are
the same up to float rounding (``tests/test_packing.py``: values and gradients). The linear layers,
most of a step's compute, then process ``P + sum(L)`` tokens per prompt instead of ``G * (P + max L)``;
attention is computed over the whole row (masked), which costs ``row_length**2`` per row: rows are
therefore capped at ``max_length`` tokens, a prompt's responses that do not fit start another row
with the prompt again.

Needs a model whose attention takes a custom 4-D mask and explicit position ids (transformers'
``sdpa`` and ``eager`` implementations, no sliding-window layers): ``check_packable`` says so at
setup rather than training on different log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Attention implementations that apply a custom [rows, 1, L, L] mask as given.
PACKABLE_ATTENTION = ("sdpa", "eager")


@dataclass
class PackedRows:
    """A micro-batch of n samples packed into ``rows`` rows of ``L`` tokens.

    ``source[i, j]`` is the flat index (into ``rows * L``) of the token whose hidden state predicts
    response token j of sample i: the prompt's last token for j = 0, else the sample's own token j-1.
    Padded response positions (j >= the sample's length) point at index 0; their values are
    whatever the caller's response mask makes of them.
    """

    input_ids: torch.Tensor  # [rows, L]
    position_ids: torch.Tensor  # [rows, L]
    segments: torch.Tensor  # [rows, L]: 0 prompt, k >= 1 the row's k-th response, -1 padding
    source: torch.Tensor  # [n, R]

    def attention_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[rows, 1, L, L]: True (or 0.0) where a token may attend: earlier-or-same tokens of its own
        segment and of the prompt. Padding attends to the prompt and earlier padding, so no row of the
        softmax is empty. ``dtype`` None gives a bool mask (sdpa); a float dtype gives the additive
        form (0 or the dtype's minimum) that eager attention adds to its scores."""
        seg = self.segments
        L = seg.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=seg.device).tril_()  # [L, L]
        same = seg[:, :, None] == seg[:, None, :]  # [rows, L(query), L(key)]
        prompt_key = (seg == 0)[:, None, :]  # [rows, 1, L(key)]
        allowed = (same | prompt_key) & causal  # [rows, L, L]
        allowed = allowed[:, None]  # [rows, 1, L, L]
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """[n] the number of real response tokens; the mask must be right-padded (ones, then zeros)."""
    lengths = response_mask.sum(-1).long()  # [n]
    expected = torch.arange(response_mask.shape[1], device=response_mask.device)[None] < lengths[:, None]
    if not torch.equal(response_mask.bool(), expected):
        bad = int((response_mask.bool() != expected).any(-1).nonzero()[0])
        raise ValueError(f"sample {bad}: model.share_prompt packs right-padded responses (ones, then zeros in "
                         f"response_mask); got {response_mask[bad].tolist()}")
    return lengths


def pack_shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                        response_mask: torch.Tensor, *, max_length: int, pad_id: int = 0) -> PackedRows:
    """Pack n samples (left-padded prompts [n, P], right-padded responses [n, R]) into rows that hold
    each distinct prompt once followed by its samples' responses, in the samples' order.

    Samples share a row when their prompts are the same tokens (whatever their group ids say). A row
    holds at most ``max_length`` tokens; a sample whose prompt and response alone are longer gets a
    row of its own.
    """
    n, P = prompt_ids.shape
    R = response_ids.shape[1]
    prompt_len = prompt_mask.sum(-1).long().tolist()  # left-padded: the real tokens are the last ones
    resp_len = response_lengths(response_mask).tolist()
    prompts = prompt_ids.tolist()
    responses = response_ids.tolist()

    # Rows as lists of samples, filled in the samples' order.
    open_rows: dict[tuple, int] = {}  # prompt tokens -> index of its row still being filled
    rows: list[tuple[list[int], list[int]]] = []  # (prompt tokens, sample indices)
    used: list[int] = []  # tokens in each row
    for i in range(n):
        prompt = tuple(prompts[i][P - prompt_len[i]:])
        r = open_rows.get(prompt)
        if r is None or used[r] + resp_len[i] > max_length:
            r = len(rows)
            rows.append((list(prompt), []))
            used.append(len(prompt))
            open_rows[prompt] = r
        rows[r][1].append(i)
        used[r] += resp_len[i]

    L = max(used)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), L), dtype=torch.long)
    segments = torch.full((len(rows), L), -1, dtype=torch.long)
    source = torch.zeros((n, R), dtype=torch.long)
    for r, (prompt, samples) in enumerate(rows):
        p, base = len(prompt), r * L
        input_ids[r, :p] = torch.tensor(prompt, dtype=torch.long)
        position_ids[r, :p] = torch.arange(p)
        segments[r, :p] = 0
        start = p
        for k, i in enumerate(samples, start=1):
            length = resp_len[i]
            if length == 0:
                continue
            input_ids[r, start:start + length] = torch.tensor(responses[i][:length], dtype=torch.long)
            position_ids[r, start:start + length] = torch.arange(p, p + length)
            segments[r, start:start + length] = k
            # Token 0 is predicted by the prompt's last token, token j by the sample's token j-1.
            source[i, 0] = base + p - 1
            source[i, 1:length] = torch.arange(base + start, base + start + length - 1)
            start += length
    device = prompt_ids.device
    return PackedRows(input_ids.to(device), position_ids.to(device), segments.to(device), source.to(device))


def check_packable(config) -> None:
    """Refuse, naming the setting, a model whose attention would not apply the packed rows' mask."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in PACKABLE_ATTENTION:
        raise ValueError(f"model.share_prompt=true packs responses behind one copy of their prompt with a custom "
                         f"4-D attention mask, which attention implementation {impl!r} does not take (it works with "
                         f"{' or '.join(PACKABLE_ATTENTION)}): set model.share_prompt=false")
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types or (window is not None and not layer_types):
        raise ValueError(f"model.share_prompt=true replaces the model's attention masks, and this model has "
                         f"sliding-window attention (sliding_window={window}) that the packed mask would not "
                         f"apply: set model.share_prompt=false")
