"""The ``unirl`` command: one module per command group, each adding its subcommands the same way.

``COMMANDS`` lists the groups in the order ``unirl --help`` shows them; each module's
``add_parser(subparsers, common)`` adds its subcommands and sets ``func`` (parsed arguments -> exit
status) on each. The modules import nothing heavy at the top: a command imports what it needs when
it runs, so ``unirl --help``, ``unirl config list``, ``unirl rewards list`` and ``unirl data list``
import no torch, transformers or diffusers (tests/test_cli.py checks it).

Errors a user can cause end with one line and exit 2 (``--debug`` shows the traceback). A run's
console holds its progress bar and unirl's own lines; vLLM's, transformers', torch's and
Accelerate's start-up output goes to ``RUN/run.log`` (``unirl eval``: ``OUT/eval.log``) unless
``--verbose`` (``unirl/logs.py``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from unirl.cli.train import load_run_config

__all__ = ["COMMANDS", "load_run_config", "main"]

#: The command groups, in the order ``unirl --help`` lists them (module ``unirl.cli.<name>``).
COMMANDS = ["train", "eval", "plot", "config", "rewards", "tools", "data", "models", "serve_rollout", "sandbox"]

EXAMPLES = """examples:
  unirl train text --config tiny                       # GRPO on the embedded tiny model, a few minutes on CPU
  unirl train text --config tiny --dry-run             # the resolved config and the offline checks, nothing loaded
  unirl train diffusion --config tiny trainer.total_steps=10
  unirl train text --config gsm8k --recipe dr_grpo     # a variant's keys, then your overrides
  unirl eval text --config tiny --checkpoint runs/text-tiny/checkpoints/step_000100
  unirl plot runs/text-tiny runs/text-tiny-ppo
  unirl config list                                    # the shipped configs and recipes
  unirl config show text --config tiny                 # every key, its value and its default
  unirl rewards list | unirl tools list | unirl data list
  unirl serve-reward gsm8k --port 8000                 # a reward over HTTP (rewards: [http://127.0.0.1:8000])
  unirl serve-rollout tiny --dtype float32             # vLLM in its own process (rollout.engine=server, /v1/chat/completions)

--config takes a shipped name (unirl config list) or a YAML path; key=value overrides win over the file.
Docs: docs/running.md, docs/configs.md, docs/rewards.md."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: the common flags, then each group of ``COMMANDS`` in order."""
    # --verbose / --debug go anywhere on the line: before the subcommand or after it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="let vLLM, transformers and diffusers log at INFO")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error instead of one line")
    parser = argparse.ArgumentParser(prog="unirl", description="RL post-training for LLMs and diffusion models.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[common])
    parser.add_argument("--version", action="version", version=f"unirl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"unirl.cli.{name}").add_parser(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after the options; argparse binds a trailing positional list too
    # early, so collect the leftovers and accept exactly the key=value ones where a command takes them.
    args, extra = parser.parse_known_args(argv)
    if extra:
        bad = [e for e in extra if "=" not in e or e.startswith("-")]
        if bad or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(bad or extra)} (overrides are key=value)")
        args.overrides = list(args.overrides) + extra
    from unirl import logs

    logs.configure(verbose=getattr(args, "verbose", False), libraries=getattr(args, "loads_libraries", True))
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        print(f"unirl: {e or 'interrupted'}", file=sys.stderr)
        return _leave_now(getattr(e, "exit_code", 130))
    except _user_error_types() as e:
        if getattr(args, "debug", False):
            raise
        print(f"unirl: {_error_line(e)}", file=sys.stderr)
        return 2


def _version() -> str:
    from unirl import __version__

    return __version__


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors a user causes (a config, a data file, a reward, a model that cannot be found, a missing
    package, a wrong launch): the CLI ends them with one line and exit 2. Anything else is a bug and
    keeps its traceback."""
    from unirl.trainer.distributed import LaunchError

    return ValueError, OSError, ImportError, LaunchError


def _error_line(error: BaseException) -> str:
    from unirl.preflight import PreflightError

    if isinstance(error, PreflightError):  # every problem, one line each
        return str(error)
    kind = "config error: " if type(error).__name__ == "ConfigError" else ""
    return f"{kind}{_one_line(error)} (--debug shows the traceback)"


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
