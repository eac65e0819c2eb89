"""What a run shows and what it keeps, through the real command: the console holds lightfleet's
lines, the progress bar and the summary; the libraries' warnings and Lightning's setup lines go to
the job's log file (lightfleet.log) in every kind of run, and onto the console with
hydra.verbose=true; the progress bar counts steps when max_steps bounds the run. The runs'
checkpoints (distributed-checkpoint directories) then serve `ckpt_path`'s checks."""
from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from runner.rank.progress import ProgressRelay
from plugins.ranks import Rule, own
from runner.command import preflight
from runner.command.console import AboveTheBar, InPlaceBar, library_warnings_to_log
from runner.config.compose import CONFIG_NAME
from runner.rank.train import NotFromLibraries
from runner.records.run_dir import checkpoint_contents
from tests.helpers.commands import command_env

QUIET = re.compile(r"warn", re.IGNORECASE)


def console(done) -> str:
    return done.stdout + done.stderr


def job_log(run: Path) -> str:
    return (run / "lightfleet.log").read_text()


def preflight_of(*overrides: str) -> preflight.Flight:
    """The command's job stages on these overrides, in this process (the model built on the meta device)."""
    return preflight.check_job(preflight.compose(list(overrides), None, CONFIG_NAME))


def timed(lightfleet_fresh, *overrides: str):
    """The command's result, with the seconds it took as `seconds`."""
    started = time.monotonic()
    done = lightfleet_fresh(*overrides)
    done.seconds = time.monotonic() - started
    return done


def bar_lines(done) -> list:
    """The progress bar's lines in a `timed` command's output, a pipe as a log file's or a SLURM
    job's: each a line of its own, at most one every 30 seconds and the last at the end, without
    carriage returns, cursor codes or a negative rate."""
    shown = console(done)
    assert "\r" not in shown and "\x1b[" not in shown and not re.search(r"-[0-9.]+it/s", shown), shown[-2000:]
    bars = [line for line in shown.splitlines() if "step:" in line or "it/s" in line]
    assert 1 <= len(bars) <= 1 + done.seconds // 30, bars
    return bars


# torchdata's, as each rank's loader starts. (torch.distributed.checkpoint's "Detected an existing
# checkpoint" no longer comes: each checkpoint directory is written fresh, plugins/directory_checkpoint.py.)
WARNED = "'set_vital' is deprecated"


@pytest.mark.slow
@pytest.mark.parametrize("command", [["strategy=[sharding]", "strategy.sharding.stage=3", "trainer.devices=2"],
                                     ["experiment=gpt_pipeline_1f1b"]], ids=["sharding", "pipeline"])
def test_a_multi_process_runs_console_holds_only_lightfleets_lines(lightfleet_fresh, tmp_path, monkeypatch, command):
    done = timed(lightfleet_fresh, *command, "trainer.max_steps=3", "paths.output_dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not QUIET.search(console(done)), console(done)
    # One bar, rank 0's, drawn by the command: not a line per refresh behind "[rank0]:"
    bars = bar_lines(done)
    assert bars[-1].startswith("Epoch 0, step: 100%") and "3/3" in bars[-1] and "v_num" not in bars[-1], bars
    log = job_log(tmp_path / "run")
    assert WARNED in log and "[rank 0][py.warnings][WARNING]" in log and "[rank 1]" in log
    # The run's checkpoint, a distributed-checkpoint directory, read as the preflight reads it.
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir() and checkpoint_contents(checkpoint).step == 3
    monkeypatch.chdir(tmp_path)
    resumed = preflight_of(*command, f"ckpt_path={checkpoint}")  # its weights fit the model: no refusal
    assert set(checkpoint_contents(checkpoint).weights) == set(resumed.model.state_dict())
    loud = lightfleet_fresh(*command, "trainer.max_steps=3", "paths.output_dir=loud", "hydra.verbose=true")
    assert loud.returncode == 0 and WARNED in console(loud)


@pytest.mark.slow
def test_a_single_process_run_keeps_its_log_and_counts_steps_on_the_progress_bar(lightfleet_fresh, tmp_path):
    """40 steps of 32-batch epochs: the bar goes on counting the run's steps in the second epoch.
    Its output is a pipe, as a log file's or a SLURM job's: the bar is a line of its own, printed
    at most every 30 seconds and at the end, without carriage returns or cursor codes."""
    done = timed(lightfleet_fresh, "experiment=quickstart", "trainer.max_steps=40", "paths.output_dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not QUIET.search(console(done)) and "GPU available" not in console(done)
    assert re.search(r"Epoch 1, step: 100%\|[^|]*\| 40/40", bar_lines(done)[-1]), done.stdout[-2000:]
    log = job_log(tmp_path / "run")
    assert "GPU available" in log and "[py.warnings][WARNING]" in log  # Lightning's lines and the warnings
    assert "lightfleet: run directory" in log and "lightfleet: done: 40 steps" in log  # and the job's own
    assert "][INFO] -" not in console(done)  # the console's lines as they are, without the log's prefix
    rich = lightfleet_fresh("experiment=quickstart", "trainer.max_steps=40", "callbacks=rich_progress_bar",
                      "paths.output_dir=rich")
    assert rich.returncode == 0, rich.stderr[-3000:]
    assert "Epoch 1, step" in rich.stdout and "40/40" in rich.stdout and "/-2" not in rich.stdout, rich.stdout[-2000:]
    loud = lightfleet_fresh("experiment=quickstart", "trainer.max_steps=40", "paths.output_dir=loud", "hydra.verbose=true")
    assert loud.returncode == 0 and "Warning" in console(loud) and "GPU available" in console(loud)


@pytest.mark.slow
def test_the_steps_bar_redraws_when_its_line_is_due_not_at_every_step(lightfleet_fresh, tmp_path):
    """Issue 43: Lightning's bar redrew (formatted and wrote its line) at every batch, 27% of a 6 ms
    step. 300 steps of the quickstart: with the output a pipe, the bar's line is drawn once at most
    every 30 s and at the end; on a terminal (a pseudo-terminal) at most every 0.2 s: bounded by
    time, not by steps."""
    probe = ["experiment=quickstart", "trainer.max_steps=300", "+callbacks.redraws._target_=tests.helpers.probe.BarRedraws"]
    piped = lightfleet_fresh(*probe, "paths.output_dir=piped")
    assert piped.returncode == 0, piped.stderr[-3000:]
    figures = json.loads((tmp_path / "piped" / "bar_redraws.json").read_text())
    assert figures["steps"] == 300 and 1 <= figures["redraws"] <= 2 + figures["seconds"] // 30, figures
    primary, secondary = pty.openpty()
    on_terminal = subprocess.Popen([sys.executable, "-m", "runner", *probe, "paths.output_dir=terminal"], cwd=tmp_path,
                                   env=command_env(), stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    # Read while it runs: a pseudo-terminal holds a few KB, and a command writing more blocks until read.
    chunks: list = []
    reader = threading.Thread(target=read_all, args=(primary, chunks))
    reader.start()
    assert on_terminal.wait(timeout=600) == 0, b"".join(chunks)[-3000:]
    reader.join(timeout=60)
    drawn = b"".join(chunks).decode(errors="replace")
    figures = json.loads((tmp_path / "terminal" / "bar_redraws.json").read_text())
    assert figures["steps"] == 300 and 2 <= figures["redraws"] <= 3 + figures["seconds"] / 0.2, figures
    assert "\r" in drawn and "300/300" in drawn  # drawn in place, to the last step


def read_all(descriptor: int, chunks: list) -> None:
    """What a pseudo-terminal's other end writes, into `chunks`, until it closes."""
    while True:
        try:
            chunk = os.read(descriptor, 1 << 16)
        except OSError:  # EIO: the writer's end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(descriptor)


def test_the_console_keeps_lightfleets_and_the_users_warnings_and_leaves_the_libraries_to_the_log():
    shown = []
    console = logging.Handler()
    console.emit = lambda record: shown.append(record.getMessage())
    console.addFilter(NotFromLibraries())
    captured = [logging.getLogger("py.warnings"), logging.getLogger("plugins.ranks")]
    for logger in captured:
        logger.addHandler(console)
    captured[1].setLevel(logging.INFO)  # as a rank's root logger is (runner/rank/train.py)
    try:
        with warnings.catch_warnings():  # restores Python's own warning output afterwards
            warnings.simplefilter("always")
            logging.captureWarnings(True)
            own([0, 1], "random generators", Rule("each rank's are re-derived", lambda ranks, rank: 0))  # lightfleet's
            warnings.warn("the user's own")  # this file: the user's code
            warnings.warn_explicit("a library's", UserWarning, torch.__file__, 1)
    finally:
        logging.captureWarnings(False)
        captured[1].setLevel(logging.NOTSET)
        for logger in captured:
            logger.removeHandler(console)
    console.handle(logging.LogRecord("torch.distributed", logging.WARNING, torch.__file__, 1, "a library's", None, None))
    console.handle(logging.LogRecord("runner.command", logging.ERROR, preflight.__file__, 1, "lightfleet's", None, None))
    assert [line.splitlines()[0].split(": ", 2)[-1] for line in shown] == [
        "each rank's are re-derived",
        "the user's own", "lightfleet's"]


def test_the_commands_own_work_leaves_the_libraries_warnings_to_the_log_file(tmp_path, recwarn):
    """strategy=[auto]'s facts in the command process (torchdata's "'set_vital' is deprecated" as
    the first batch is drawn): a library's warning into the job's log file only, the user's shown
    as Python shows warnings (here: recorded by `recwarn`); with verbose, both shown."""
    job_log_file = logging.FileHandler(tmp_path / "lightfleet.log")
    logging.getLogger().addHandler(job_log_file)
    try:
        for verbose in (False, True):
            with library_warnings_to_log(verbose):
                warnings.warn_explicit(f"a library's (verbose={verbose})", UserWarning, torch.__file__, 1)
                warnings.warn(f"the user's own (verbose={verbose})")
    finally:
        logging.getLogger().removeHandler(job_log_file)
        job_log_file.close()
    assert [str(said.message) for said in recwarn] == ["the user's own (verbose=False)", "a library's (verbose=True)",
                                                       "the user's own (verbose=True)"]
    assert "a library's (verbose=False)" in job_log(tmp_path) and "the user's own" not in job_log(tmp_path)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_relayed_bar_is_one_line_redrawn_below_what_else_is_written(tmp_path):
    relay = ProgressRelay(tmp_path / "logs" / "progress.line")
    relay.write("\rEpoch 0, step:  50%|#    | 1/2 [00:00]\x1b[A")  # as tqdm draws, with a cursor move
    relay.write("\r" + " " * 20 + "\r")  # a bar cleared as it closes keeps its line
    assert (tmp_path / "logs" / "progress.line").read_text() == "Epoch 0, step:  50%|#    | 1/2 [00:00]"
    screen = Terminal()
    bar = InPlaceBar(screen)
    bar.show("step 1/2")
    AboveTheBar(screen, bar).write("[rank0]:lightfleet: a line\n")
    bar.show("step 2/2")
    bar.finish("step 2/2")
    assert screen.getvalue() == ("\rstep 1/2\x1b[K" "\r\x1b[K[rank0]:lightfleet: a line\n\rstep 1/2\x1b[K"
                                 "\rstep 2/2\x1b[K" "\r\x1b[Kstep 2/2\n")
