"""The ``unirl`` command.

    unirl train text --config gsm8k [--recipe dr_grpo] [--output-dir DIR | --new-run] [--dry-run] [key=value ...]
    unirl train diffusion --config sd3_ocr ...
    unirl rewards list
    unirl serve-reward NAME [--host 127.0.0.1] [--port P]
    unirl tools list
    unirl serve-tool search --corpus corpus.jsonl [--port P]
    unirl data list
    unirl data cat unirl://ocr/test.txt
    unirl models prepare smollm2-135m-instruct   (or: unirl models import-gguf FILE --out DIR)
    unirl eval text --config gsm8k --checkpoint runs/text-gsm8k/checkpoints/step_000100 [--n 8]
    unirl plot runs/a runs/b [--out curves.png] [--metrics reward/mean,eval/accuracy]
    unirl config list
    unirl config show text --config tiny [key=value ...]
    unirl --version

Errors a user can cause end with one line and exit 2 (``--debug`` shows the traceback). A run's
console holds its progress bar and unirl's own lines; vLLM's, transformers', torch's and
Accelerate's start-up output goes to ``RUN/run.log`` (``unirl eval``: ``OUT/eval.log``) unless
``--verbose`` (``unirl/logs.py``).

``--config`` takes a name (``configs/<env>/NAME.yaml``, shipped inside the package) or a path to a
YAML file. Before anything loads, ``unirl.preflight`` checks the data files, rewards, batch sizes,
output directory and model name; ``--dry-run`` prints the resolved config and that report and exits
(0 when clean, 2 listing every problem), a real run stops on the same problems.
"""

from __future__ import annotations

import argparse
import sys

from unirl.runner import ENVIRONMENTS
from unirl.runner import import_object as _import


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


def train(env_name: str, config: str, overrides: list[str], output_dir: str | None = None, dry_run: bool = False,
          verbose: bool = False, new_run: bool = False, recipe: str | None = None):
    """``unirl train``: the config file and overrides, then ``unirl.runner.train_config`` (as ``unirl.train``)."""
    from unirl.config import resolve_config_path
    from unirl.recipes import recipe_overrides
    from unirl.runner import new_run_dir, train_config

    config_file = resolve_config_path(env_name, config)
    cfg = _load_file(env_name, config_file, recipe_overrides(recipe) + list(overrides), output_dir)
    if new_run:
        cfg.output_dir = str(new_run_dir(cfg.output_dir))
    return train_config(env_name, cfg, config_file=config_file, label=config, dry_run=dry_run, verbose=verbose)


def evaluate(env_name: str, config: str | None, overrides: list[str], checkpoint: str, output_dir: str | None, n: int,
             ks: list[int], verbose: bool = False, run_config: bool = True) -> None:
    from unirl.api import evaluate as evaluate_checkpoint
    from unirl.evaluation import choose_config, summary_line

    config, which = choose_config(checkpoint, config, run_config)  # the run's own config, unless told
    print(which, file=sys.stderr)
    summary = evaluate_checkpoint(env_name, config, overrides, checkpoint=checkpoint, output_dir=output_dir, n=n,
                                  ks=ks, verbose=verbose, run_config=False)
    print(summary_line(summary))


def plot(runs: list[str], out: str | None, metrics: str | None) -> None:
    from unirl.plot import plot_runs

    names = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else None
    print(f"wrote {plot_runs(runs, out, names)}")


def _add_version(parser: argparse.ArgumentParser) -> None:
    from unirl import __version__

    parser.add_argument("--version", action="version", version=f"unirl {__version__}")


def _config_names() -> str:
    """The shipped config names per environment, for --help: ``text: gsm8k, tiny; diffusion: ...``."""
    from unirl.config import available_configs

    return "; ".join(f"{env}: {', '.join(available_configs(env))}" for env in sorted(ENVIRONMENTS))


def _recipe_names() -> str:
    from unirl.recipes import RECIPES

    return ", ".join(RECIPES)


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors a user causes (a config, a data file, a reward, a model that cannot be found, a missing
    package, a wrong launch): the CLI ends them with one line and exit 2. Anything else is a bug and
    keeps its traceback."""
    from unirl.distributed import LaunchError

    return ValueError, OSError, ImportError, LaunchError


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    library = type(error).__module__.split(".")[0] not in ("unirl", "rewards")
    if len(lines) > 1 and library:
        text += " ..."  # a library's long message: its first line names the problem
    cause = _root_cause(error)
    if library and cause is not None:  # diffusers' "see the root cause in the stacktrace above", without it
        cause_lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        text += f"; caused by {type(cause).__name__}: {cause_lines[0] if cause_lines else ''}".rstrip(": ")
    return text


def _root_cause(error: BaseException) -> BaseException | None:
    """The innermost exception ``error`` was raised from or while handling (None when there is none)."""
    seen, cause = {id(error)}, None
    while (nxt := (error.__cause__ or error.__context__)) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        error = cause = nxt
    return cause


def main(argv: list[str] | None = None) -> int:
    # --verbose / --debug go anywhere on the line: before the subcommand or after it.
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="let vLLM, transformers and diffusers log at INFO")
    flags.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error instead of one line")
    parser = argparse.ArgumentParser(prog="unirl", description="RL post-training for LLMs and diffusion models.",
                                     parents=[flags])
    _add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    from unirl.config_commands import add_subcommands as add_config_subcommands

    add_config_subcommands(sub)  # unirl config list, unirl config show ENV --config NAME
    from unirl.reward_commands import add_subcommands

    add_subcommands(sub)  # unirl rewards list, unirl serve-reward NAME
    from unirl.data_commands import add_subcommands as add_data_subcommands

    add_data_subcommands(sub)  # unirl data list, unirl data cat SOURCE
    from unirl.tool_commands import add_subcommands as add_tool_subcommands

    add_tool_subcommands(sub)  # unirl tools list, unirl serve-tool NAME
    from unirl.model_commands import add_subcommands as add_model_subcommands

    add_model_subcommands(sub)  # unirl models list|prepare NAME|import-gguf FILE --out DIR
    p_train = sub.add_parser("train", help="train a policy", parents=[flags])
    p_train.add_argument("env", choices=sorted(ENVIRONMENTS))
    p_train.add_argument("--config", required=True, help=f"config name ({_config_names()}) or a YAML path")
    p_train.add_argument("--output-dir", default=None, help="run directory (overrides output_dir)")
    p_train.add_argument("--recipe", default=None, help=f"a variant's keys, set before the overrides: {_recipe_names()} "
                                                         f"(unirl config list shows the keys)")
    p_train.add_argument("--new-run", action="store_true",
                         help="a fresh run directory beside output_dir, named with the date and time (OUTPUT_DIR-YYYYmmdd-HHMMSS)")
    p_train.add_argument("--dry-run", action="store_true",
                         help="print the resolved config and the offline checks (data, rewards, batch, output, "
                              "model cache), load nothing; exit 0 when clean, 2 with every problem listed")
    p_train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. trainer.total_steps=10")
    p_eval = sub.add_parser("eval", help="score a checkpoint on the config's held-out prompts", parents=[flags])
    p_eval.add_argument("env", choices=sorted(ENVIRONMENTS))
    p_eval.add_argument("--config", default=None,
                        help=f"config name ({_config_names()}) or a YAML path; default and by preference: the "
                             f"checkpoint's run's saved config.yaml (its test split and rewards)")
    p_eval.add_argument("--no-run-config", action="store_true",
                        help="score a run's checkpoint with --config instead of the run's saved config.yaml")
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
        if bad or args.command not in ("train", "eval", "config"):
            parser.error(f"unrecognized arguments: {' '.join(bad or extra)} (overrides are key=value)")
        args.overrides = list(args.overrides) + extra
    from unirl import logs

    logs.configure(verbose=getattr(args, "verbose", False))
    try:
        return _dispatch(args)
    except KeyboardInterrupt as e:
        print(f"unirl: {e or 'interrupted'}", file=sys.stderr)
        return _leave_now(getattr(e, "exit_code", 130))
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


def _leave_now(code: int) -> int:
    """``code``, or exit at once when a thread is still busy (a reward that hangs in a worker): the
    interpreter would otherwise wait for it at exit, and an interrupt must stop the run."""
    import os
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.current_thread()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _dispatch(args) -> int:
    from unirl.preemption import Preempted

    if args.command == "train":
        import signal

        from unirl.preemption import stop_during_startup

        # SIGTERM before the loop takes over (checks, loading, vLLM start-up) stops with one line, not silently.
        previous = signal.signal(signal.SIGTERM, stop_during_startup)
        try:
            train(args.env, args.config, args.overrides, args.output_dir, args.dry_run,
                  verbose=getattr(args, "verbose", False), new_run=args.new_run, recipe=args.recipe)
        except Preempted as e:  # a signal-stopped run: one line saying where its checkpoint is
            print(f"unirl: {e}", file=sys.stderr)
            return e.exit_code
        finally:
            signal.signal(signal.SIGTERM, previous)
        return 0
    if args.command == "eval":
        ks = [int(k) for k in args.k.split(",") if k.strip()]
        evaluate(args.env, args.config, args.overrides, args.checkpoint, args.output_dir, args.n, ks,
                 verbose=getattr(args, "verbose", False), run_config=not args.no_run_config)
        return 0
    if args.command == "plot":
        plot(args.runs, args.out, args.metrics)
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
