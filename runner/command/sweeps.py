"""A sweep that a signal stops, and continues later: what the command and its jobs share.

A signal to the command (SIGTERM, SIGUSR1, Ctrl-C) stops the whole sweep, in every launcher. The
first to see it (the command, or a job it runs in its own process under the basic launcher) marks
the sweep directory (SWEEP_STOPPED): a job that starts after that does not run. Jobs a launcher runs
in processes of their own (joblib's loky workers, submitit's job processes) are not reached by a
signal to the command (the workers are re-parented to init when it dies), so each such process
registers as its job starts, the command passes the signal on to them and waits for its launcher:
each running job saves its checkpoint and ends as a preempted run does, and the command leaves only
after that. Between jobs a worker takes such a signal as nothing: were it to die, loky would kill
the other workers, mid-checkpoint.

sweep.yaml lists every job the sweeper planned with how it ended, the never started ones too, and
the command line, from which `lightfleet resume SWEEP_DIR` (runner/command/cli.py) continues it.
"""
from __future__ import annotations

import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

from runner.rank.parent import SIGNALS, handling_stop_signals
from runner.records.files import ATTEMPTS_DIR, SWEEP_STOPPED, WORKERS_DIR

SWEEP_COMMAND = "LIGHTFLEET_SWEEP_COMMAND"  # set by a sweep's command for its jobs: its process id


def in_command() -> bool:
    """Whether this job runs in the sweep's command process (the basic launcher), not a worker's."""
    return os.environ.get(SWEEP_COMMAND) == str(os.getpid())


def mark_stopped(sweep_dir: Path, signum: int) -> None:
    """Say in the sweep directory that `signum` stopped the sweep (the first signal's name stays)."""
    if stopped_by(sweep_dir) is None:
        (sweep_dir / SWEEP_STOPPED).write_text(signal.Signals(signum).name)


def stopped_by(sweep_dir: Path) -> Optional[int]:
    """The signal that stopped the sweep in `sweep_dir`, if one did."""
    marker = sweep_dir / SWEEP_STOPPED
    return signal.Signals[marker.read_text().strip()] if marker.is_file() else None


@contextmanager
def passing_signals_on(sweep_dir: Path) -> Iterator[None]:
    """While the launcher runs the sweep: a signal marks the sweep stopped and goes on to the
    launcher's processes that run its jobs (a job under the basic launcher takes it itself). Not to
    the others: a worker still starting would die of it (and loky would kill the rest), and its
    job will not start anyway; loky's resource trackers end with the workers."""

    def pass_on(signum: int, _frame: object) -> None:
        mark_stopped(sweep_dir, signum)
        below = descendants(os.getpid())  # a registered process id that is not below us was reused
        for worker in (sweep_dir / WORKERS_DIR).glob("*"):
            if int(worker.name) in below:
                try:
                    os.kill(int(worker.name), signum)
                except ProcessLookupError:  # ended meanwhile
                    pass

    os.environ[SWEEP_COMMAND] = str(os.getpid())
    try:
        with handling_stop_signals(pass_on):
            yield
    finally:
        del os.environ[SWEEP_COMMAND]


def descendants(root: int) -> Set[int]:
    """Every process below `root`, from /proc (psutil is not required)."""
    parents: Dict[int, List[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # the name in stat's second field may hold spaces and parentheses: split after the last ")"
                parents.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry.name))
            except (OSError, IndexError, ValueError):  # ended while read
                pass
    found, level = set(), [root]
    while level:
        level = [child for parent in level for child in parents.get(parent, [])]
        found.update(level)
    return found


def join_as_worker(sweep_dir: Path) -> None:
    """In a launcher's worker, as its job starts: registered with the command (WORKERS_DIR), which
    passes a signal on to it; a process group of its own, so that a terminal's Ctrl-C reaches its
    job once, through the command (twice would stop it at once, without a checkpoint); and a
    signal while no job runs here changes nothing (the job's own handlers take it while one does)."""
    if in_command():
        return
    for signum in SIGNALS:
        signal.signal(signum, lambda *_: None)
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)
    (sweep_dir / WORKERS_DIR).mkdir(exist_ok=True)
    (sweep_dir / WORKERS_DIR / str(os.getpid())).touch()


def set_aside(sweep_dir: Path, job: Path) -> Path:
    """Move a stopped job's directory out of the way of its next attempt: to attempts/<job>.<k>."""
    name = job.relative_to(sweep_dir).as_posix().replace("/", "_")
    attempts = sweep_dir / ATTEMPTS_DIR
    attempts.mkdir(exist_ok=True)
    k = 1 + sum(1 for old in attempts.iterdir() if old.name.rsplit(".", 1)[0] == name)
    return Path(shutil.move(str(job), str(attempts / f"{name}.{k}")))
