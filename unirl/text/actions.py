"""The text environment's forward of stored samples (``unirl.env.Actions``): token log-probs (and entropies) of
the sampled responses under a model, packed or padded, the trained-token mask, the critic's values, the KL to
the reference and the padding a micro-batch does not need.

Shapes: N = B*G samples, P prompt tokens (left-padded), R response tokens (right-padded).
"""

from __future__ import annotations

import torch

from unirl.core import kl_divergence
from unirl.env import Actions, Rollout
from unirl.text.logprobs import response_logprobs
from unirl.text.packing import pack_shared_prompts


def response_tokens(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N, R] every real response token (attention, lengths, padding). A multi-turn rollout stores it
    as ``response_attention_mask`` beside ``response_mask``, the loss mask, which is 0 at tool
    observations; a single-turn rollout's two masks are the same tensor."""
    return tensors.get("response_attention_mask", tensors["response_mask"])


class TextActions(Actions):
    """The text environment's ``actions`` (``env``: the ``TextEnvironment`` that owns it: its config and
    accelerator)."""

    recompute_old_logprobs = True
    left_padded = ("prompt_ids", "prompt_mask")

    def __init__(self, env):
        self.env = env

    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """Token log-probs of the stored responses under ``model`` (temperature-scaled like sampling), and
        their entropies in the update's forward (grad enabled; logged as ``actor/entropy``, trained only
        when ``algo.entropy_coef > 0``); ``model.logprob_chunk_size`` tokens at a time, so the
        full-vocabulary logits never exist (``unirl.text.logprobs``)."""
        if columns != slice(None):
            raise ValueError("the text environment scores whole responses (column_slices is one piece)")
        device = self.env.accelerator.device
        t = {k: v.to(device) for k, v in batch.tensors.items()}
        head = self.env.accelerator.unwrap_model(model).get_output_embeddings()
        tokens = response_tokens(t)  # [n, R] every real token; response_mask may have holes (observations)
        if self.env.cfg.model.share_prompt:  # one copy of each prompt, no padding (unirl/text/packing.py)
            packed, extra = self._packed_row(model, batch, t, tokens)
            ids, positions, source = packed.input_ids, packed.position_ids, packed.source  # [1, T], [(3,) 1, T], [n, R]
            # The attention is the blocks'; a 4-D mask is taken as given, so transformers builds no [T, T] one.
            attn = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        else:
            ids = torch.cat([t["prompt_ids"], t["response_ids"]], dim=1)  # [n, P+R]
            attn = torch.cat([t["prompt_mask"], tokens.long()], dim=1)
            positions, source, extra = (attn.cumsum(-1) - 1).clamp(min=0), None, None
            positions, extra = self._model_inputs(batch, ids, positions, extra)
        logp, entropy = response_logprobs(model, head, ids, attn, positions, t["response_ids"],
                                          temperature=self.env.cfg.rollout.temperature,
                                          chunk_size=self.env.cfg.model.logprob_chunk_size,
                                          with_entropy=torch.is_grad_enabled() or self.env.cfg.algo.entropy_coef > 0,
                                          entropy_grad=self.env.cfg.algo.entropy_coef > 0, source=source,
                                          model_kwargs=extra)  # [n, R] each
        out = {"logp": logp, "mask": self._trained_tokens(t)}
        if entropy is not None:
            out["entropy"] = entropy
        return out

    def _model_inputs(self, batch: Rollout, ids: torch.Tensor, positions, extra):
        """The positions and extra model inputs of an unpacked forward over ``ids`` (a VLM: its own)."""
        return positions, extra

    def _packed_row(self, model, batch: Rollout, t: dict[str, torch.Tensor], tokens: torch.Tensor):
        """``batch`` (its tensors ``t`` on the device; ``tokens`` [n, R] its responses' real tokens) as one
        packed row for ``model``, and the extra inputs of its forward (a VLM adds its pictures and 3-D positions)."""
        packed = pack_shared_prompts(t["prompt_ids"], t["prompt_mask"], t["response_ids"], tokens)
        return packed, {"unirl_blocks": packed.blocks}

    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        return self._trained_tokens(batch.tensors)

    def _trained_tokens(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, R] the response tokens, without the truncated responses' with ``overlong.mask_truncated``."""
        mask = tensors["response_mask"]
        if self.env.cfg.overlong.mask_truncated:
            mask = mask * tensors["finished"].to(mask.dtype).unsqueeze(-1)  # TRL's mask_truncated_completions
        return mask

    def values(self, model, batch: Rollout) -> torch.Tensor:
        """[n, R] the value head's output at the positions whose hidden states predict the response
        tokens (where ``score_actions`` reads the log-probs), float32; packed as ``score_actions`` packs."""
        device = self.env.accelerator.device
        t = {k: batch.tensors[k].to(device) for k in ("prompt_ids", "prompt_mask", "response_ids")}
        t["response_mask"] = response_tokens(batch.tensors).to(device)  # observations are attended to (multi-turn)
        R = t["response_ids"].shape[1]
        if self.env.cfg.model.share_prompt:
            packed = pack_shared_prompts(t["prompt_ids"], t["prompt_mask"], t["response_ids"], t["response_mask"])
            attn = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
            out = model(input_ids=packed.input_ids, attention_mask=attn, position_ids=packed.position_ids,
                        use_cache=False, unirl_blocks=packed.blocks).logits  # [1, L, 1]
            return out.reshape(-1)[packed.source].float()  # [n, R]
        ids = torch.cat([t["prompt_ids"], t["response_ids"]], dim=1)  # [n, P+R]
        attn = torch.cat([t["prompt_mask"], t["response_mask"].long()], dim=1)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False).logits  # [n, P+R, 1]
        return out[:, -R - 1:-1, 0].float()  # [n, R]

    def trim_padding(self, batch: Rollout) -> Rollout:
        """Prompts (left-padded) cut to the batch's longest, and every response-aligned tensor (the
        other 2-D ones: ids, masks, log-probs, per-token advantages, reference outputs) to its
        longest response. The log-probs are the same: pads are masked out of attention and the
        position ids count real tokens only."""
        t = batch.tensors
        P = max(1, int(t["prompt_mask"].sum(-1).max()))
        R = max(1, int(response_tokens(t).sum(-1).max()))

        def trimmed(name: str, v: torch.Tensor) -> torch.Tensor:
            if name in ("prompt_ids", "prompt_mask"):
                return v[:, v.shape[1] - P:]  # [n, P']
            return v[:, :R] if v.ndim >= 2 else v  # [n, R']

        return batch.map_tensors(trimmed)

    def sample_tokens(self, batch: Rollout) -> torch.Tensor:
        return batch.tensors["prompt_mask"].sum(-1) + response_tokens(batch.tensors).sum(-1).long()  # [n]

    @property
    def loss_norm_length(self) -> int:
        return self.env.cfg.rollout.max_new_tokens  # Dr. GRPO's constant, TRL's max_completion_length

    def kl(self, current, reference):
        algo = self.env.cfg.algo
        clamp = algo.kl_clamp if algo.kl_estimator in ("k3", "k3+") else None  # verl clamps low_var_kl only
        return kl_divergence(current["logp"], reference["logp"], estimator=algo.kl_estimator, clamp=clamp)
