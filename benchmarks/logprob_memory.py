"""Peak memory of the text log-prob pass (forward + backward) with full logits and chunked.

    python benchmarks/logprob_memory.py                          # N x R = 1x512 and 4x512 (about 3 min on 2 cores)
    python benchmarks/logprob_memory.py --shapes 4x512 8x512 --modes full 1024 512   # the README's table
    python benchmarks/logprob_memory.py --shapes 8x1024 --modes 1024   # full logits there need ~20 GB

The model is Qwen2.5-0.5B-shaped but random and 2 layers deep (hidden 896, 14 heads of 64, 2 KV
heads, MLP 4864, vocabulary 151936, tied embeddings, float32), built from ``Qwen2Config``: nothing is
downloaded. For each (N, R) and mode a fresh process builds it, makes N sequences of 64 prompt and R
response tokens, and runs what the trainer runs for one micro-batch, ``unirl.text.logprobs.
response_logprobs`` (the text environment's ``score_actions``) and the backward of the masked log-prob
sum, once with ``chunk_size=None`` (full ``[N, P+R, V]`` logits, the path before issue 9) and once
per chunk size. It prints the memory that call adds on top of the model and inputs: weight
gradients (0.66 GB here: the 545 MB embedding/head and the two layers) plus activations and logits.

How memory is read: on CUDA, ``torch.cuda.max_memory_allocated`` minus the allocated bytes before.
On CPU, the peak resident set (``VmHWM`` after a reset through ``/proc/self/clear_refs``) minus the
resident set before, with glibc told to serve every allocation of 128 KiB or more by mmap
(``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set at once and the peak is that of
the live tensors, not of allocator caching. For scale: one float32 copy of 4 x 576 x 151936 logits is
1.4 GB. Seconds per call go to stderr (one forward+backward, model build excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

QWEN25_05B_2_LAYERS = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                           num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
PROMPT = 64


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(n: int, R: int, chunk_size: int | None, device: str) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from unirl.text.logprobs import response_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B_2_LAYERS, dtype="float32")).to(device).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(151936, (n, PROMPT + R), generator=g).to(device)  # [n, P+R]
    attn = torch.ones_like(ids)
    positions = torch.arange(PROMPT + R, device=device).expand(n, -1)
    response_mask = torch.ones(n, R, device=device)

    def step():
        logp, _ = response_logprobs(model, model.get_output_embeddings(), ids, attn, positions, ids[:, PROMPT:],
                                    temperature=1.0, chunk_size=chunk_size)
        (logp * response_mask).sum().backward()

    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        added = torch.cuda.max_memory_allocated() - before
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        added = (_status_kib("VmHWM") - before) * 1024
    return {"n": n, "R": R, "chunk_size": chunk_size, "added_gb": added / 1e9, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["1x512", "4x512"], help="N x R")
    parser.add_argument("--modes", nargs="+", default=["full", "1024"], help="'full' and/or chunk sizes")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        n, R, chunk, device = args.child
        print(json.dumps(child(int(n), int(R), None if chunk == "full" else int(chunk), device)))
        return
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    rows = {}
    for shape in args.shapes:
        n, R = (int(x) for x in shape.lower().split("x"))
        for mode in args.modes:
            out = subprocess.run([sys.executable, __file__, "--child", str(n), str(R), mode, device],
                                 check=True, capture_output=True, text=True, env=env)
            rows[shape, mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  {shape} {mode}: {rows[shape, mode]['added_gb']:.2f} GB, {rows[shape, mode]['seconds']:.1f} s",
                  file=sys.stderr)
    print(f"text log-prob pass, Qwen2.5-0.5B-shaped head (hidden 896, vocab 151936, 2 layers, float32), "
          f"prompt {PROMPT} tokens, {device}: memory added by one forward+backward (weight gradients included)")
    names = ["full logits (before)" if m == "full" else f"chunked, {m} tokens" for m in args.modes]
    print("| N x R | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for shape in args.shapes:
        cells = [f"{rows[shape, m]['added_gb']:.2f} GB" for m in args.modes]
        print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
