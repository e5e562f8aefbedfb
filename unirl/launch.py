"""``python -m unirl.launch``: ``torchrun`` (the same arguments) for unirl runs, whose stop on SIGTERM is one
line and exit status 143 (130 for SIGINT), as a one-process run's is.

    python -m unirl.launch --nproc_per_node 2 -m unirl.cli train text --config tiny trainer.strategy=fsdp2

``torchrun`` forwards a SIGTERM to its processes, which finish their step, save a checkpoint and exit
143 with the line naming it (rank 0's); then ``torchrun`` itself raises its ``SignalException`` and exits
1 with a 30-line traceback, which reads as a crash to a user and as a failure to a scheduler. Here that
ends in one line and the signal's exit status; so does a stop whose processes were signalled directly
(SLURM signals every process of a job step), which ``torchrun`` reports as failed children. Any other
failure is ``torchrun``'s own report, unchanged.

``torchrun`` waits 30 s for its processes to stop after forwarding a signal, then kills them, which can
cut a long step or a large checkpoint short: this launcher waits 600 s unless
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or ``--shutdown-timeout`` says otherwise (a scheduler's own grace
period still applies: SLURM's ``KillWait``, or ``sbatch --signal=TERM@120`` to be told earlier).
"""

from __future__ import annotations

import os
import sys

from unirl.trainer.preemption import SIGNAL_EXIT

#: Seconds the launcher waits for its processes to finish their step and checkpoint after a signal.
SHUTDOWN_TIMEOUT_S = 600


class _Stopped(Exception):
    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.code = code


def main(argv: list[str] | None = None) -> int:
    # torchrun's own notices ("Received 15 death signal, shutting down workers", one per process) at ERROR
    # unless LOGLEVEL says otherwise: its loggers read LOGLEVEL when first imported; the processes it starts
    # get the environment as it was.
    level = os.environ.get("LOGLEVEL")
    os.environ["LOGLEVEL"] = level or "ERROR"
    from torch.distributed.elastic.multiprocessing.errors import record
    import torch.distributed.run  # noqa: F401 - its loggers, made now at this level

    if level is None:
        del os.environ["LOGLEVEL"]
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    try:
        record(_launch)(argv)
    except _Stopped as stopped:
        print(f"unirl: {stopped}", file=sys.stderr, flush=True)
        return stopped.code
    return 0


def _launch(argv: list[str] | None) -> None:
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except SignalException as e:
        raise _Stopped(f"the launcher got {e.sigval.name} and passed it on; its processes stopped after their step "
                       f"(rank 0's line above names the checkpoint)", SIGNAL_EXIT.get(e.sigval, 128 + e.sigval)) from None
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        stopped = {code: sig for sig, code in SIGNAL_EXIT.items()}
        if len(codes) == 1 and next(iter(codes)) in stopped:  # every failed process stopped on a signal, as asked
            code = next(iter(codes))
            raise _Stopped(f"the processes were stopped by {signal.Signals(stopped[code]).name} after their step "
                           f"(rank 0's line above names the checkpoint)", code) from None
        raise


if __name__ == "__main__":
    sys.exit(main())
