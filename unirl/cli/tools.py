"""``unirl tools list`` and ``unirl serve-tool``: the tool subcommands of the ``unirl`` CLI
(``add_parser(subparsers, common)`` adds both; each sets ``func``)."""

from __future__ import annotations

import argparse
import json
import sys

from unirl.cli.serving import serve_until_interrupted


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p_tools = subparsers.add_parser("tools", help="the tools a config's rollout.tools can name", parents=[common])
    tools_sub = p_tools.add_subparsers(dest="tools_command", required=True)
    p_list = tools_sub.add_parser("list", help="each tool's name, source and description", parents=[common])
    p_list.set_defaults(func=list_command, loads_libraries=False)

    p_serve = subparsers.add_parser("serve-tool", help="host a tool over HTTP; a run names it http://host:port",
                                    parents=[common])
    p_serve.add_argument("name", help="a registered tool (search, calculator), path/to/file.py:function or module:function")
    p_serve.add_argument("--corpus", default=None, help="the search tool's JSONL corpus (same as --kwargs '{\"corpus\": ...}')")
    p_serve.add_argument("--kwargs", default="{}", metavar="JSON", help="settings for the tool, as in a config's kwargs")
    p_serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p_serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p_serve.add_argument("--max-batch", type=int, default=64, metavar="N", help="calls joined into one (default 64)")
    p_serve.add_argument("--max-wait-ms", type=float, default=2.0, metavar="MS",
                         help="how long a request may wait for others to join its call (default 2)")
    p_serve.add_argument("--max-queue", type=int, default=1024, metavar="N",
                         help="requests waiting before more are answered 503, which clients retry (default 1024)")
    p_serve.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB",
                         help="larger request bodies are refused, 413 (default 16)")
    p_serve.add_argument("--body-timeout-s", type=float, default=30.0, metavar="S",
                         help="a body not arrived after this long is refused, 408 (default 30)")
    p_serve.add_argument("--token", default=None,
                         help="shared secret every request but /health must send (default $UNIRL_REWARD_TOKEN)")
    p_serve.set_defaults(func=serve_command)


def list_command(args: argparse.Namespace) -> int:
    from unirl.tools import list_tools, unavailable_tools

    rows = [(t.name, t.source, t.description) for t in list_tools()]
    header = ("NAME", "SOURCE", "DESCRIPTION")
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(2)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:2], widths)) + "  " + row[2])
    for reason in unavailable_tools().values():
        print(f"not available: {reason}")
    print("\nAlso: path/to/file.py:function, package.module:function, http://host:port (unirl serve-tool).")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    """Serve ``args.name`` until interrupted; print the URL first (a line a script can wait for)."""
    from unirl.tools import ToolError
    from unirl.tools.remote import make_tool_server

    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        print(f"unirl serve-tool: --kwargs must be a JSON object ({err}): {args.kwargs!r}", file=sys.stderr)
        return 2
    if args.corpus is not None:
        kwargs["corpus"] = args.corpus
    try:
        server = make_tool_server(args.name, args.host, args.port, kwargs, max_batch=args.max_batch,
                                  max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                                  max_body_mb=args.max_body_mb, body_timeout_s=args.body_timeout_s, token=args.token)
    except (ToolError, ValueError, OSError) as err:
        print(f"unirl serve-tool: {err}", file=sys.stderr)
        return 1
    serve_until_interrupted(server, f"tool {args.name!r}")
    return 0
