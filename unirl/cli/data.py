"""``unirl data list`` and ``unirl data cat``: the bundled and generated prompt sets a config can name.

``unirl data list`` prints each ``unirl://`` source with its row count and file; ``unirl data cat
SOURCE`` prints a source's prompts, one a line (``unirl data cat 'unirl://ocr/generated?n=20000' >
train.txt`` writes the generated OCR training list to a file). Sources and licences:
``unirl/data/README.md``.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    """Add ``data list`` and ``data cat``; each sets ``func``."""
    p_data = subparsers.add_parser("data", help="the prompt sets bundled with unirl (unirl://...)", parents=[common])
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    p_list = data_sub.add_parser("list", help="each bundled or generated source with its row count", parents=[common])
    p_list.set_defaults(func=list_command, loads_libraries=False)
    p_cat = data_sub.add_parser("cat", help="print a source's prompts, one a line", parents=[common])
    p_cat.add_argument("source", help="unirl://NAME (see unirl data list), e.g. unirl://ocr/test.txt")
    p_cat.add_argument("--head", type=int, default=None, metavar="N", help="only the first N lines")
    p_cat.set_defaults(func=cat_command, loads_libraries=False)


def list_command(args: argparse.Namespace) -> int:
    from unirl.data.paths import BUNDLED_DIR, SCHEME, bundled_files, generated_sources

    rows = [(b.spec, str(b.rows), str(b.path)) for b in bundled_files()]
    rows += [(f"{SCHEME}{g.name}?{'&'.join(f'{k}={v}' for k, v in g.defaults.items())}", "n", f"generated: {g.about}")
             for g in generated_sources()]
    header = ("SOURCE", "ROWS", "FILE")
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(2)]
    for row in [header, *rows]:
        print(f"{row[0].ljust(widths[0])}  {row[1].rjust(widths[1])}  {row[2]}")
    print(f"\nSources and licences: {BUNDLED_DIR / 'README.md'}")
    return 0


def cat_command(args: argparse.Namespace) -> int:
    import json

    from unirl.data.paths import (DataFileNotFoundError, generated_prompts, generated_rows, is_generated, is_scheme,
                                  local_path, makes_rows)

    if not is_scheme(args.source):
        print(f"unirl: {args.source!r} is not a unirl:// source (see unirl data list)", file=sys.stderr)
        return 2
    try:
        if makes_rows(args.source):  # text rows: one JSON line each
            lines = [json.dumps(row) for row in generated_rows(args.source)]
        elif is_generated(args.source):
            lines = generated_prompts(args.source)
        else:
            lines = local_path(args.source).read_text(encoding="utf-8").splitlines()
    except (DataFileNotFoundError, ValueError) as err:
        print(f"unirl: {err}", file=sys.stderr)
        return 2
    for line in lines[: args.head]:
        print(line)
    return 0
