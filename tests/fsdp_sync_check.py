"""The weight sync from a sharded policy to vLLM (``rollout.sync_bucket_mb``): after it, vLLM's
log-probs of its own samples equal the trainer's. Run by ``tests/test_fsdp.py`` in its own process
(FSDP2 needs a process group: a world of one here, or torchrun's), not a test module itself.

    python tests/fsdp_sync_check.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dist_equivalence import make_trainer


def max_gap(env, rollout) -> float:
    with torch.no_grad():
        logp = env.actions.score_actions(env.model, rollout)["logp"]
    mask = rollout.tensors["response_mask"].bool()
    return (logp - rollout.engine_logp).abs()[mask].max().item()


def check(lora: bool, work: Path) -> dict:
    from unirl.sharding import is_sharded

    overrides = ["rollout.engine=vllm", "trainer.strategy=fsdp2", "rollout.sync_bucket_mb=1", "rollout.max_new_tokens=8"]
    if lora:
        overrides += ["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj,gate_proj]"]
    trainer = make_trainer("text", 1, "token-mean", 0.0, work, overrides)
    env = trainer.env
    calls = []
    load = env.engine.load_weights
    env.engine.load_weights = lambda weights: (calls.append(len(weights)), load(weights))
    result = {"sharded": is_sharded(env.model), "before": max_gap(env, env.sampler.rollout(env.prompts.next(0), 4))}
    torch.manual_seed(0)
    env.model.reshard()  # the root's parameters stay gathered after the scoring forward
    with torch.no_grad():  # each process moves its own shard; with LoRA, the adapter (B starts at zero)
        for name, p in env.model.named_parameters():
            if p.requires_grad and (not lora or "lora_B" in name):
                local = p.to_local()
                local.add_(0.05 * torch.randn_like(local))
    result["stale"] = max_gap(env, env.sampler.rollout(env.prompts.next(1), 4))
    env.sampler.sync_weights()
    result["after"] = max_gap(env, env.sampler.rollout(env.prompts.next(2), 4))
    result["buckets"] = calls
    env.close()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {name: check(lora, args.out.parent / f"work-{name}") for name, lora in (("full", False), ("lora", True))}
    args.out.write_text(json.dumps(results))
