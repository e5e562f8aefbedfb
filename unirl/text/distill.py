"""The teacher of on-policy distillation (``distill.teacher``): loaded frozen beside the policy, refused in one
line when its tokenizer is not the policy's, and placed on the device the way the reference is.

The loop scores the sampled tokens under it with ``Environment.score_actions`` (packed prompts, the
chunked head, the rollout's temperature: exactly as the reference's log-probs), in the old/reference
log-prob stage (``unirl.trainer.logprobs``); the advantage is in ``unirl.core.distill``.
"""

from __future__ import annotations

import torch

from unirl.text.model_loading import resolve_model_path
from unirl.text.packing import check_packable, use_packed_attention


def load_teacher(cfg, policy_tokenizer, dtype: torch.dtype, accelerator) -> torch.nn.Module:
    """The frozen teacher ``cfg.distill.teacher`` of a text run (``resolve_model_path``: a directory, a hub
    or named model, a toy), in eval mode without gradients, on the accelerator's device, in the policy's
    dtype and attention layout (``model.attn_implementation``, ``model.share_prompt``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = cfg.distill.teacher
    path = resolve_model_path(name)
    check_teacher_tokenizer(path, policy_tokenizer, teacher=name, policy=cfg.model.name_or_path,
                            embedded=getattr(AutoConfig.from_pretrained(path), "vocab_size", None))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=cfg.model.attn_implementation)
    if cfg.model.share_prompt:  # the policy's packed rows (unirl/text/packing.py): the teacher reads the same batch layout
        check_packable(model.config)
        use_packed_attention(model)
    return place_frozen(accelerator, model)


def place_frozen(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A frozen model's place in the run: eval mode, no gradients, whole on this process's device, as
    the text reference copy is today. Under ``trainer.strategy=fsdp2`` the trainer then shards it as it
    shards the reference (``Trainer.setup``), so each process holds its shard and ``score_actions`` runs
    the collective forward on every process (each runs as many micro-batches, ``StepContext.micro_batches``)."""
    return model.eval().requires_grad_(False).to(accelerator.device)


def check_teacher_tokenizer(teacher_path: str, policy_tokenizer, *, teacher: str, policy: str,
                            embedded: int | None = None) -> None:
    """``ValueError`` in one line naming both models unless the teacher at ``teacher_path`` ships a tokenizer
    with the policy's vocabulary, each token at the same id, and embeds every one of them (``embedded``:
    its ``vocab_size``). The teacher scores the policy's sampled token ids: another tokenizer would give
    log-probs of other tokens without any error."""
    from transformers import AutoTokenizer

    where = f"distill.teacher={teacher} and model.name_or_path={policy}"
    fix = "on-policy distillation scores the policy's token ids, so the teacher needs the policy's tokenizer"
    try:
        theirs = AutoTokenizer.from_pretrained(teacher_path).get_vocab()
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{where}: the teacher ships no tokenizer that loads ({type(e).__name__}); {fix}") from None
    ours = policy_tokenizer.get_vocab()
    if theirs != ours:
        missing = sorted((t for t in ours if theirs.get(t) != ours[t]), key=ours.get)
        detail = (f"token {missing[0]!r} is {ours[missing[0]]} in the policy's, "
                  f"{'absent' if missing[0] not in theirs else theirs[missing[0]]} in the teacher's") if missing else (
            f"the teacher's has {len(theirs) - len(ours)} more tokens")
        raise ValueError(f"{where} have different tokenizers ({len(ours)} and {len(theirs)} tokens; {detail}); {fix}")
    if embedded is not None and embedded < len(ours):
        raise ValueError(f"{where}: the teacher embeds {embedded} tokens, the policy's tokenizer has {len(ours)}; {fix}")
