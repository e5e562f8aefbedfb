"""The engines unirl ships, registered by name (``rollout.engine``): ``vllm`` (colocated vLLM), ``hf``
(transformers ``generate``) and ``server`` (``unirl serve-rollout`` over HTTP); and the registry's questions
(``build_engine``, ``check_engine``, what an engine takes). The vision-language engine registers itself as
``vlm`` in ``unirl/text/vlm_env.py``, beside the environment that uses it."""

from __future__ import annotations

from unirl.rollout.engine import ENGINES, LOADS_WEIGHTS, TAKES_HF_WEIGHTS, Engine, EngineContext, register_engine


@register_engine("vllm", loads_weights=True, hf_weights=True)
def vllm_engine(ctx: EngineContext):
    """A colocated vLLM over ``ctx.model_path`` (one per process, seeded by rank); it sleeps during the
    update at ``rollout.sleep_level`` in training (an evaluation's engine never sleeps)."""
    from unirl.rollout.vllm import VLLMEngine

    sleep = ctx.cfg.rollout.sleep_level if ctx.purpose == "train" else 0
    return VLLMEngine.from_config(ctx.cfg, ctx.model_path, seed=ctx.seed, sequences=ctx.sequences, sleep_level=sleep)


@register_engine("hf")
def hf_engine(ctx: EngineContext):
    """transformers ``generate`` on the live policy, or on a private copy (``ctx.own_weights``), with
    ``rollout.hf_cache`` sized for the run's longest call."""
    from unirl.rollout.hf import HFEngine
    from unirl.rollout.sizing import longest_call

    cache = dict(cache=ctx.cfg.rollout.hf_cache, max_cache_len=longest_call(ctx.cfg))
    if ctx.own_weights:
        return HFEngine.with_own_copy(ctx.policy(), ctx.tokenizer, ctx.accelerator.device, **cache)
    return HFEngine(ctx.policy, ctx.tokenizer, **cache)


@register_engine("server", hf_weights=True)
def server_engine(ctx: EngineContext):
    """``unirl serve-rollout`` at ``rollout.server_url`` (its own process and devices)."""
    from unirl.rollout.server_client import ServerEngine, trainer_vocab

    r = ctx.cfg.rollout
    return ServerEngine(r.server_url, timeout_s=r.server_timeout_s, processes=ctx.accelerator.num_processes,
                        seed=ctx.seed,
                        # an evaluation's policy loads on first use: its tokenizer is enough there
                        vocab_size=trainer_vocab(ctx.tokenizer, ctx.policy() if ctx.policy and ctx.purpose == "train"
                                                 else None))


def engine_loads_weights(name: str) -> bool:
    """Whether the engine ``name`` loads the model directory itself (vLLM) rather than sampling a trainer-side
    module or a server's; ``register_engine(name, loads_weights=True)`` says so."""
    return name in LOADS_WEIGHTS


def engine_takes_hf_weights(name: str) -> bool:
    """Whether the engine ``name`` is given the policy's weights under Hugging Face names with LoRA merged (vLLM,
    the rollout server), so a LoRA must be mergeable there; ``register_engine(name, hf_weights=True)``."""
    return name in TAKES_HF_WEIGHTS


def check_engine(name: str) -> None:
    """Raise ``ValueError`` (one line listing the registered engines) unless ``name`` is one (``rollout.engine``,
    checked where the config loads; a user's engine counts once the module registering it is imported)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name}: {ENGINES.unknown_message(name)}")


def build_engine(name: str, ctx: EngineContext) -> Engine:
    """The engine ``name`` (``rollout.engine``) for ``ctx``; an unknown name lists the registered ones."""
    engine = ENGINES.get(name)(ctx)
    if not isinstance(engine, Engine):
        missing = [m for m in ("generate", "load_weights", "sleep", "wake_up", "close", "weights_format", "shares_policy")
                   if not hasattr(engine, m)]
        raise TypeError(f"rollout engine {name!r} built a {type(engine).__name__}, which lacks {', '.join(missing)} "
                        f"(unirl.rollout.engine.Engine)")
    return engine
