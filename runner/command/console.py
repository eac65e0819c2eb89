"""The command's console while its ranks train: rank 0's progress bar, which runner/rank/progress.py
relays as its latest line into a file, drawn as one line in place below the ranks' other lines.
On a terminal the line is redrawn as it changes; elsewhere (a pipe, a CI log) it is printed at
most every PLAIN_EVERY_S seconds, and once at the end."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, TextIO

POLL_S = 0.1
PLAIN_EVERY_S = 30.0
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
            elif time.monotonic() - self.printed_at >= PLAIN_EVERY_S:
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
