"""The sampled tokens' log-probs (and entropies) without materialising the full-vocabulary logits.

Shapes: n sequences, P prompt tokens, R response tokens, H hidden size, V vocabulary, M = n*R tokens,
C = ``chunk_size`` tokens per chunk.

The full path, ``logits = lm_head(h)`` then ``log_softmax``, holds ``[n, R, V]`` float32 logits (and
as much again for their gradient): 4 x 512 tokens of a 151936-word vocabulary is 1.2 GB per copy.
``token_logprobs`` computes the same values chunk by chunk over the M tokens and keeps only one
number per token (the logsumexp, and the entropy when asked); the backward pass recomputes each
chunk's logits to form the gradients wrt the hidden states, the head's weight and its bias (the
recompute costs one more head matmul per token, the trick of Liger-Kernel's fused linear
cross-entropy, https://arxiv.org/abs/2410.10989). At most one or two ``[C, V]`` float32 buffers are
alive at a time.

Gradients, per token with ``z = (h W^T + b) / T``, ``p = softmax(z)``, ``H = -sum p log p``:

    d log p_t / dz = onehot(t) - p
    d H / dz       = -p * (log p + H)

so ``dL/dz = g_t * onehot(t) - p * (g_t + g_H * (log p + H))`` for upstream gradients ``g_t`` (of
the log-prob) and ``g_H`` (of the entropy), and ``dL/d(hW^T + b) = dL/dz / T``.

``response_logprobs`` applies it to a causal LM: during the model's own forward, the output head
(``get_output_embeddings()``, a plain ``nn.Linear``) is made to compute the log-probs from the hidden
states it receives instead of the logits. The head's weight is therefore used inside the wrapper's
forward exactly where the logits used it, so DDP's hooks (and FSDP's unsharding, autocast, LoRA in
the layers below, tied embeddings) see what they would see on the full path: calling the decoder and
the head separately would bypass DDP's forward and break gradient synchronisation.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _compute_dtype(device_type: str, *dtypes: torch.dtype) -> torch.dtype:
    """The matmul dtype the head would use here: autocast's when it is on, else the promoted dtype."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  temperature: float) -> torch.Tensor:
    """``(h W^T + b).float() / T`` of one chunk, the matmul in ``weight``'s dtype: [C, H] -> [C, V]
    float32 (float64 stays float64)."""
    z = F.linear(hidden.to(weight.dtype), weight, bias)  # [C, V], a fresh buffer
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Forward and backward of ``token_logprobs`` over flattened tokens (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, compute_dtype):
        # hidden [M, H], weight [V, H], bias [V] | None, targets [M] -> logp [M], entropy [M] | None
        M = hidden.shape[0]
        f32 = dict(dtype=torch.promote_types(compute_dtype, torch.float32), device=hidden.device)
        logp, lse = torch.empty(M, **f32), torch.empty(M, **f32)
        entropy = torch.empty(M, **f32) if with_entropy else None
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit below
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            for s in range(0, M, chunk_size):
                e = min(s + chunk_size, M)
                z = _chunk_logits(hidden[s:e], w, b, temperature)  # [C, V]
                target = z.gather(1, targets[s:e, None]).squeeze(1)  # [C]
                m = z.amax(dim=1, keepdim=True)  # [C, 1]
                z.sub_(m)  # z - max: exp cannot overflow
                if with_entropy:
                    p = z.exp()  # [C, V] unnormalised
                    total = p.sum(dim=1)  # [C]
                    mean_z = p.mul_(z).sum(dim=1) / total  # E_p[z - max]
                    del p
                    entropy[s:e] = total.log() - mean_z  # H = logsumexp(z) - E_p[z]
                else:
                    total = z.exp_().sum(dim=1)
                lse[s:e] = total.log() + m.squeeze(1)
                logp[s:e] = target - lse[s:e]
                del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.compute_dtype = temperature, chunk_size, compute_dtype
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logp, entropy
        return logp, None

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 5
        if grad_logp is None and grad_entropy is None:
            return None, None, None, *none
        M, T, cd = hidden.shape[0], ctx.temperature, ctx.compute_dtype
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_h = torch.empty_like(hidden) if need_h else None
        # Weight and bias gradients accumulate over chunks in float32 (at least) whatever the compute dtype.
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cd)
            b = bias.to(cd) if bias is not None else None
            for s in range(0, M, ctx.chunk_size):
                e = min(s + ctx.chunk_size, M)
                g_t = grad_logp[s:e, None].to(acc)  # [C, 1]
                g = _chunk_logits(hidden[s:e], w, b, T).sub_(lse[s:e, None])  # [C, V] log p
                if grad_entropy is not None:
                    p = g.exp()  # [C, V]
                    # p * (g_t + g_H * (log p + H)), in place over log p.
                    g.add_(entropy[s:e, None]).mul_(grad_entropy[s:e, None].to(acc)).add_(g_t).mul_(p)
                    del p
                else:
                    g.exp_().mul_(g_t)  # p * g_t
                g.neg_().scatter_add_(1, targets[s:e, None], g_t)  # + g_t * onehot(t): dL/dz
                if T != 1.0:
                    g.div_(T)  # dL/d(h W^T + b)
                g = g.to(cd)
                h = hidden[s:e].to(cd)
                if need_h:
                    grad_h[s:e] = (g @ w).to(hidden.dtype)  # [C, H]
                if need_w:
                    if cd == acc:
                        grad_w.addmm_(g.t(), h)  # [V, H]
                    else:
                        grad_w += g.t() @ h
                if need_b:
                    grad_b += g.sum(dim=0, dtype=acc)
                del g
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, *none


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int = 1024, with_entropy: bool = False, bias: Optional[torch.Tensor] = None,
                   compute_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``targets`` (and entropies) under ``softmax((hidden @ weight.T + bias) / temperature)``,
    ``chunk_size`` tokens at a time, in forward and backward.

    Equal to ``z = F.linear(hidden, weight, bias).float() / temperature``, ``z.gather(-1, targets) -
    z.logsumexp(-1)`` and ``unirl.core.entropy_from_logits(z)``, with the same gradients, but no
    ``[n, R, V]`` tensor is ever made: memory is one or two ``[chunk_size, V]`` float32 buffers plus
    one float per token. Logits must be finite (a linear head's are).

    Args:
        hidden: [n, R, H] (any leading shape) hidden states that predict ``targets``.
        weight: [V, H] the output head's weight; bias: [V] or None.
        targets: [n, R] token ids (padded positions need valid ids; their gradients are whatever the
            caller's mask makes them).
        temperature: the logits are divided by it, as the sampler did.
        chunk_size: tokens per chunk over the flattened ``n * R`` tokens (>= 1).
        with_entropy: also return the per-token entropy (its gradient is exact).
        compute_dtype: the head matmul's dtype; default autocast's if on here, else the promoted dtype of
            ``hidden`` and ``weight``. The logits are float32 after it, as on the full path.

    Returns:
        ``(logp [n, R], entropy [n, R] or None)``, float32 (float64 for a float64 computation).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be targets' shape {tuple(targets.shape)} plus [H]")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H={hidden.shape[-1]}], got {tuple(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if compute_dtype is None:
        compute_dtype = _compute_dtype(hidden.device.type, hidden.dtype, weight.dtype)
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [M, H]
    logp, entropy = _ChunkedTokenLogprobs.apply(flat_h, weight, bias, targets.reshape(-1), float(temperature),
                                                int(chunk_size), bool(with_entropy), compute_dtype)
    return logp.view(targets.shape), (entropy.view(targets.shape) if entropy is not None else None)


@contextmanager
def _head_computes_logprobs(head: torch.nn.Linear, targets: torch.Tensor, *, temperature: float, chunk_size: int,
                            with_entropy: bool, source: Optional[torch.Tensor] = None,
                            entropy_grad: bool = True) -> Iterator[dict]:
    """While open, ``head`` maps the hidden states it receives to ``[n, R, 1]`` log-probs of ``targets``
    [n, R] (``[n, R, 2]`` with the entropy). The hidden states are ``[n, P+R, H]`` and positions
    P-1 .. P+R-2 predict the targets, or, with ``source`` [n, R], packed rows ``[rows, L, H]`` whose
    flattened position ``source[i, j]`` predicts ``targets[i, j]`` (``unirl.text.packing``). The tensor
    it returned is left in the yielded dict under ``"out"``. ``entropy_grad=False``: the entropy is
    detached, so the backward pass skips its term (the entropy is only logged)."""
    produced: dict = {}
    R = targets.shape[1]

    def forward(x: torch.Tensor) -> torch.Tensor:
        if source is not None:
            if x.ndim != 3:
                raise ValueError(f"the output head got hidden states {tuple(x.shape)}, expected [rows, L, H]")
            hidden = x.reshape(-1, x.shape[-1])[source]  # [n, R, H]
        elif x.ndim != 3 or x.shape[1] <= R:
            raise ValueError(f"the output head got hidden states {tuple(x.shape)}, expected [n, P+R, H] with R={R}")
        else:
            hidden = x[:, -R - 1:-1]  # [n, R, H]
        dtype = _compute_dtype(x.device.type, x.dtype, head.weight.dtype)  # what the head would have used
        logp, entropy = token_logprobs(hidden, head.weight, targets, temperature=temperature,
                                       chunk_size=chunk_size, with_entropy=with_entropy, bias=head.bias,
                                       compute_dtype=dtype)
        if with_entropy and not entropy_grad:
            entropy = entropy.detach()
        out = torch.stack([logp, entropy], dim=-1) if with_entropy else logp.unsqueeze(-1)  # [n, R, 1|2]
        produced["out"] = out
        return out

    patched = head.__dict__.get("forward")  # an accelerate hook may already patch the instance
    head.forward = forward
    try:
        yield produced
    finally:
        if patched is None:
            del head.forward
        else:
            head.forward = patched


def response_logprobs(model: torch.nn.Module, head: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, position_ids: torch.Tensor, response_ids: torch.Tensor, *,
                      temperature: float, chunk_size: Optional[int], with_entropy: bool = False,
                      source: Optional[torch.Tensor] = None, model_kwargs: Optional[dict] = None,
                      entropy_grad: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropies) of ``response_ids`` [n, R], the last R of ``input_ids`` [n, P+R], under
    the causal LM ``model`` (possibly DDP/Accelerate/PEFT-wrapped; its forward always runs).

    With ``source`` [n, R], ``input_ids`` are packed rows ``[rows, L]`` and flattened position
    ``source[i, j]`` predicts ``response_ids[i, j]`` (``unirl.text.packing``); ``model_kwargs`` go
    to the model's forward as they are (the packed attention blocks).

    ``head`` is the unwrapped model's ``get_output_embeddings()``. ``chunk_size`` tokens at a time
    through ``token_logprobs`` inside the model's forward (module docstring), or, when None, from the
    model's full ``[n, R, V]`` logits. The chunked path needs the head's output to be the model's
    logits (no soft-capping or scaling after it): anything else is an error, not a silent difference.

    ``entropy_grad=False``: the entropy comes back without gradient (logged, not trained), and the
    backward pass costs what it costs without it.
    """
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                  **(model_kwargs or {}))
    R = response_ids.shape[1]
    if chunk_size is None:
        from unirl.core import entropy_from_logits

        logits = model(**kwargs).logits
        if source is None:
            logits = logits[:, -R - 1:-1]  # [n, R, V] predicts the response
        else:
            logits = logits.reshape(-1, logits.shape[-1])[source]  # [n, R, V]
        logits = logits.float() / temperature
        logp = logits.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [n, R]
        if not with_entropy:
            return logp, None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logp, entropy_from_logits(logits)
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"model.logprob_chunk_size needs the output head to be a plain torch.nn.Linear, got "
                         f"{type(head).__name__} (LoRA or modules_to_save on lm_head?); set model.logprob_chunk_size=null")
    with _head_computes_logprobs(head, response_ids, temperature=temperature, chunk_size=chunk_size,
                                 with_entropy=with_entropy, source=source, entropy_grad=entropy_grad) as produced:
        out = model(**kwargs).logits  # [n, R, 1|2]
    # The model must return the head's result as is. DDP may pass it through an identity autograd op
    # (its _DDPSink, with find_unused_parameters), so compare values, and keep the model's tensor.
    head_out = produced.get("out")
    if head_out is None or out is not head_out and (
            out.shape != head_out.shape or not torch.allclose(out, head_out, rtol=0, atol=0, equal_nan=True)):
        raise ValueError(f"{type(model).__name__} changes its output head's result before returning it as logits "
                         "(e.g. soft-capping or scaling), so the chunked log-probs would differ from its own: "
                         "set model.logprob_chunk_size=null")
    return out[..., 0], (out[..., 1] if with_entropy else None)
