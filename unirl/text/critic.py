"""The text critic (``algo.adv_estimator: gae``): verl's value model, loaded.

A critic from another model (``critic.name_or_path``) reads the policy's token ids, so it must embed
every one of them and, where it ships a tokenizer, give each token the policy's id. Checked when the
critic loads, in one line, instead of an IndexError deep in the first step's forward (or, for a
same-sized vocabulary in another order, values learnt over the wrong tokens without any error).
"""

from __future__ import annotations

from typing import Any

import torch

from unirl.text.packing import check_packable, use_packed_attention


def load_value_model(path: str, cfg, policy_tokenizer, *, dtype: torch.dtype, share_prompt: bool) -> torch.nn.Module:
    """verl's critic: the architecture at ``path`` (the policy's, or ``cfg.name_or_path``'s: ``cfg`` is
    the ``CriticConfig``) with a one-output head on every token, dropout off, optionally LoRA (the head
    then trains beside the adapter); packed as the policy is with ``model.share_prompt``."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    if cfg.name_or_path:  # another model than the policy: it must read the policy's token ids
        check_critic_vocabulary(path, config, policy_tokenizer, what=f"critic.name_or_path={cfg.name_or_path}")
    config.classifier_dropout = 0.0  # as verl: a value regressed with dropout would be noisy
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
    if share_prompt:
        check_packable(model.config)
        use_packed_attention(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = cfg.lora
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 target_modules=lora.target_modules, task_type="TOKEN_CLS"))
    return model


def check_critic_vocabulary(critic_path: str, critic_config: Any, policy_tokenizer, *, what: str) -> None:
    """``ValueError`` naming ``what`` (the setting) unless the critic at ``critic_path`` (its loaded
    ``critic_config``) embeds ``len(policy_tokenizer)`` tokens and, when a tokenizer loads from
    ``critic_path``, maps every policy token to the same id."""
    needed = len(policy_tokenizer)
    rows = getattr(critic_config, "vocab_size", None)
    if rows is not None and rows < needed:
        raise ValueError(f"{what}: the critic embeds {rows} tokens, the policy's tokenizer has {needed}; the critic "
                         f"reads the policy's token ids, so it needs the policy's vocabulary (a model of the same family)")
    critic_vocab = _vocabulary(critic_path)
    if critic_vocab is None:  # no tokenizer beside the critic: the size is all that can be checked
        return
    for token, index in sorted(policy_tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if critic_vocab.get(token) != index:
            theirs = critic_vocab.get(token)
            where = "does not have it" if theirs is None else f"has it as {theirs}"
            raise ValueError(f"{what}: another tokenizer than the policy's (token {token!r} is {index} in the policy's, "
                             f"the critic's {where}); the critic reads the policy's token ids, so it needs the policy's "
                             f"vocabulary (a model of the same family)")


def _vocabulary(path: str) -> dict[str, int] | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError, TypeError, KeyError):  # no tokenizer files, or none transformers can build
        return None
