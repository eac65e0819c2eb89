"""Preemption and orphans through the real command: SIGTERM or SIGUSR1 to the command makes every
rank finish its step, save checkpoints/last.ckpt at that step and exit 143 with one line saying
how to resume, and `lightfleet resume` finishes the run bit for bit as if it had never stopped; a
killed command leaves no rank behind. A stopped sweep: tests/test_sweep_stops.py."""
from __future__ import annotations

import signal
import time

import pytest
import torch
import yaml

from runner.rank.parent import PREEMPTED
from runner.records import checkpoints
from tests.helpers.preemption import CHECKPOINTING, REACHED, RUN, rank_pids, start, wait_for, wait_gone
from tests.helpers.resume import assert_same_end

pytestmark = pytest.mark.slow  # every test here trains in processes of its own


@pytest.mark.parametrize("ranks, signum", [(1, signal.SIGTERM), (2, signal.SIGTERM), (2, signal.SIGUSR1)],
                         ids=["one_process_sigterm", "two_processes_sigterm", "two_processes_sigusr1"])
def test_a_signal_checkpoints_the_step_and_resume_finishes(lightfleet, tmp_path, ranks, signum):
    process = start(tmp_path, f"trainer.devices={ranks}", "paths.output_dir=run")
    wait_for(tmp_path / "run" / REACHED, process)
    signalled = time.monotonic()
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    took = time.monotonic() - signalled
    assert process.returncode == PREEMPTED, err
    assert took < 30
    run = tmp_path / "run"
    lines = err.strip().splitlines()
    assert lines[-1].startswith("lightfleet: preempted by ") and "Traceback" not in err, err
    assert lines[-1].endswith(f"continue with: lightfleet resume {run}")
    step = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]
    assert 3 <= step < 40
    assert lines[-1].startswith(f"lightfleet: preempted by SIGTERM at step {step};" if ranks == 1 else
                                "lightfleet: preempted by SIGTERM;")  # SIGUSR1 reaches the ranks as SIGTERM
    assert not (run / "results.yaml").exists()
    assert yaml.safe_load((run / "failure.yaml").read_text())["status"] == "preempted"

    resumed = lightfleet("resume", "run", "paths.output_dir=resumed", "trainer.enable_progress_bar=false")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert yaml.safe_load((tmp_path / "resumed" / "results.yaml").read_text())["global_step"] == 40
    uninterrupted = lightfleet(*RUN, f"trainer.devices={ranks}", "paths.output_dir=full")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert_same_end(tmp_path / "full", tmp_path / "resumed", step)


def test_a_signal_while_a_checkpoint_is_written_in_the_background_exits_with_its_own_on_the_disk(tmp_path):
    """Checkpoints are written in the background (runner/rank/checkpoint_io.py): a rank that a
    signal stops while the disk still takes a checkpoint (128 MB heavier here) saves its own and
    leaves only once both are whole on the disk. A forked rank leaves without interpreter exit
    (os._exit), which would end the writer thread wherever it is."""
    process = start(tmp_path, "trainer.devices=2", "paths.output_dir=run",
                    "+callbacks.model_checkpoint.every_n_train_steps=5",
                    "+callbacks.heavy._target_=tests.helpers.preemption.HeavyCheckpoints", "+callbacks.heavy.megabytes=128")
    wait_for(tmp_path / "run" / CHECKPOINTING, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == PREEMPTED, err
    saved = tmp_path / "run" / "checkpoints"
    last = torch.load(saved / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert last > 5  # the preemption's, written after step 5's
    for path in saved.glob("*.ckpt"):
        verdict = checkpoints.verify(path)
        assert verdict.problem is None and verdict.manifest is not None, (path.name, verdict)
        assert verdict.manifest["step"] == (last if path.name == "last.ckpt" else int(path.stem.rsplit("=", 1)[1]))
    assert "epoch=0-step=5.ckpt" in {path.name for path in saved.iterdir()}
    assert not [path.name for path in saved.iterdir() if path.name.startswith(".")]


def test_a_killed_command_leaves_no_rank_behind(tmp_path):
    process = start(tmp_path, "trainer.devices=2", "trainer.max_steps=400", "paths.output_dir=run")
    wait_for(tmp_path / "run" / REACHED, process)
    ranks = rank_pids(process.pid)
    assert len(ranks) == 2
    process.kill()
    process.communicate(timeout=30)
    wait_gone(ranks, within=30)
