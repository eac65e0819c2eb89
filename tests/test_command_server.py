"""The suite's commands are forked from a server that has imported torch and Lightning
(tests/helpers/command_server.py). A forked command must end, print and train as a fresh
`python -m` process does, or the suite would pass what a user's terminal fails."""
from __future__ import annotations

import csv
import re

import pytest

from tests.helpers.command_server import run_fresh, run_module

pytestmark = pytest.mark.slow

# A module run as `python -m ending` in each way an interpreter ends: its exit status, what it
# prints to stderr, a non-daemon thread it waits for, and atexit handlers.
ENDINGS = '''
import atexit, os, sys, threading, time

atexit.register(lambda: print("atexit ran", flush=True))
how = sys.argv[1]
if how == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=True))).start()
elif how == "code":
    sys.exit(3)
elif how == "message":
    sys.exit("a message")
elif how == "error":
    raise ValueError("an error")
elif how == "interrupt":
    raise KeyboardInterrupt
print("main ended", sys.argv[0].endswith("ending.py"), os.environ.get("ENDING_VARIABLE"), sys.path[0] == os.getcwd())
'''


def without_numbers(text: str, *folders) -> str:
    for folder in folders:
        text = text.replace(str(folder), "FOLDER")
    text = re.sub(r"[0-9a-f]{32}_\w+", "ID", text)  # the ranks' log folder: the rendezvous id
    return re.sub(r" *[0-9][0-9.,]*", " N", text)  # and the progress bar's padding


@pytest.mark.parametrize("how", ["thread", "code", "message", "error", "interrupt"])
def test_a_forked_module_ends_as_a_fresh_interpreter_does(how, tmp_path, monkeypatch):
    (tmp_path / "ending.py").write_text(ENDINGS)
    monkeypatch.setenv("ENDING_VARIABLE", "given by the test")
    forked, fresh = (run(module="ending", args=[how], cwd=tmp_path, timeout=60) for run in (run_module, run_fresh))
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    assert without_numbers(forked.stderr, tmp_path) == without_numbers(fresh.stderr, tmp_path)
    assert "atexit ran" in forked.stdout
    if how == "thread":
        assert forked.stdout.splitlines() == ["main ended True given by the test True", "thread finished", "atexit ran"]


def test_a_forked_command_refuses_and_trains_as_a_fresh_one(tmp_path):
    refused = [run(module="runner", args=["strategy=[amp,bogus]"], cwd=tmp_path, timeout=120)
               for run in (run_module, run_fresh)]
    assert refused[0].returncode == refused[1].returncode == 2
    assert (refused[0].stdout, refused[0].stderr) == (refused[1].stdout, refused[1].stderr)

    trained = {}
    for name, run in (("forked", run_module), ("fresh", run_fresh)):
        (tmp_path / name).mkdir()
        done = run(module="runner", args=["experiment=quickstart", "trainer.devices=2", "trainer.max_steps=4",
                                          "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
                                          "paths.output_dir=run"],
                   cwd=tmp_path / name, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        run_dir = tmp_path / name / "run"
        trained[name] = (without_numbers(done.stdout, run_dir), without_numbers(done.stderr, run_dir),
                         sorted(without_numbers(str(path.relative_to(run_dir))) for path in run_dir.rglob("*") if path.is_file()),
                         [row["train_loss"] for row in csv.DictReader((run_dir / "csv" / "metrics.csv").open())
                          if row["train_loss"]])
    assert trained["forked"] == trained["fresh"]
