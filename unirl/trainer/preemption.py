"""Stopping a run cleanly on SIGTERM / SIGINT (what SLURM, spot instances and Ctrl-C send).

The first signal asks the loop to stop after the current step: it saves a checkpoint, closes the
engines and raises ``Preempted`` (exit status 143 / 130 from the CLI). A second signal of either
kind interrupts at once (``StopNow``), also while the step waits on a reward that hangs. With several processes
every one stops after the same step, and the first process alone prints the lines; ``python -m unirl.launch``
(``unirl/launch.py``) is ``torchrun`` whose own exit is then 143 and one line too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch

#: Exit status of a run stopped by a signal after it saved its checkpoint (128 + the signal's number).
SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}


class Preempted(RuntimeError):
    """The run stopped on SIGTERM/SIGINT after finishing a step and saving a checkpoint."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopNow(KeyboardInterrupt):
    """A second SIGTERM / SIGINT: stop at once, without finishing the step (the exit status is the signal's)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}; the step in progress is lost, "
                         f"the checkpoints written so far are kept")
        self.exit_code = SIGNAL_EXIT.get(signum, 130)


class StartupStopped(KeyboardInterrupt):
    """SIGTERM / SIGINT before the first step (checks, model loading, vLLM start-up): one line and the
    signal's exit status instead of a silent death, and the stack unwinds so what started is cleaned up.
    A ``KeyboardInterrupt``, so library code catching ``Exception`` lets it through."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} during start-up, before any step; nothing was "
                         f"trained or saved by this run")
        self.exit_code = SIGNAL_EXIT.get(signum, 143)


def main_rank() -> bool:
    """Whether this is the run's first process (``RANK`` as ``torchrun`` and ``accelerate launch`` set it; a
    process launched alone is): the one that prints a stop line all processes would print alike."""
    return os.environ.get("RANK", "0") == "0"


def stop_during_startup(signum, frame):
    """A signal handler for start-up: raise ``StartupStopped``."""
    raise StartupStopped(signum)


class StopSignals:
    """Records SIGTERM / SIGINT while installed; the loop asks ``requested`` after each step."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}
        #: While True (start-up: loading models, starting vLLM) a signal stops at once with ``Preempted``:
        #: there is no step to finish, and the default action would die without a word or a clean-up.
        self.starting = False

    def install(self, starting: bool = False) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self.starting = starting

        def handler(signum, frame):
            if self.starting:
                raise StartupStopped(signum)
            if self.signal is not None:
                raise StopNow(signum)  # a second signal (Ctrl-C, or a SIGTERM while a step hangs): stop now
            self.signal = signum
            if main_rank():  # every process got it (a launcher passes it on): one line, not one per process
                print(f"unirl: {signal.Signals(signum).name} received; stopping after this step with a checkpoint "
                      f"(send it again to stop at once)", file=sys.stderr, flush=True)

        self._previous = {sig: signal.signal(sig, handler) for sig in SIGNAL_EXIT}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def requested(self, accelerator) -> bool:
        """Whether any process got a stop signal; every process stops after the same step."""
        flag = torch.tensor([0 if self.signal is None else int(self.signal)], device=accelerator.device)
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(flag, reduction="sum")
        if int(flag) and self.signal is None:
            self.signal = signal.SIGTERM  # another process was signalled
        return bool(int(flag))

    def preempted(self, step: int, checkpoint: Path, run_dir: Path) -> Preempted:
        """The exception that ends a run stopped after ``step`` with its checkpoint written."""
        name = signal.Signals(self.signal).name
        return Preempted(
            f"stopped by {name} after step {step}; checkpoint {checkpoint}; resume with the same command "
            f"plus trainer.resume=true (--output-dir {run_dir})",
            SIGNAL_EXIT.get(self.signal, 143),
        )
