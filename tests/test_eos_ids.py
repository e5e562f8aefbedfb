"""A response that ends on any of the model's EOS ids is finished, in both engines.

Qwen2.5-Instruct's generation config lists two EOS ids (``<|im_end|>`` and ``<|endoftext|>``); vLLM
and ``generate`` stop on both, so the engines must count both as an end, or such answers would be
logged as truncated and dropped by ``algo.mask_truncated``. The tiny model stands in: its generation
config gets a second EOS, the token it greedily writes first, so a greedy answer is that one token.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from unirl.rollout.hf import HFEngine

from unirl.rollout.engine import eos_token_ids

PROMPT = "3+4=?"


@pytest.fixture(scope="module")
def two_eos(tiny_lm_dir, tmp_path_factory):
    """(model directory, the tokenizer's EOS, the added second EOS) for a copy of the tiny model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("two-eos") / "model"
    shutil.copytree(tiny_lm_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer(PROMPT).input_ids])).logits[0, -1]
    first = int(logits.argmax())
    assert first != tokenizer.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    model.generation_config.save_pretrained(out)
    return out, tokenizer.eos_token_id, first


def test_eos_ids_join_the_tokenizers_and_the_generation_configs():
    class Tok:
        eos_token_id = 7

    class Gen:
        eos_token_id = [7, 9]

    assert eos_token_ids(Tok()) == {7}
    assert eos_token_ids(Tok(), Gen()) == {7, 9}
    Gen.eos_token_id = 11
    assert eos_token_ids(Tok(), Gen()) == {7, 11}
    Tok.eos_token_id, Gen.eos_token_id = None, None
    assert eos_token_ids(Tok(), Gen()) == frozenset()


def test_hf_engine_stops_on_the_second_eos_and_calls_it_finished(two_eos):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, eos, second = two_eos
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    [[gen]] = HFEngine(lambda: model, tokenizer).generate([tokenizer(PROMPT).input_ids], n=1, max_new_tokens=6,
                                                          temperature=1.0, greedy=True)
    assert gen.response_ids == [second] and gen.finished
    assert len(gen.logprobs) == 1


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e .[cpu])")
def test_vllm_engine_stops_on_the_second_eos_and_calls_it_finished(two_eos):
    from transformers import AutoTokenizer

    from unirl.rollout.vllm import VLLMEngine

    path, eos, second = two_eos
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine(str(path), dtype="float32", seed=0, gpu_memory_utilization=0.3, kv_cache_bytes=1 << 28, tensor_parallel_size=1,
                        enforce_eager=True, max_model_len=64)
    try:
        assert engine.eos_ids == {eos, second}
        [[gen]] = engine.generate([tokenizer(PROMPT).input_ids], n=1, max_new_tokens=6, temperature=1.0, greedy=True)
    finally:
        engine.close()
    assert gen.response_ids == [second] and gen.finished
