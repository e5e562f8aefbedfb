"""Greedy multi-turn trajectories are the same from vLLM and transformers on the tiny model, with a
deterministic tool: the tiny model starts its "#### s" answer, is stopped at the first "#", a tool
appends "###" as an observation, and the model goes on to " s" and EOS. The call format is a
test-only one (a new format is one class): the tiny tokenizer has no "<" to write Search-R1's tags."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from unirl.text.multiturn import multi_turn_generate
from unirl.tools.calling import ToolCall, ToolRunner
from unirl.tools.formats import CallFormat, Turn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


class HashFormat(CallFormat):
    """A turn ending in "#" calls ``hashes``; its result is the observation."""

    stop = ["#"]

    def parse(self, text: str) -> Turn:
        return Turn(calls=[ToolCall("hashes", {})]) if text.endswith("#") else Turn()

    def observation(self, results, ended_with_eos):
        return "".join(results)


def _trajectories(engine, tokenizer, prompts):
    runner = ToolRunner({"hashes": lambda: "###"}, timeout_s=10)
    try:
        groups = multi_turn_generate(engine, tokenizer, HashFormat(), runner, prompts, n=1, max_turns=3,
                                     max_new_tokens=12, max_total_tokens=None, temperature=1.0, greedy=True)
    finally:
        runner.close()
    return [g[0] for g in groups]


def test_greedy_vllm_and_hf_give_the_same_multi_turn_trajectories(tiny_lm_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unirl.rollout.hf import HFEngine

    from unirl.rollout.vllm import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    rows = [json.loads(line) for line in (tiny_lm_dir / "test.jsonl").read_text().splitlines()[:6]]
    prompts = [tokenizer(r["question"]).input_ids for r in rows]
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    # The engine first, as TextEnvironment.setup does (see unirl/tools/search.py on import order).
    engine = VLLMEngine(str(tiny_lm_dir), dtype="float32", seed=0, gpu_memory_utilization=0.3, kv_cache_bytes=1 << 28, tensor_parallel_size=1,
                        enforce_eager=True, max_model_len=None)
    try:
        vl = _trajectories(engine, tokenizer, prompts)
    finally:
        engine.close()
    hf = _trajectories(HFEngine(lambda: model, tokenizer), tokenizer, prompts)
    assert sum(len(t.tool_calls) for t in hf) > 0, "the tiny model made no call: nothing multi-turn was compared"
    for a, b in zip(hf, vl):
        assert a.ids == b.ids, (tokenizer.decode(a.ids), tokenizer.decode(b.ids))
        assert a.loss_mask == b.loss_mask and a.turns == b.turns and a.tool_calls == b.tool_calls
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    print([tokenizer.decode(t.ids) for t in hf])
