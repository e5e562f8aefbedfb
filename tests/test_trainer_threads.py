"""The trainer keeps its torch threads beside a colocated vLLM engine.

vLLM's serving set-up may reduce torch to one thread (and its CPU worker turns
``torch.set_num_threads`` into a no-op); the engine gives the trainer's count back after start-up
and after every ``generate``, so the update does not run on one core.
"""

from __future__ import annotations

import pytest
import torch

from unirl.rollout.vllm import VLLMEngine, vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: nothing to lower")
def test_vllm_engine_gives_the_trainer_its_threads_back(tiny_lm_dir):
    threads = torch.get_num_threads()
    engine = VLLMEngine(str(tiny_lm_dir), dtype="float32", seed=0, gpu_memory_utilization=0.5, kv_cache_bytes=1 << 28,
                        tensor_parallel_size=1, enforce_eager=True, max_model_len=None)
    try:
        assert torch.get_num_threads() == threads
        torch._C.set_num_threads(1)  # what vLLM's serving set-up does (torch.set_num_threads may be a no-op now)
        assert torch.get_num_threads() == 1
        gens = engine.generate([[5, 6, 7]], n=2, max_new_tokens=4, temperature=1.0)
        assert len(gens[0]) == 2
        assert torch.get_num_threads() == threads
    finally:
        engine.close()
        torch._C.set_num_threads(threads)
