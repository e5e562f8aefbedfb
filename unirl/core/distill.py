"""On-policy distillation: a teacher's log-probs of the student's own samples as a dense, per-token signal.

The student samples; the teacher scores every sampled token; the per-token reverse KL

    rkl_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)

(a one-sample estimate of KL(pi_student || pi_teacher) at position t, the k1 estimator) becomes the
advantage ``A_t = -coef * rkl_t``, alone or added to the outcome advantages. This is Thinking Machines'
"On-Policy Distillation" (Lu et al., 2025, https://thinkingmachines.ai/blog/on-policy-distillation),
as its reference code does it (``tinker_cookbook/distillation/train_on_policy.py``,
``incorporate_kl_penalty``: ``kl_advantages = -kl_penalty_coef * mask * (sampled_logprobs -
teacher_logprobs)``, added to the advantages, optionally summed forward with ``kl_discount_factor``;
its defaults coef 1 and discount 0, and its logged ``teacher_kl``, the token mean of rkl_t).

With the advantage on each token only (discount 0) the policy gradient of the ratio loss on policy is
``coef * mean_t[rkl_t * grad log pi_student(y_t)]``, the score-function gradient of the per-token
reverse KL, which is mode seeking: the student learns what the teacher would do in the states the
student itself reaches (GKD, Agarwal et al. 2024, https://arxiv.org/abs/2306.13649, with its
beta -> 1 reverse-KL end, on sampled tokens rather than the full vocabulary).

Shapes: N samples, T tokens. Pure tensors: no config, no ``.item()``, no I/O.
"""

from __future__ import annotations

import torch

from unirl.core.returns import discounted_future_sum


def reverse_kl_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, *,
                          coef: float = 1.0, discount: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token distillation advantages [N, T] and their figures.

    ``student_logp``, ``teacher_logp`` [N, T]: the log-probs of the sampled tokens under the student
    (the policy that sampled them) and under the teacher; ``mask`` [N, T]: the trained tokens.
    ``A_t = -coef * (student_logp - teacher_logp)`` on trained tokens, 0 elsewhere; with ``discount``
    > 0, ``A_t`` is the discounted sum of those from t to the sample's end (``discounted_future_sum``:
    carried through a multi-turn sample's observation tokens, which add nothing and count one discount
    step each, as Tinker's ``discounted_future_sum_vectorized`` over the whole datum).
    Figures (detached): ``reverse_kl``, the token mean of rkl_t over the trained tokens (Tinker's
    ``teacher_kl``), and ``reverse_kl_seq``, the mean over samples of their summed rkl_t (the
    one-sample estimate of the sequence-level KL)."""
    mask = mask.bool()
    rkl = torch.where(mask, student_logp.float() - teacher_logp.float(), 0.0)  # [N, T]
    adv = -coef * rkl  # [N, T]
    if discount > 0:
        adv = discounted_future_sum(adv, mask, gamma=discount)
    figures = {"reverse_kl": (rkl.sum() / mask.sum().clamp_min(1)).detach(),
               "reverse_kl_seq": rkl.sum(-1).mean().detach() if len(rkl) else rkl.new_zeros(())}
    return adv, figures
