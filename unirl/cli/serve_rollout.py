"""``unirl serve-rollout``: the rollout engine (vLLM) in its own process, for trainers with
``rollout.engine: server`` and for OpenAI-compatible clients (``unirl.rollout.server``)."""

from __future__ import annotations

import argparse
import sys

from unirl.cli.serving import serve_until_interrupted


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("serve-rollout", parents=[common],
                              help="serve a policy with vLLM for trainers (rollout.engine=server) and OpenAI clients")
    p.add_argument("model", help="a model directory, a hub name, or tiny (the embedded toy)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8100, help="port (default 8100; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None, help="the name OpenAI clients give as 'model' (default: MODEL)")
    p.add_argument("--dtype", default="auto", help="vLLM's dtype (default auto; the trainer's model.dtype to match it)")
    p.add_argument("--seed", type=int, default=0, help="vLLM's sampling seed (default 0)")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM's longest prompt + answer")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU (default 0.3)")
    p.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                   help="vLLM's KV cache in GiB (default: vLLM's own sizing; on the CPU that is "
                        "--gpu-memory-utilization of the host's memory)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor-parallel GPUs (default 1)")
    p.add_argument("--max-body-mb", type=float, default=64.0, metavar="MB",
                   help="largest request body, in MiB (default 64; weights: --max-weights-mb); larger ones get 413")
    p.add_argument("--max-weights-mb", type=float, default=65536.0, metavar="MB",
                   help="largest weight push, in MiB (default 65536)")
    p.add_argument("--body-timeout-s", type=float, default=600.0, metavar="S",
                   help="seconds a request body may take to arrive (default 600, a weight push included); slower get 408")
    p.add_argument("--token", default=None, help="a shared secret every request but /health must send as "
                   "'Authorization: Bearer TOKEN' (default: $UNIRL_ROLLOUT_TOKEN); required when --host is not "
                   "loopback. Without one, the weight routes still take a token, made at start and written "
                   "(0600) to ~/.cache/unirl/rollout-tokens/PORT, where a trainer on this machine reads it")
    p.add_argument("--grace-s", type=float, default=10.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds the requests in flight get to finish (default 10)")
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    """Load vLLM, print the URL (a line a script can wait for), serve until interrupted."""
    from unirl.rollout.server import make_server
    from unirl.text.model_loading import resolve_model_path

    try:
        server = make_server(args.model, args.host, args.port, served_name=args.served_model_name, dtype=args.dtype,
                             resolve=resolve_model_path,
                             seed=args.seed, max_model_len=args.max_model_len,
                             gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gb=args.kv_cache_gb,
                             tensor_parallel_size=args.tensor_parallel_size, max_body_mb=args.max_body_mb,
                             max_weights_mb=args.max_weights_mb, body_timeout_s=args.body_timeout_s, token=args.token,
                             grace_s=args.grace_s)
    except (ValueError, OSError, ImportError, OverflowError) as err:
        print(f"unirl serve-rollout: {err}", file=sys.stderr)
        return 1
    if server.token_file is not None:  # before the URL line a script waits for
        print(f"unirl serve-rollout: no --token: the weight routes take a token made now, written to "
              f"{server.token_file} (0600) for a trainer of this user on this machine; other clients set "
              f"$UNIRL_ROLLOUT_TOKEN to it", file=sys.stderr, flush=True)
    try:
        serve_until_interrupted(server, f"rollouts of {args.model!r}")
    finally:
        if server.token_file is not None:
            server.token_file.unlink(missing_ok=True)
    return 0
