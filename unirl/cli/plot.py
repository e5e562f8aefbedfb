"""``unirl plot RUN_DIR ... [--out PNG] [--metrics a,b]``: one PNG of the curves of one or more runs."""

from __future__ import annotations

import argparse


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("plot", help="one PNG of the curves of one or more runs", parents=[common])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png of the first run)")
    p.add_argument("--metrics", default=None, help="comma-separated metrics, e.g. reward/mean,eval/accuracy")
    p.set_defaults(func=plot_command, loads_libraries=False)  # matplotlib only: transformers and diffusers took ~6 s


def plot_command(args: argparse.Namespace) -> int:
    from unirl.plot import plot_runs

    names = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    print(f"wrote {plot_runs(args.runs, args.out, names)}")
    return 0
