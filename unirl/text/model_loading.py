"""Where a text run's model comes from (the tiny toys, a named model, a path) and what LoRA may target on it."""

from __future__ import annotations


def resolve_model_path(name_or_path: str, seed: int = 0) -> str:
    """``tiny`` (``tiny_search``, ``tiny_game``, ``tiny_teacher``, ``tiny_vlm``) -> the locally built tiny model (cached); a named model (``unirl models list``) -> its
    prepared directory (prepared now if needed); anything else is passed through."""
    from unirl.models.named import MODELS, resolve

    if name_or_path == "tiny":
        from unirl.text.tiny import build_tiny_lm

        return str(build_tiny_lm(seed=seed))
    if name_or_path == "tiny_search":  # the tiny model warm-started on Search-R1's tags (unirl/text/tiny_search.py)
        from unirl.text.tiny_search import build_tiny_search_lm

        return str(build_tiny_search_lm(seed=seed))
    if name_or_path == "tiny_game":  # the tiny model warm-started to play the walk game (unirl/text/tiny_game.py)
        from unirl.text.tiny_game import build_tiny_game_lm

        return str(build_tiny_game_lm(seed=seed))
    if name_or_path == "tiny_teacher":  # the tiny model after the tiny demo's GRPO (unirl/text/tiny_teacher.py)
        from unirl.text.tiny_teacher import build_tiny_teacher

        return str(build_tiny_teacher(seed=seed))
    if name_or_path == "tiny_vlm":  # the tiny Qwen2-VL (unirl/text/tiny_vlm.py)
        from unirl.text.tiny_vlm import build_tiny_vlm

        return str(build_tiny_vlm(seed=seed))
    if name_or_path in MODELS:
        return resolve(name_or_path)
    return name_or_path


def check_lora_targets(targets: list[str], config) -> None:
    """A LoRA on the output head or the embedding of a model whose two are tied (SmolLM2, Qwen2.5-0.5B)
    would untie them when merged, while vLLM keeps one tensor for both: the engine could not hold the
    trainer's policy, and its samples would drift off it unseen. (The transformers engine samples from
    the trained model itself, so it is not refused there.)"""
    tied = [t for t in targets if t in ("lm_head", "embed_tokens")]
    if tied and getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"model.lora.target_modules: {tied} on a model with tied input and output embeddings "
                         f"(tie_word_embeddings) cannot be merged into the rollout engine; train the attention and "
                         f"MLP projections only")
