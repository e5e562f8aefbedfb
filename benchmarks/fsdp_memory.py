"""Per-process memory of parameters, gradients and AdamW state under FSDP2, 1 vs 2 vs 4 processes.

    python benchmarks/fsdp_memory.py                       # 2 and 4 layers, 1, 2 and 4 processes over gloo
    python benchmarks/fsdp_memory.py --layers 2 --procs 1 2

The model is Qwen2.5-0.5B's width (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864, vocabulary 151936,
tied embeddings, float32), random and cut to a few layers, built from ``Qwen2Config``: nothing is
downloaded. Each process count is a fresh ``torchrun`` whose processes shard the model with unirl's
``unirl.trainer.fsdp.shard`` (each decoder layer, then the root), run three AdamW steps of a
forward+backward on 2 sequences of 128 tokens each, and report the bytes this process holds: its
parameter shards, its gradient shards and its optimizer moments (read from the tensors, exact), the
median seconds a step, and the peak resident set (which also counts the whole model each process
builds before sharding it, activations, logits and the allocator's caching). Expect the first three to
fall as 1/N; the embedding (136M of the 0.5B width's parameters) is sharded like every other tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

QWEN25_05B_WIDTH = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                        num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
MB = 2 ** 20


def worker(layers: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from unirl.trainer.backends.fsdp2 import shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **QWEN25_05B_WIDTH))

    class CPU:  # what shard() reads of an Accelerator
        device = torch.device("cpu")

    shard(model, CPU())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, QWEN25_05B_WIDTH["vocab_size"], (2, 128), generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        grads = sum(p.grad.to_local().numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        optimizer.zero_grad(set_to_none=True)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    figures = {
        "params_mb": sum(local(p).numel() * p.element_size() for p in model.parameters()) / MB,
        "grads_mb": grads / MB,
        "optimizer_mb": sum(local(v).numel() * v.element_size() for s in optimizer.state.values()
                            for k, v in s.items() if k != "step") / MB,
        "step_s": sorted(times)[1],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    rows = [None] * world
    dist.all_gather_object(rows, figures)
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("/tmp/fsdp_memory.json"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.layers[0], args.out)
        return
    print("| layers | processes | parameters / process | gradients / process | AdamW state / process | step (s) | peak RSS / process |")
    print("|---|---|---|---|---|---|---|")
    for layers in args.layers:
        for n in args.procs:
            out = Path(f"/tmp/fsdp_memory_{os.getpid()}_{layers}_{n}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={_free_port()}",
                   __file__, "--worker", "--layers", str(layers), "--out", str(out)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
            rows = json.loads(out.read_text())
            out.unlink()
            worst = {k: max(r[k] for r in rows) for k in rows[0]}  # the busiest process
            print(f"| {layers} | {n} | {worst['params_mb']:.0f} MiB | {worst['grads_mb']:.0f} MiB | "
                  f"{worst['optimizer_mb']:.0f} MiB | {worst['step_s']:.2f} | {worst['peak_rss_mb']:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
