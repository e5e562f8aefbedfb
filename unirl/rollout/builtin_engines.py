"""The engines unirl ships, registered by name (``rollout.engine``): ``vllm`` (colocated vLLM), ``hf``
(transformers ``generate``) and ``server`` (``unirl serve-rollout`` over HTTP). The vision-language
engine registers itself as ``vlm`` in ``unirl/text/vlm_env.py``, beside the environment that uses it."""

from __future__ import annotations

from unirl.rollout.engine import EngineContext, register_engine


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
    from unirl.rollout.server_client import ServerEngine

    r = ctx.cfg.rollout
    return ServerEngine(r.server_url, timeout_s=r.server_timeout_s, processes=ctx.accelerator.num_processes)
