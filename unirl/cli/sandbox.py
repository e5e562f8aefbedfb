"""``unirl sandbox run FILE``: a program run as the ``python_code`` environment runs it (the sandbox of
``unirl/agents/sandbox.py``), its outcome printed as JSON, so a user sees what the reward sees."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("sandbox", help="run a Python program in the code environment's sandbox", parents=[common])
    sub = p.add_subparsers(dest="sandbox_command", required=True)
    run = sub.add_parser("run", help="run FILE (then --tests) within the limits; print the outcome as JSON",
                         parents=[common])
    run.add_argument("file", help="the program, a Python file")
    run.add_argument("--tests", default=None, metavar="FILE", help="Python run after it in its namespace (asserts)")
    run.add_argument("--wall-s", type=float, default=10.0, help="wall-clock seconds (default 10)")
    run.add_argument("--cpu-s", type=int, default=5, help="CPU seconds (default 5)")
    run.add_argument("--memory-mb", type=int, default=512, help="address space in MiB (default 512)")
    run.add_argument("--file-size-mb", type=int, default=8, help="largest file written, output included (default 8)")
    run.add_argument("--processes", type=int, default=8, help="processes it may start (default 8)")
    run.set_defaults(func=run_command, loads_libraries=False)


def run_command(args: argparse.Namespace) -> int:
    from unirl.agents.sandbox import Limits, run_program

    code = _read(args.file, "the program")
    tests = _read(args.tests, "--tests") if args.tests else ""
    limits = Limits(wall_s=args.wall_s, cpu_s=args.cpu_s, memory_mb=args.memory_mb, file_size_mb=args.file_size_mb,
                    processes=args.processes)
    print(run_program(code, tests, limits).to_json())
    return 0


def _read(path: str, what: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{what}: no file {path}")
    return file.read_text()
