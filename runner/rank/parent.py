"""A rank's tie to the lightfleet command that started it, from the rank's first line: a rank
never outlives its command by more than ORPHAN_GRACE_S, whatever it is doing when the command dies
(importing torch, building the model, training). Pure: it runs before torch is imported.

The command (runner/command/launch.py) names itself in COMMAND_PID for the ranks it starts; a rank
started by torchrun or SLURM has no such tie (their launcher stops it).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

COMMAND_PID = "LIGHTFLEET_RANK_OF"  # set by the command for its ranks: its process id
PREEMPTED = 143  # the exit status of a run stopped by SIGTERM or SIGUSR1: 128 + SIGTERM, as a scheduler expects
INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C: 128 + SIGINT, as a shell expects
STOPPED = (PREEMPTED, INTERRUPTED)
DIVERGED_EXIT = 3  # the exit status of a run stopped by a non-finite loss or parameter (runner/rank/divergence.py)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # what stops a run: a preemption, SLURM's warning, Ctrl-C
ORPHAN_GRACE_S = 20.0  # after the command's death, the time a rank has to checkpoint before it leaves
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextmanager
def handling_stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """`handler` for every signal that stops a run (SIGNALS), the handlers before restored after."""
    before = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, previous in before.items():
            signal.signal(signum, previous)


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by signal `signum`."""
    return INTERRUPTED if signum == signal.SIGINT else PREEMPTED


def tie_to_command() -> None:
    """In a rank started by the command: take the command's death as SIGTERM (the kernel's
    parent-death signal on Linux, else a watch that sends it), leave at once if the command is
    already gone, and leave ORPHAN_GRACE_S after its death whatever happens. Until training starts
    SIGTERM and SIGINT end the rank at once (runner/rank/preemption.py then takes them over)."""
    command = os.environ.get(COMMAND_PID)
    if command is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no KeyboardInterrupt traceback while starting
    by_kernel = _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(command):  # it died before the signal was set
        _leave("the command that started this rank is gone")
    threading.Thread(target=_watch, args=(int(command), not by_kernel), name="lightfleet-command-watch",
                     daemon=True).start()


def _set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel for `signum` when this process's parent dies (Linux only); whether it will."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(command: int, send_sigterm: bool) -> None:
    while os.getppid() == command:  # re-parented once the command dies
        time.sleep(0.5)
    if send_sigterm:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    _leave("the command is gone and the run did not stop in time")


def _leave(why: str) -> None:
    print(f"lightfleet: {why}; leaving", file=sys.stderr, flush=True)
    os._exit(PREEMPTED)


def start_clean() -> None:
    """In a rank forked from the command: without what the command set up for itself, as a rank
    started fresh is (runner/rank/train.py forked_rank): the signal handlers of its own and of the
    elastic agent go back to the defaults (training installs its own: runner/rank/preemption.py),
    the console streams to the process's own (not the command's bar), and the root logger to no
    handlers (the rank adds its own: runner/rank/train.py log_to_job_log). And a session of its own,
    as the agent gives a rank it starts fresh: a terminal's Ctrl-C reaches the command alone, which
    passes it on once (twice would mean "stop now": runner/rank/preemption.py)."""
    os.setsid()
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    root = logging.getLogger()
    root.handlers.clear()  # not closed: their files are the command's, open in the command still
    root.filters.clear()
    root.setLevel(logging.WARNING)
