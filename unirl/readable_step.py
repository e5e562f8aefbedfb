"""One whole GRPO step on a causal language model, in one process, to read top to bottom (CleanRL's ``ppo.py``
and nanochat's ``scripts/chat_rl.py`` are the models): the old and reference log-probs, group advantages, the
clipped loss with the k3 KL, micro-batch backward, gradient clipping and the optimizer step. The trainer does
the same arithmetic through its batch source, step plan, backends and registered losses;
``tests/test_readable_step.py`` holds this function equal to the trainer's first step on the tiny model
(loss, gradient and new weights).

What it simplifies, compared with the trainer: one process (no DDP/FSDP2); whole sequences padded to one
width (no packing, no chunked log-probs); GRPO's advantages with the group std (``adv_scale: group``,
unbiased) and token-mean aggregation only; the k3 KL unclamped; one mini-batch and one epoch (so the old
log-probs are the policy's own before the step); no entropy bonus, rollout correction or critic.

Shapes: N = B*G samples, P prompt tokens (left-padded), R response tokens (right-padded).
"""

from __future__ import annotations

import torch


def token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, response: torch.Tensor, temperature: float):
    """[N, R] log-probs of the ``response`` tokens [N, R], the last R columns of ``ids`` [N, P+R], under ``model``
    at ``temperature``; positions count only real tokens (left padding is skipped)."""
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False).logits
    logits = logits[:, -response.shape[1] - 1:-1].float() / temperature  # [N, R, V]: position t predicts t+1
    return logits.gather(-1, response.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def grpo_step(policy, reference, optimizer, batch: dict[str, torch.Tensor], *, micro_batch_size: int,
              clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0, max_grad_norm: float | None = 1.0,
              temperature: float = 1.0, eps: float = 1e-6) -> dict[str, float]:
    """One step on ``batch`` (``prompt_ids``/``prompt_mask`` [N, P], ``response_ids``/``response_mask`` [N, R],
    ``rewards`` [N], ``group_ids`` [N]; optionally ``old_logp`` [N, R], the log-probs of a policy that sampled
    earlier); ``policy`` is trained by ``optimizer``, ``reference`` is frozen (None without a KL). Returns the
    step's loss, KL and gradient norm."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)  # [N, P+R]
    attn = torch.cat([batch["prompt_mask"], batch["response_mask"].long()], dim=1)
    response, mask = batch["response_ids"], batch["response_mask"].bool()  # [N, R]
    # 1. The old policy's and the reference's log-probs, without gradients (the policy before the step).
    with torch.no_grad():
        old_logp = batch.get("old_logp")
        old_logp = token_logprobs(policy, ids, attn, response, temperature) if old_logp is None else old_logp
        ref_logp = token_logprobs(reference, ids, attn, response, temperature) if kl_coef > 0 else None
    # 2. Group advantages (DeepSeekMath, arXiv 2402.03300): reward minus the group's mean, over its std.
    rewards, groups = batch["rewards"].float(), batch["group_ids"]
    adv = torch.zeros_like(rewards)  # [N]
    for g in groups.unique():
        members = groups == g
        adv[members] = (rewards[members] - rewards[members].mean()) / (rewards[members].std() + eps)
    # 3. Micro-batches: each backward adds its share of the batch's token-mean loss to the gradients.
    count = mask.sum().clamp_min(1)  # token-mean over the whole batch, whatever the micro-batch
    total_loss = total_kl = 0.0
    for rows in torch.arange(len(rewards)).split(micro_batch_size):
        logp = token_logprobs(policy, ids[rows], attn[rows], response[rows], temperature)  # [n, R], gradients
        m, a = mask[rows], adv[rows].unsqueeze(-1)  # [n, R], [n, 1]
        # PPO's clipped surrogate (arXiv 1707.06347); clip_high > clip_low is DAPO's clip-higher.
        ratio = torch.exp(torch.where(m, logp - old_logp[rows], 0.0))
        surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))  # [n, R]
        loss = torch.where(m, surrogate, 0.0).sum() / count
        if ref_logp is not None:  # k3 (http://joschu.net/blog/kl-approx.html): (r - 1) - log r, r = p_ref / p
            log_r = torch.where(m, ref_logp[rows] - logp, 0.0)
            kl = torch.where(m, torch.expm1(log_r) - log_r, 0.0).sum() / count
            loss = loss + kl_coef * kl
            total_kl += kl.item()
        loss.backward()
        total_loss += loss.item()
    # 4. Clip the gradient norm, step, zero.
    params = [p for p in policy.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm) if max_grad_norm is not None else torch.tensor(float("nan"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss/total": total_loss, "loss/kl": total_kl, "grad_norm": float(norm)}
