"""The ``unirl`` command.

    unirl train text --config gsm8k [--output-dir DIR] [--dry-run] [key=value ...]
    unirl train diffusion --config sd3_ocr ...
    unirl rewards list
    unirl serve-reward NAME [--host 127.0.0.1] [--port P]

``--config`` takes a name (``configs/<env>/NAME.yaml`` in this repository) or a path to a YAML file.
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
    from unirl.config import load_config, resolve_config_path

    cls = _import(ENVIRONMENTS[env_name][0])
    overrides = list(overrides)
    if output_dir is not None:
        overrides.append(f"output_dir={output_dir}")
    return load_config(cls, resolve_config_path(env_name, config), overrides)


def train(env_name: str, config: str, overrides: list[str], output_dir: str | None = None, dry_run: bool = False):
    from unirl.config import config_to_dict

    cfg = load_run_config(env_name, config, overrides, output_dir)
    resolved = config_to_dict(cfg)
    if dry_run:
        import yaml

        print(yaml.safe_dump(resolved, sort_keys=False), end="")
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
    p_train = sub.add_parser("train", help="train a policy")
    p_train.add_argument("env", choices=sorted(ENVIRONMENTS))
    p_train.add_argument("--config", required=True, help="config name (configs/<env>/NAME.yaml) or a YAML path")
    p_train.add_argument("--output-dir", default=None, help="run directory (overrides output_dir)")
    p_train.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
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

    try:
        if args.command == "train":
            train(args.env, args.config, args.overrides, args.output_dir, args.dry_run)
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
