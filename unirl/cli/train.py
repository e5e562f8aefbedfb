"""``unirl train ENV --config NAME [--recipe R] [--output-dir DIR | --new-run] [--dry-run] [key=value ...]``.

``--config`` takes a name (``configs/<env>/NAME.yaml``, shipped inside the package) or a path to a
YAML file. Before anything loads, ``unirl.preflight`` checks the data files, rewards, batch sizes,
output directory and model name; ``--dry-run`` prints the resolved config and that report and exits
(0 when clean, 2 listing every problem), a real run stops on the same problems.
"""

from __future__ import annotations

import argparse
import sys

from unirl.config.environments import ENVIRONMENTS, import_object


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser("train", help="train a policy (the first command to try: unirl train text --config tiny)",
                              parents=[common])
    p.add_argument("env", choices=sorted(ENVIRONMENTS))
    p.add_argument("--config", required=True, help=f"config name ({config_names()}) or a YAML path")
    p.add_argument("--output-dir", default=None, help="run directory (overrides output_dir)")
    p.add_argument("--recipe", default=None, help=f"a variant's keys, set before the overrides: {_recipe_names()} "
                                                  f"(unirl config list shows the keys)")
    p.add_argument("--new-run", action="store_true",
                   help="a fresh run directory beside output_dir, named with the date and time (OUTPUT_DIR-YYYYmmdd-HHMMSS)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config and the offline checks (data, rewards, batch, output, "
                        "model cache), load nothing; exit 0 when clean, 2 with every problem listed")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.total_steps=10")
    # The libraries are configured by unirl.runner once the config is checked: a bad key fails before
    # transformers and diffusers are imported (~3.5 s).
    p.set_defaults(func=train_command, loads_libraries=False)


def train_command(args: argparse.Namespace) -> int:
    import signal

    from unirl.trainer.preemption import Preempted, main_rank, stop_during_startup

    # SIGTERM before the loop takes over (checks, loading, vLLM start-up) stops with one line, not silently.
    previous = signal.signal(signal.SIGTERM, stop_during_startup)
    try:
        train(args.env, args.config, args.overrides, args.output_dir, args.dry_run,
              verbose=getattr(args, "verbose", False), new_run=args.new_run, recipe=args.recipe)
    except Preempted as e:  # a signal-stopped run: one line saying where its checkpoint is (rank 0's alone)
        if main_rank():
            print(f"unirl: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def train(env_name: str, config: str, overrides: list[str], output_dir: str | None = None, dry_run: bool = False,
          verbose: bool = False, new_run: bool = False, recipe: str | None = None):
    """``unirl train``: the config file and overrides, then ``unirl.runner.train_config`` (as ``unirl.train``)."""
    from unirl.config import resolve_config_path
    from unirl.config.recipes import recipe_overrides
    from unirl.runner import new_run_dir, train_config

    config_file = resolve_config_path(env_name, config)
    cfg = _load_file(env_name, config_file, recipe_overrides(recipe) + list(overrides), output_dir)
    if new_run:
        cfg.output_dir = str(new_run_dir(cfg.output_dir))
    return train_config(env_name, cfg, config_file=config_file, label=config, dry_run=dry_run, verbose=verbose)


def load_run_config(env_name: str, config: str, overrides: list[str], output_dir: str | None = None):
    """Resolve ``--config`` and the overrides into the environment's typed config."""
    from unirl.config import resolve_config_path

    return _load_file(env_name, resolve_config_path(env_name, config), overrides, output_dir)


def _load_file(env_name: str, path, overrides: list[str], output_dir: str | None):
    from unirl.config import load_config

    overrides = list(overrides)
    if output_dir is not None:
        overrides.append(f"output_dir={output_dir}")
    return load_config(import_object(ENVIRONMENTS[env_name][0]), path, overrides)


def config_names() -> str:
    """The shipped config names per environment, for --help: ``text: gsm8k, tiny; diffusion: ...``."""
    from unirl.config import available_configs

    return "; ".join(f"{env}: {', '.join(available_configs(env))}" for env in sorted(ENVIRONMENTS))


def _recipe_names() -> str:
    from unirl.config.recipes import RECIPES

    return ", ".join(RECIPES)
