"""Cutting what an environment or a tool answers to the observation limit of a multi-turn rollout
(``rollout.max_observation_tokens``), shared by the tool loop (``unirl/text/multiturn.py``) and the episode
runner (``unirl/agents/runner.py``).
"""

from __future__ import annotations


def cap_text(tokenizer, text: str, cap: int | None, marker: str, chars_per_token: int) -> str:
    """``text`` cut to its first ``cap`` tokens, then ``marker``; as it is when it fits (or no cap).

    No token spans more than ``chars_per_token`` characters, so the first ``cap`` tokens lie in the first
    ``cap * chars_per_token`` characters: only those (and one token's more, so that a text cut there
    still counts as longer than ``cap``) are tokenized, not a 4 MB result (5 s a call). The tokens are
    the whole text's unless one pre-tokenizer word spans the cut, where the last token may differ."""
    if cap is None:
        return text
    head = text[:(cap + 1) * chars_per_token]
    ids = tokenizer(head, add_special_tokens=False).input_ids
    return text if len(ids) <= cap and len(head) == len(text) else tokenizer.decode(ids[:cap]) + marker


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` decodes to (a byte-level token's vocabulary
    string has one character per byte, at least as many as it decodes to)."""
    vocab = tokenizer.get_vocab()
    return max(1, max(map(len, vocab), default=1))
