"""The command line: one dispatch style, and the listing commands import no heavy library.

Each listing command runs in a fresh interpreter (``sys.modules`` of this test process already holds
torch) and reports which of torch, transformers and diffusers it imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "diffusers")

_PROBE = """
import contextlib, io, json, sys
from unirl.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules], "out": out.getvalue()}))
""" % (HEAVY,)


def _run(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["config", "list"], ["config", "protocols"], ["rewards", "list"],
                                  ["data", "list"], ["tools", "list"]])
def test_listing_commands_import_no_torch_transformers_or_diffusers(argv):
    result = _run(*argv)
    assert result["code"] == 0
    assert result["heavy"] == [], f"unirl {' '.join(argv)} imported {result['heavy']}"


def test_help_lists_train_first_and_gives_examples():
    out = _run("--help")["out"]
    commands = [line.split()[0] for line in out.split("positional arguments:")[1].split("options:")[0].splitlines()[2:]
                if line.startswith("    ") and not line.startswith("     ")]
    assert commands[:3] == ["train", "eval", "plot"], commands
    examples = out.split("examples:")[1]
    assert "unirl train text --config tiny" in examples and "unirl config list" in examples


def test_every_command_group_registers_the_same_way():
    import argparse
    import importlib

    from unirl.cli import COMMANDS, build_parser

    for name in COMMANDS:
        assert callable(importlib.import_module(f"unirl.cli.{name}").add_parser), name
    parser = build_parser()
    for argv in (["config", "list"], ["data", "list"], ["rewards", "list"], ["tools", "list"], ["models", "list"],
                 ["plot", "runs/a"], ["train", "text", "--config", "tiny"], ["serve-tool", "search"]):
        args = parser.parse_args(argv)
        assert callable(args.func) and isinstance(args, argparse.Namespace), argv


def test_config_list_descriptions_are_whole_sentences():
    out = _run("config", "list")["out"]
    rows = [line.split(None, 2) for line in out.split("\n\n")[0].splitlines()]
    smollm2 = next(r[2] for r in rows if r[1] == "smollm2_math")
    # its header's first sentence runs over three comment lines; the first line alone ends in "word"
    assert smollm2.endswith("(unirl/text/arithmetic.py), asked in its chat template with verl's GSM8K "
                            "instruction and scored by verl's strict \"#### N\" GSM8K score."), smollm2
    assert all(r[2].endswith((".", ")")) for r in rows), [r for r in rows if not r[2].endswith((".", ")"))]
