"""``unirl eval ENV [--config NAME] --checkpoint DIR [--n N] [--k K,...] [--protocol NAME,...]``: score a checkpoint
on held-out prompts, under the config's evaluation protocols (docs/evaluation.md)."""

from __future__ import annotations

import argparse
import sys

from unirl.cli.train import config_names
from unirl.config.environments import ENVIRONMENTS


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("eval", help="score a checkpoint on the config's held-out prompts", parents=[common])
    p.add_argument("env", choices=sorted(ENVIRONMENTS))
    p.add_argument("--config", default=None,
                   help=f"config name ({config_names()}) or a YAML path; default and by preference: the "
                        f"checkpoint's run's saved config.yaml (its test split and rewards)")
    p.add_argument("--no-run-config", action="store_true",
                   help="score a run's checkpoint with --config instead of the run's saved config.yaml")
    p.add_argument("--checkpoint", required=True,
                   help="a run's checkpoints/step_N/ (full or LoRA), a model directory, a named model "
                        "(unirl models list) or a hub name")
    p.add_argument("--output-dir", default=None, help="where samples and the summary go (default CHECKPOINT/eval)")
    p.add_argument("--n", type=int, default=1, help="text: answers per prompt (1: greedy; N: sampled, pass@k)")
    p.add_argument("--k", default="", help="text: extra k for pass@k, comma-separated (1 and N always)")
    p.add_argument("--protocol", default="",
                   help="text: only these evaluation protocols, comma-separated: the config's eval.protocols, "
                        "'default' (data.test) or shipped ones (unirl config protocols); default: what the run evaluates")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.eval_size=100")
    # The libraries are configured by unirl.api.evaluate once the checkpoint and config are checked.
    p.set_defaults(func=eval_command, loads_libraries=False)


def eval_command(args: argparse.Namespace) -> int:
    from unirl.api import evaluate as evaluate_checkpoint
    from unirl.evaluation import choose_config, summary_line

    ks = [int(k) for k in args.k.split(",") if k.strip()]
    protocols = [name.strip() for name in args.protocol.split(",") if name.strip()] or None
    config, which = choose_config(args.checkpoint, args.config, not args.no_run_config)  # the run's own, unless told
    print(which, file=sys.stderr)
    summary = evaluate_checkpoint(args.env, config, args.overrides, checkpoint=args.checkpoint,
                                  output_dir=args.output_dir, n=args.n, ks=ks, protocols=protocols,
                                  verbose=getattr(args, "verbose", False),
                                  run_config=False)
    print(summary_line(summary))
    return 0
