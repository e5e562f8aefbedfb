"""``unirl rewards list`` and ``unirl serve-reward``: the reward subcommands of the ``unirl`` CLI.

``add_parser(subparsers, common)`` adds both; each sets ``func`` (which takes the parsed arguments
and returns an exit status).
"""

from __future__ import annotations

import argparse
import json
import sys

from unirl.cli.serving import serve_until_interrupted


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    """Add ``rewards list`` and ``serve-reward`` to ``subparsers`` (from ``add_subparsers()``)."""
    p_rewards = subparsers.add_parser("rewards", help="the rewards a config can name", parents=[common])
    rewards_sub = p_rewards.add_subparsers(dest="rewards_command", required=True)
    p_list = rewards_sub.add_parser("list", help="each reward's name, modality, source and description", parents=[common])
    p_list.set_defaults(func=list_command, loads_libraries=False)

    p_serve = subparsers.add_parser("serve-reward", help="host a reward over HTTP; a run uses it as http://host:port",
                                    parents=[common])
    p_serve.add_argument("name", help="a registered reward, path/to/file.py:function or package.module:function")
    p_serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p_serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p_serve.add_argument("--kwargs", default="{}", metavar="JSON",
                         help='settings for the reward, as in a config\'s kwargs: \'{"method": "flexible"}\'')
    p_serve.add_argument("--max-batch", type=int, default=256, metavar="N",
                         help="the most samples one reward call joins from concurrent requests (default 256; "
                              "1: never join, for a reward whose scores depend on the rest of the batch)")
    p_serve.add_argument("--max-wait-ms", type=float, default=2.0, metavar="MS",
                         help="how long a request may wait for others to join its call (default 2)")
    p_serve.add_argument("--max-queue", type=int, default=1024, metavar="N",
                         help="requests waiting before more are answered 503, which clients retry (default 1024)")
    p_serve.add_argument("--max-body-mb", type=float, default=64.0, metavar="MB",
                         help="largest request body accepted, in MiB (default 64; larger ones are answered 413)")
    p_serve.add_argument("--body-timeout-s", type=float, default=30.0, metavar="S",
                         help="seconds a request body may take to arrive (default 30; slower senders get 408)")
    p_serve.add_argument("--token", default=None,
                         help="a shared secret every request must send as 'Authorization: Bearer TOKEN' (default: "
                              "$UNIRL_REWARD_TOKEN, else none); use it whenever --host is not 127.0.0.1")
    p_serve.add_argument("--grace-s", type=float, default=10.0, metavar="S",
                         help="on SIGTERM/SIGINT, seconds the requests in flight get to finish (default 10)")
    p_serve.set_defaults(func=serve_command)


def list_command(args: argparse.Namespace) -> int:
    """Print a table of the registered rewards, then those that could not be loaded and why."""
    from unirl.rewards.loading import list_rewards, unavailable_builtins

    rows = [(i.name, i.modality, i.source, i.description) for i in list_rewards()]
    header = ("NAME", "MODALITY", "SOURCE", "DESCRIPTION")
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(3)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
    unavailable = unavailable_builtins()
    if unavailable:
        print("\nnot available:")
        for reason in unavailable.values():
            print(f"  {reason}")
    print("\nAlso: path/to/file.py:function, package.module:function, http://host:port (see docs/rewards.md).")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    """Serve ``args.name`` until interrupted; print the URL first (a line a script can wait for)."""
    from unirl.rewards.registry import RewardError
    from unirl.rewards.remote import make_server

    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        print(f"unirl serve-reward: --kwargs must be a JSON object ({err}): {args.kwargs!r}", file=sys.stderr)
        return 2
    try:
        server = make_server(args.name, args.host, args.port, kwargs, max_batch=args.max_batch,
                             max_wait_ms=args.max_wait_ms, max_queue=args.max_queue, max_body_mb=args.max_body_mb,
                             body_timeout_s=args.body_timeout_s, token=args.token, grace_s=args.grace_s)
    except (RewardError, ValueError, OSError, OverflowError) as err:
        print(f"unirl serve-reward: {err}", file=sys.stderr)
        return 1
    serve_until_interrupted(server, f"reward {args.name!r}")
    return _leave(0)


def _leave(code: int) -> int:
    """``code``, or exit at once when the reward's thread still runs a call (a hung reward, abandoned
    after the grace period): the interpreter would otherwise wait for it forever at exit."""
    import os
    import threading

    busy = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for thread in busy:
        thread.join(0.5)  # an idle worker thread ends at once after the shutdown
    if any(t.is_alive() for t in busy):
        print("unirl serve-reward: a reward call was still running; abandoned", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)
    return code

