"""A critic from another model (``critic.name_or_path``) reads the policy's token ids, so it must
embed every one of them and, where it ships a tokenizer, give each token the policy's id. Checked when
the critic loads, in one line, instead of an IndexError deep in the first step's forward (or, for a
same-sized vocabulary in another order, values learnt over the wrong tokens without any error).
"""

from __future__ import annotations

from typing import Any


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
