"""How to move the trainer's weights into the rollout server's process: HTTP with one safetensors file
(what ``rollout.engine: server`` does, ``unirl/rollout/server_client.py``) against a torch.distributed gloo
group between the two processes (a broadcast of each tensor, the path verl and OpenRLHF take with NCCL).

    python benchmarks/weight_push.py                  # the 22.6M-parameter Qwen2 shape, 7 pushes each
    python benchmarks/weight_push.py --params 135     # about SmolLM2-135M's size (random tensors)

Both sides are plain processes on this machine: the receiver only decodes the weights (the engine's own
reload is the same cost on either path and is left out). Each path's median over the pushes after the
first is printed, with the bytes moved.
"""

from __future__ import annotations

import argparse
import http.server
import multiprocessing as mp
import os
import statistics
import threading
import time
import urllib.request


def make_weights(million: float) -> dict:
    """Float32 tensors of about ``million`` million parameters, in matrices of a transformer's sizes."""
    import torch

    g = torch.Generator().manual_seed(0)
    weights, total, i = {}, 0, 0
    while total < million * 1e6:
        rows = 512 if i % 3 else 1152
        weights[f"layers.{i}.weight"] = torch.randn(rows, 512, generator=g)
        total += rows * 512
        i += 1
    return weights


def http_receiver(port_queue, done) -> None:
    from safetensors.torch import load

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            load(body)  # decoded as the server decodes it
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_queue.put(server.server_address[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    done.wait()
    server.shutdown()


def time_http(weights: dict, pushes: int) -> list[float]:
    from safetensors.torch import save

    ports, done = mp.Queue(), mp.Event()
    proc = mp.Process(target=http_receiver, args=(ports, done))
    proc.start()
    url = f"http://127.0.0.1:{ports.get()}/weights"
    times = []
    for _ in range(pushes):
        start = time.perf_counter()
        data = save(weights)
        request = urllib.request.Request(url, data=data, method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request).read()
        times.append(time.perf_counter() - start)
    done.set()
    proc.join()
    return times


def gloo_side(rank: int, port: int, million: float, pushes: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    weights = make_weights(million) if rank == 0 else {k: torch.empty_like(v) for k, v in make_weights(million).items()}
    times = []
    for _ in range(pushes):
        dist.barrier()
        start = time.perf_counter()
        for tensor in weights.values():
            dist.broadcast(tensor, src=0)
        dist.barrier()  # the receiver holds every tensor
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def time_gloo(million: float, pushes: int) -> list[float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Queue()
    procs = [mp.Process(target=gloo_side, args=(r, port, million, pushes, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    times = out.get()
    for p in procs:
        p.join()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=22.6, help="millions of float32 parameters (default 22.6)")
    parser.add_argument("--pushes", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    weights = make_weights(args.params)
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{sum(t.numel() for t in weights.values()) / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB a push")
    for name, times in (("http+safetensors", time_http(weights, args.pushes)),
                        ("gloo broadcast", time_gloo(args.params, args.pushes))):
        print(f"{name:18s} median {statistics.median(times[1:]):.3f} s  (pushes: {', '.join(f'{t:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
