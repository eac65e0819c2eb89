"""The command's console while its ranks train: rank 0's progress bar, which runner/rank/progress.py
relays as its latest line into a file, drawn as one line in place below the ranks' other lines.
On a terminal the line is redrawn as it changes; elsewhere (a pipe, a CI log) it is printed at
most every PLAIN_EVERY_S seconds, and once at the end. And what stays off the console: the job's
log file's own records, and the libraries' warnings in the command's own work (auto's facts)."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator, TextIO

from runner.records.files import PLAIN_EVERY_S

POLL_S = 0.1
# Held by whoever draws the bar or writes above it, and by the command while it forks a rank
# (runner/command/launch.py): a rank forked mid-write would inherit the console's stream locked.
DRAWING = threading.RLock()
os.register_at_fork(before=DRAWING.acquire, after_in_parent=DRAWING.release, after_in_child=DRAWING.release)


class InPlaceBar:
    """One line at the bottom of `stream`; what else is written goes above it (AboveTheBar)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.terminal = stream, stream.isatty()
        self.line, self.shown = "", False
        self.printed, self.printed_at = "", time.monotonic()  # as a line of its own (not in place)
        self.lock = DRAWING

    def show(self, line: str) -> None:
        with self.lock:
            self.line = line
            if self.terminal:
                self.draw()
            else:
                self.print_if_due()

    def print_if_due(self) -> None:
        """Off a terminal: the latest line, if not printed yet, once PLAIN_EVERY_S have passed since
        the last (the ranks' bars relay a line about as often: it is printed as it comes)."""
        if self.line != self.printed and time.monotonic() - self.printed_at >= PLAIN_EVERY_S:
            self.print_line()

    def draw(self) -> None:
        width = shutil.get_terminal_size().columns - 1
        self.stream.write("\r" + self.line[:width] + "\x1b[K")
        self.stream.flush()
        self.shown = True

    def erase(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.shown = False

    def print_line(self) -> None:
        self.stream.write(self.line + "\n")
        self.stream.flush()
        self.printed, self.printed_at = self.line, time.monotonic()

    def finish(self, line: str) -> None:
        """Leave the last line, `line`, on the console, as a bar that ends does."""
        with self.lock:
            self.erase()
            self.line = line or self.line
            if self.line and self.line != self.printed:
                self.print_line()


class AboveTheBar:
    """A text stream that writes above the bar: it lifts the bar, writes, and draws it again."""

    def __init__(self, stream: TextIO, bar: InPlaceBar) -> None:
        self.stream, self.bar = stream, bar

    def write(self, text: str) -> int:
        with self.bar.lock:
            self.bar.erase()
            written = self.stream.write(text)
            self.stream.flush()
            if self.bar.terminal and self.bar.line and text.endswith("\n"):
                self.bar.draw()
        return written

    def __getattr__(self, name: str) -> object:  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self.stream, name)


def follow(path: Path, bar: InPlaceBar, stop: threading.Event) -> None:
    """Show each new line the relay file holds until `stop`."""
    seen = ""
    while not stop.wait(POLL_S):
        try:
            line = path.read_text()
        except FileNotFoundError:
            continue
        if line and line != seen:
            seen = line
            bar.show(line)
        elif not bar.terminal:
            with bar.lock:
                bar.print_if_due()


@contextlib.contextmanager
def progress_in_place(path: Path) -> Iterator[None]:
    """While inside: the relayed bar at `path` drawn on stdout, the process's own writes above it."""
    bar = InPlaceBar(sys.stdout)
    streams = sys.stdout, sys.stderr
    above = {stream: AboveTheBar(stream, bar) for stream in streams}
    sys.stdout, sys.stderr = above[streams[0]], above[streams[1]]  # type: ignore[assignment]
    # The log's console handlers hold the streams they were given (Hydra's job logging): their
    # lines, "lightfleet: interrupted ..." among them, go above the bar too, never glued to it.
    handlers = [handler for handler in dict.fromkeys(console_handlers()) if handler.stream in above]
    for handler in handlers:
        handler.setStream(above[handler.stream])
    stop = threading.Event()
    poller = threading.Thread(target=follow, args=(path, bar, stop), daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join()
        sys.stdout, sys.stderr = streams
        for handler in handlers:
            handler.setStream(handler.stream.stream)
        bar.finish(path.read_text() if path.exists() else "")  # the last state, which the poller may have missed


def console_handlers() -> list:
    """Every stream handler of the root logger and the named loggers."""
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    return [handler for logger in loggers for handler in logger.handlers
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)]


def to_log_files(record: logging.LogRecord) -> None:
    """`record` into the job's log file (lightfleet.log, Hydra's job logging) only, not onto the
    console; nowhere without one (a dry run)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


@contextlib.contextmanager
def library_warnings_to_log(verbose: bool) -> Iterator[None]:
    """While inside, in the command process: Python warnings of the libraries go into the job's log
    file only, as a rank's do (runner/rank/train.py: e.g. torchdata's "'set_vital' is deprecated" as
    a data loader starts); lightfleet's and the user's code's, and with `verbose` all, onto the console too."""
    if verbose:
        yield
        return
    from runner.rank.train import from_libraries

    try:
        with warnings.catch_warnings(record=True) as heard:
            yield
    finally:  # what was heard is said, also when the work failed
        for said in heard:
            if not from_libraries(said.filename):
                warnings.showwarning(said.message, said.category, said.filename, said.lineno, said.file, said.line)
                continue
            text = warnings.formatwarning(said.message, said.category, said.filename, said.lineno, said.line)
            to_log_files(logging.getLogger("py.warnings").makeRecord(
                "py.warnings", logging.WARNING, said.filename, said.lineno, text.rstrip(), (), None))
