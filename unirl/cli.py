"""The ``unirl`` command.

    unirl train text --config gsm8k [--output-dir DIR] [--dry-run] [key=value ...]
    unirl train diffusion --config sd3_ocr ...
    unirl rewards list
    unirl serve-reward NAME [--host 127.0.0.1] [--port P]
    unirl data list
    unirl data cat unirl://ocr/test.txt

``--config`` takes a name (``configs/<env>/NAME.yaml``, shipped inside the package) or a path to a
YAML file. Before anything loads, ``unirl.preflight`` checks the data files, rewards, batch sizes,
output directory and model name; ``--dry-run`` prints the resolved config and that report and exits
(0 when clean, 2 listing every problem), a real run stops on the same problems.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# environment -> (config dataclass, environment class); imported only when used.
ENVIRONMENTS = {
    "text": ("unirl.text.config:TextConfig", "unirl.text.env:TextEnvironment"),
    "diffusion": ("unirl.diffusion.config:DiffusionConfig", "unirl.diffusion.env:DiffusionEnvironment"),
}


def _import(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def load_run_config(env_name: str, config: str, overrides: list[str], output_dir: str | None = None):
    """Resolve ``--config`` and the overrides into the environment's typed config."""
    from unirl.config import resolve_config_path

    return _load_file(env_name, resolve_config_path(env_name, config), overrides, output_dir)


def _load_file(env_name: str, path, overrides: list[str], output_dir: str | None):
    from unirl.config import load_config

    overrides = list(overrides)
    if output_dir is not None:
        overrides.append(f"output_dir={output_dir}")
    return load_config(_import(ENVIRONMENTS[env_name][0]), path, overrides)


def train(env_name: str, config: str, overrides: list[str], output_dir: str | None = None, dry_run: bool = False):
    from unirl.config import config_to_dict, resolve_config_path
    from unirl.preflight import PreflightError, preflight

    # 1. The config, with paths resolved beside its file; 2. the offline checks, before any model loads.
    config_file = resolve_config_path(env_name, config)
    cfg = _load_file(env_name, config_file, overrides, output_dir)
    resolved = config_to_dict(cfg)
    report = preflight(cfg, env_name, config_file)
    if dry_run:
        import yaml

        print(yaml.safe_dump(resolved, sort_keys=False), end="")
        print(report.format(), end="")
    if report.problems:
        raise PreflightError(report.problems)
    if dry_run:
        return None
    from unirl.loop import Trainer

    env = _import(ENVIRONMENTS[env_name][1])(cfg)
    trainer = Trainer(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                      config_dict=resolved)
    return trainer.train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unirl", description="RL post-training for LLMs and diffusion models.")
    sub = parser.add_subparsers(dest="command", required=True)
    from unirl.reward_commands import add_subcommands

    add_subcommands(sub)  # unirl rewards list, unirl serve-reward NAME
    from unirl.data_commands import add_subcommands as add_data_subcommands

    add_data_subcommands(sub)  # unirl data list, unirl data cat SOURCE
    p_train = sub.add_parser("train", help="train a policy")
    p_train.add_argument("env", choices=sorted(ENVIRONMENTS))
    p_train.add_argument("--config", required=True, help="config name (configs/<env>/NAME.yaml) or a YAML path")
    p_train.add_argument("--output-dir", default=None, help="run directory (overrides output_dir)")
    p_train.add_argument("--dry-run", action="store_true",
                         help="print the resolved config and the offline checks (data, rewards, batch, output, "
                              "model cache), load nothing; exit 0 when clean, 2 with every problem listed")
    p_train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.total_steps=10")
    # Overrides may come before or after the options; argparse binds a trailing positional list too
    # early, so collect the leftovers and accept exactly the key=value ones.
    args, extra = parser.parse_known_args(argv)
    if extra:
        bad = [e for e in extra if "=" not in e or e.startswith("-")]
        if bad or args.command != "train":
            parser.error(f"unrecognized arguments: {' '.join(bad or extra)} (overrides are key=value)")
        args.overrides = list(args.overrides) + extra

    if args.command != "train":
        return args.func(args)
    from unirl.config import ConfigError
    from unirl.preflight import PreflightError

    try:
        if args.command == "train":
            train(args.env, args.config, args.overrides, args.output_dir, args.dry_run)
    except PreflightError as e:
        print(f"unirl: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"unirl: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a signal-stopped run: one line saying where its checkpoint is
        if type(e).__name__ != "Preempted":
            raise
        print(f"unirl: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
