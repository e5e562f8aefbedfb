"""Load on ``unirl serve-reward``: concurrent clients, requests per second, latency percentiles.

    python benchmarks/reward_server_load.py                          # 8 clients x 50 requests of 4 samples
    python benchmarks/reward_server_load.py --call-ms 5 --sample-ms 0.25
    python benchmarks/reward_server_load.py --server-args="--max-wait-ms 0"

Starts the real command in a subprocess on a free port, serving ``per_call`` (below, written to a
temporary file): a deterministic text reward that holds the GIL for ``call_ms`` per call plus
``sample_ms`` per sample, the way a model's forward pass costs a fixed amount per call and cannot
run two at once. Each client is a thread calling ``RemoteReward`` (what a run uses) ``--requests``
times; every answer is checked against local scoring. Prints requests/s, p50/p99 latency and how
many calls the reward received (it logs each call's batch size). tests/test_reward_server_load.py
runs the same load and asserts on it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PER_CALL = '''
import time


def per_call(samples, *, prompts, answer, call_ms=0.0, sample_ms=0.0, log=None, **kwargs):
    """Deterministic score of each sample: its character sum mod 97, over 97, plus 1 if it holds its answer."""
    end = time.perf_counter() + (call_ms + sample_ms * len(samples)) / 1000
    while time.perf_counter() < end:  # busy, holding the GIL: calls cannot overlap
        pass
    if log:
        with open(log, "a") as f:
            f.write(f"{len(samples)}\\n")
    return [sum(map(ord, s)) % 97 / 97 + (1.0 if a in s else 0.0) for s, a in zip(samples, answer)]
'''


def write_reward(directory: Path) -> str:
    """Write ``per_call`` to ``directory``; return its spec."""
    path = Path(directory) / "per_call_reward.py"
    path.write_text(PER_CALL)
    return f"{path}:per_call"


def request(client: int, i: int, samples: int) -> tuple[list[str], list[str], dict[str, list]]:
    """The ``i``-th request of ``client``: distinct samples, prompts and answers for each."""
    texts = [f"client {client} request {i} sample {k}: the answer is {(client * 7 + i * 3 + k) % 10}" for k in range(samples)]
    prompts = [f"q{client}.{i}.{k}" for k in range(samples)]
    answers = [str((client + i + k) % 10) for k in range(samples)]
    return texts, prompts, {"answer": answers}


@contextmanager
def serving(spec: str, kwargs: str = "{}", server_args: list[str] = ()):
    """``unirl serve-reward spec`` in a subprocess on a free port; yields its URL."""
    import select

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "unirl.cli", "serve-reward", spec, "--port", "0", "--kwargs", kwargs,
             *server_args],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO,
        )
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            line = proc.stdout.readline() if ready else ""
            if " at http://" not in line:
                proc.kill()
                stderr.seek(0)
                raise RuntimeError(f"serve-reward did not start: {line!r} {stderr.read()[-2000:]}")
            yield line.split(" at ")[1].strip()
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def run_load(url: str, *, clients: int = 8, requests: int = 50, samples: int = 4, timeout: float = 60.0) -> dict:
    """``clients`` threads, each sending ``requests`` requests one after another.

    Returns ``answers`` ({(client, i): scores}), ``errors`` ({(client, i): message}), ``latencies``
    (seconds, one per answered request) and ``wall`` (seconds from the first request to the last answer).
    """
    from unirl.rewards.remote import RemoteReward

    answers, errors, latencies = {}, {}, []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        reward = RemoteReward(url, timeout=timeout, retries=0)
        start.wait()
        for i in range(requests):
            texts, prompts, columns = request(c, i, samples)
            t0 = time.perf_counter()
            try:
                scores = reward(texts, prompts=prompts, **columns)
            except Exception as err:  # counted, not raised: the caller decides
                with lock:
                    errors[(c, i)] = f"{type(err).__name__}: {err}"
                continue
            elapsed = time.perf_counter() - t0
            with lock:
                answers[(c, i)] = scores
                latencies.append(elapsed)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return {"answers": answers, "errors": errors, "latencies": latencies, "wall": time.perf_counter() - t0}


def summary(result: dict) -> dict:
    """Requests per second and p50/p99/max latency in milliseconds."""
    lat = sorted(result["latencies"])
    cuts = statistics.quantiles(lat, n=100, method="inclusive")
    return {"requests_per_s": len(lat) / result["wall"], "p50_ms": 1000 * statistics.median(lat),
            "p99_ms": 1000 * cuts[98], "max_ms": 1000 * lat[-1]}


def local_scores(spec: str, kwargs: dict, clients: int, requests: int, samples: int) -> dict:
    """What scoring each request locally gives, by (client, i)."""
    from unirl.rewards.loading import load_reward
    from unirl.rewards.scoring import score_batch

    fn = load_reward(spec, **kwargs)
    out = {}
    for c in range(clients):
        for i in range(requests):
            texts, prompts, columns = request(c, i, samples)
            out[(c, i)] = score_batch(fn, texts, name=spec, prompts=prompts, **columns)
    return out


def main() -> None:
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=50, help="per client")
    parser.add_argument("--samples", type=int, default=4, help="per request")
    parser.add_argument("--call-ms", type=float, default=0.0, help="the reward's cost per call")
    parser.add_argument("--sample-ms", type=float, default=0.0, help="the reward's cost per sample")
    parser.add_argument("--server-args", default="", help="more serve-reward options, e.g. '--max-wait-ms 0'")
    parser.add_argument("--repeat", type=int, default=1, help="runs against one server; each is printed")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_reward(Path(tmp))
        log = Path(tmp) / "calls.log"
        kwargs = {"call_ms": args.call_ms, "sample_ms": args.sample_ms, "log": str(log)}
        expected = local_scores(spec, {**kwargs, "log": None}, args.clients, args.requests, args.samples)
        with serving(spec, json.dumps(kwargs), shlex.split(args.server_args)) as url:
            for _ in range(args.repeat):
                log.write_text("")
                result = run_load(url, clients=args.clients, requests=args.requests, samples=args.samples)
                sizes = [int(x) for x in log.read_text().split()]
                wrong = sum(result["answers"][k] != v for k, v in expected.items() if k in result["answers"])
                row = summary(result)
                print(f"{args.clients} clients x {args.requests} requests of {args.samples} samples, "
                      f"call {args.call_ms:g} ms + {args.sample_ms:g} ms/sample, server args {args.server_args!r}: "
                      f"{row['requests_per_s']:.0f} requests/s, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, max {row['max_ms']:.0f} ms; "
                      f"{len(sizes)} reward calls (mean batch {statistics.mean(sizes):.1f} samples); "
                      f"{len(result['errors'])} errors, {wrong} answers unequal to local scoring", flush=True)
    print("reproduce: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))


if __name__ == "__main__":
    main()
