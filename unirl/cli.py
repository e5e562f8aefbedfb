"""The ``unirl`` command.

    unirl train text --config gsm8k [--output-dir DIR] [--dry-run] [key=value ...]
    unirl train diffusion --config sd3_ocr ...
    unirl rewards list
    unirl serve-reward NAME [--host 127.0.0.1] [--port P]
    unirl data list
    unirl data cat unirl://ocr/test.txt
    unirl models prepare smollm2-135m-instruct   (or: unirl models import-gguf FILE --out DIR)
    unirl eval text --config gsm8k --checkpoint runs/text-gsm8k/checkpoints/step_000100 [--n 8]
    unirl plot runs/a runs/b [--out curves.png] [--metrics reward/mean,eval/accuracy]

Errors a user can cause end with one line and exit 2 (``--debug`` shows the traceback); vLLM,
transformers and diffusers log at WARNING unless ``--verbose``.

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
    history = trainer.train()
    # Several processes leave together: one tearing the process group down while another is still
    # busy (the main process writing logs) can abort gloo ("terminate called without an active exception").
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.state.destroy_process_group()
    return history


def evaluate(env_name: str, config: str, overrides: list[str], checkpoint: str, output_dir: str | None, n: int,
             ks: list[int]) -> None:
    if env_name == "text":
        from unirl.evaluate import evaluate_text, summary_line

        cfg = load_run_config(env_name, config, overrides)
        out = output_dir or str(_default_eval_dir(checkpoint))
        print(summary_line(evaluate_text(cfg, checkpoint, out, n=n, ks=ks)))
    else:
        from unirl.evaluate import evaluate_diffusion, summary_line

        cfg = load_run_config(env_name, config, overrides)
        out = output_dir or str(_default_eval_dir(checkpoint))
        print(summary_line(evaluate_diffusion(cfg, checkpoint, out)))


def _default_eval_dir(checkpoint: str):
    from pathlib import Path

    path = Path(checkpoint)
    return (path / "eval") if path.is_dir() else Path("eval") / path.name


def plot(runs: list[str], out: str | None, metrics: str | None) -> None:
    from unirl.plot import plot_runs

    names = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else None
    print(f"wrote {plot_runs(runs, out, names)}")


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors a user causes (a config, a data file, a reward, a model that cannot be found, a missing
    package, a wrong launch): the CLI ends them with one line and exit 2. Anything else is a bug and
    keeps its traceback."""
    from unirl.distributed import LaunchError

    return ValueError, OSError, ImportError, LaunchError


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    if len(lines) > 1 and type(error).__module__.split(".")[0] != "unirl":
        text += " ..."  # a library's long message: its first line names the problem
    return text


def main(argv: list[str] | None = None) -> int:
    # --verbose / --debug go anywhere on the line: before the subcommand or after it.
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="let vLLM, transformers and diffusers log at INFO")
    flags.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error instead of one line")
    parser = argparse.ArgumentParser(prog="unirl", description="RL post-training for LLMs and diffusion models.",
                                     parents=[flags])
    sub = parser.add_subparsers(dest="command", required=True)
    from unirl.reward_commands import add_subcommands

    add_subcommands(sub)  # unirl rewards list, unirl serve-reward NAME
    from unirl.data_commands import add_subcommands as add_data_subcommands

    add_data_subcommands(sub)  # unirl data list, unirl data cat SOURCE
    from unirl.model_commands import add_subcommands as add_model_subcommands

    add_model_subcommands(sub)  # unirl models list|prepare NAME|import-gguf FILE --out DIR
    p_train = sub.add_parser("train", help="train a policy", parents=[flags])
    p_train.add_argument("env", choices=sorted(ENVIRONMENTS))
    p_train.add_argument("--config", required=True, help="config name (configs/<env>/NAME.yaml) or a YAML path")
    p_train.add_argument("--output-dir", default=None, help="run directory (overrides output_dir)")
    p_train.add_argument("--dry-run", action="store_true",
                         help="print the resolved config and the offline checks (data, rewards, batch, output, "
                              "model cache), load nothing; exit 0 when clean, 2 with every problem listed")
    p_train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.total_steps=10")
    p_eval = sub.add_parser("eval", help="score a checkpoint on the config's held-out prompts", parents=[flags])
    p_eval.add_argument("env", choices=sorted(ENVIRONMENTS))
    p_eval.add_argument("--config", required=True, help="config name or YAML path (its test split and rewards)")
    p_eval.add_argument("--checkpoint", required=True,
                        help="a run's checkpoints/step_N/ (full or LoRA), a model directory, a named model "
                             "(unirl models list) or a hub name")
    p_eval.add_argument("--output-dir", default=None, help="where samples and the summary go (default CHECKPOINT/eval)")
    p_eval.add_argument("--n", type=int, default=1, help="text: answers per prompt (1: greedy; N: sampled, pass@k)")
    p_eval.add_argument("--k", default="", help="text: extra k for pass@k, comma-separated (1 and N always)")
    p_eval.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.eval_size=100")
    p_plot = sub.add_parser("plot", help="one PNG of the curves of one or more runs", parents=[flags])
    p_plot.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p_plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png of the first run)")
    p_plot.add_argument("--metrics", default=None, help="comma-separated metrics, e.g. reward/mean,eval/accuracy")
    # Overrides may come before or after the options; argparse binds a trailing positional list too
    # early, so collect the leftovers and accept exactly the key=value ones.
    args, extra = parser.parse_known_args(argv)
    if extra:
        bad = [e for e in extra if "=" not in e or e.startswith("-")]
        if bad or args.command not in ("train", "eval"):
            parser.error(f"unrecognized arguments: {' '.join(bad or extra)} (overrides are key=value)")
        args.overrides = list(args.overrides) + extra
    from unirl import logs

    logs.configure(verbose=getattr(args, "verbose", False))
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("unirl: interrupted", file=sys.stderr)
        return 130
    except _user_error_types() as e:
        if getattr(args, "debug", False):
            raise
        from unirl.preflight import PreflightError

        if isinstance(e, PreflightError):  # every problem, one line each
            print(f"unirl: {e}", file=sys.stderr)
        else:
            kind = "config error: " if type(e).__name__ == "ConfigError" else ""
            print(f"unirl: {kind}{_one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    from unirl.loop import Preempted

    if args.command == "train":
        try:
            train(args.env, args.config, args.overrides, args.output_dir, args.dry_run)
        except Preempted as e:  # a signal-stopped run: one line saying where its checkpoint is
            print(f"unirl: {e}", file=sys.stderr)
            return e.exit_code
        return 0
    if args.command == "eval":
        ks = [int(k) for k in args.k.split(",") if k.strip()]
        evaluate(args.env, args.config, args.overrides, args.checkpoint, args.output_dir, args.n, ks)
        return 0
    if args.command == "plot":
        plot(args.runs, args.out, args.metrics)
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
