"""What a checkpoint file costs to write whole (runner/rank/checkpoint_io.py, runner/records/checkpoints.py;
issue 43): Lightning's ModelCheckpoint saves the top-k file and last.ckpt at every validation, the
same bytes twice; lightfleet wrote and fsynced both, each with its manifest, 4 fsyncs a file, so a
quickstart checkpoint cost 2.17 ms against Lightning's 1.26. Now the second is a hard link of the
first and a file costs 2 fsyncs (a link 1), on the real filesystem of the test's directory, and
the guard checks the weights once for both; a process killed by SIGKILL mid-save leaves only
checkpoints that verify, and last.ckpt."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.seed import _collect_rng_states, _set_rng_states
from pytorch_lightning.callbacks import ModelCheckpoint

from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier
from runner.rank.checkpoint_io import AtomicCheckpointIO
from runner.rank.parent import SIGNALS
from runner.rank.preemption import Preemption
from runner.rank.resume import restorable, storable
from runner.records import checkpoints
from tests.helpers.commands import PROJECT_ROOT, command_env
from tests.helpers.full_disk import small_filesystem
from tests.helpers.preemption import stop


def checkpoint(step: int, scale: float = 1.0) -> dict:
    """A Lightning-shaped checkpoint of a small model at `step`."""
    torch.manual_seed(step)
    return {"global_step": step, "state_dict": {"w": torch.randn(64, 64) * scale, "b": torch.randn(64)},
            "optimizer_states": [{"state": {0: {"momentum_buffer": torch.randn(64, 64)}}}]}


@pytest.fixture
def fsyncs(monkeypatch):
    """The fsyncs this process makes, counted (each still made: the files reach the disk)."""
    made = []
    real = os.fsync

    def counted(descriptor: int) -> None:
        made.append(descriptor)
        real(descriptor)

    monkeypatch.setattr(os, "fsync", counted)
    return made


def test_last_ckpt_of_the_top_k_files_step_is_its_hard_link_with_two_fsyncs_a_file_and_one_a_link(tmp_path, fsyncs):
    io = AtomicCheckpointIO()
    top_k, last = tmp_path / "epoch=0-step=16.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint(checkpoint(16), top_k)
    io.wait()  # written in the background
    assert len(fsyncs) == 2  # the file's bytes, the directory for both renames (it was 4)
    io.save_checkpoint(checkpoint(16), last)  # ModelCheckpoint's save_last, the same bytes
    io.wait()
    assert len(fsyncs) == 3  # the directory: no bytes written again (it was 8 for both)
    assert last.stat().st_ino == top_k.stat().st_ino
    for path in (top_k, last):
        assert checkpoints.verify(path).problem is None
        assert checkpoints.read_manifest(path)["file"] == path.name
    assert not [path.name for path in tmp_path.iterdir() if "tmp" in path.name]
    # ModelCheckpoint's retention removes the top-k file at the next validation: last.ckpt stays whole.
    io.remove_checkpoint(top_k)
    io.wait()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.manifest.json"]
    assert checkpoints.verify(last).problem is None
    assert torch.equal(torch.load(last, weights_only=True)["state_dict"]["w"], checkpoint(16)["state_dict"]["w"])


def test_other_bytes_of_the_same_step_are_written_and_replace_the_link_not_its_twin(tmp_path, fsyncs):
    io = AtomicCheckpointIO()
    top_k, last = tmp_path / "epoch=0-step=32.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint(checkpoint(32), top_k)
    io.save_checkpoint(checkpoint(32), last)
    io.save_checkpoint(checkpoint(32, scale=2.0), last)  # as fit's end saves last.ckpt again: other loop state
    io.wait()
    assert len(fsyncs) == 2 + 1 + 2
    assert last.stat().st_ino != top_k.stat().st_ino
    assert torch.equal(torch.load(top_k, weights_only=True)["state_dict"]["w"], checkpoint(32)["state_dict"]["w"])
    assert checkpoints.verify(top_k).problem is None and checkpoints.verify(last).problem is None
    # The same bytes at another step are never linked: each step's file is its own.
    io.save_checkpoint(checkpoint(48), tmp_path / "epoch=1-step=48.ckpt")
    io.wait()
    assert (tmp_path / "epoch=1-step=48.ckpt").stat().st_nlink == 1
    # The newest step's files, last.ckpt first among the hard links of one step (the one resume reads).
    io.save_checkpoint(checkpoint(48), last)
    io.wait()
    assert list(checkpoints.intact(tmp_path)) == [last, tmp_path / "epoch=1-step=48.ckpt", top_k]


def test_the_guard_checks_the_weights_once_a_step_not_before_each_of_its_two_files(tmp_path):
    preemption = Preemption()
    checked = []
    check = preemption.guard.check
    preemption.guard.check = lambda trainer, module: (checked.append(trainer.global_step), check(trainer, module))
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}  # Preemption takes them during fit
    try:
        pl.Trainer(accelerator="cpu", devices=1, max_steps=6, num_sanity_val_steps=0, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                   callbacks=[preemption, ModelCheckpoint(dirpath=tmp_path, save_last=True)], default_root_dir=tmp_path,
                   ).fit(MLPClassifier(), datamodule=SyntheticClassificationData(num_train=192, num_val=64))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    # Validated at steps 3 and 6 (3 batches of 64 an epoch), each writing two files; fit's end checks once more.
    assert sorted(path.name for path in tmp_path.glob("*.ckpt")) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    assert checked == [3, 6, 6]  # it was [3, 3, 6, 6, 6]


def test_the_training_thread_makes_no_fsync_the_writer_makes_them_in_the_order_asked(tmp_path, monkeypatch):
    """Issue 43: a validation's checkpoint files cost the training step their fsyncs (0.25 ms each
    on a quiet disk, several ms on a busy one), renames and manifests. Now one background thread
    makes them, in the order ModelCheckpoint asked (the top-k file, its last.ckpt link, the removal
    of the file before it), and fit's end waits for them."""
    by_thread = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda descriptor: (by_thread.append(threading.current_thread()), real(descriptor)))
    pl.Trainer(accelerator="cpu", devices=1, max_steps=9, num_sanity_val_steps=0, logger=False,
               enable_progress_bar=False, enable_model_summary=False, plugins=[AtomicCheckpointIO()],
               callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)], default_root_dir=tmp_path,
               ).fit(MLPClassifier(), datamodule=SyntheticClassificationData(num_train=192, num_val=64))
    assert by_thread and threading.main_thread() not in by_thread
    # Validated at steps 3, 6 and 9: the newest top-k file and its last.ckpt, each verified, nothing else.
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        name + suffix for name in ("epoch=2-step=9.ckpt", "last.ckpt") for suffix in ("", checkpoints.MANIFEST_SUFFIX))
    assert (tmp_path / "last.ckpt").stat().st_ino == (tmp_path / "epoch=2-step=9.ckpt").stat().st_ino
    assert checkpoints.verify(tmp_path / "last.ckpt").manifest["step"] == 9


@pytest.mark.slow  # mounts a tmpfs
def test_a_write_the_full_disk_refused_in_the_background_stops_what_was_asked_after_it(tmp_path):
    """A validation asks for its top-k file, its last.ckpt and the removal of the top-k file before
    it; when the disk refuses the first in the background, neither of the others runs (the removal
    would leave last.ckpt alone standing), and the failure is raised once, on the caller's thread,
    at its next call: the one line of a full disk."""
    with small_filesystem(tmp_path / "scratch", "1m") as scratch:
        io = AtomicCheckpointIO()
        io.save_checkpoint(checkpoint(1), scratch / "step=1.ckpt")
        io.save_checkpoint(checkpoint(1), scratch / "last.ckpt")
        io.wait()
        (scratch / "ballast").write_bytes(b"\0" * (shutil.disk_usage(scratch).free - 8192))
        refused = []  # raised at whichever call comes after the write failed, once
        for call in (lambda: io.save_checkpoint(checkpoint(2), scratch / "step=2.ckpt"),
                     lambda: io.save_checkpoint(checkpoint(2), scratch / "last.ckpt"),
                     lambda: io.remove_checkpoint(scratch / "step=1.ckpt"), io.wait):
            try:
                call()
            except checkpoints.CheckpointNotWritten as failure:
                refused.append(str(failure))
        (line,) = refused
        assert line.startswith(f"no space left on device for checkpoint {scratch}/step=2.ckpt: it needs ")
        assert line.endswith(f"the checkpoint that stands is {scratch}/last.ckpt (step 1)")
        io.teardown()  # Lightning's, after the run's one line: it raises nothing more
        assert sorted(path.name for path in scratch.iterdir()) == sorted(
            ["ballast"] + [name + suffix for name in ("last.ckpt", "step=1.ckpt") for suffix in ("", checkpoints.MANIFEST_SUFFIX)])
        for name in ("last.ckpt", "step=1.ckpt"):
            assert checkpoints.verify(scratch / name).problem is None
            assert torch.load(scratch / name, weights_only=True)["global_step"] == 1


def test_pythons_generator_state_is_one_tensor_in_a_checkpoint_and_a_tuple_from_before_restores(tmp_path):
    """RandomStates' record: Python's 625 numbers pickled one by one made each checkpoint ~0.1 ms
    slower to write; now one tensor. Both forms restore the very generator."""
    random.seed(7)
    states = storable(_collect_rng_states(include_cuda=False))
    assert isinstance(states["python"][1], torch.Tensor) and states["python"][1].numel() == 625
    torch.save(states, tmp_path / "states.pt")
    expected = random.random()
    as_before = {**states, "python": (states["python"][0], tuple(states["python"][1].tolist()), states["python"][2])}
    for saved in (torch.load(tmp_path / "states.pt", weights_only=True), as_before):
        random.seed(8)
        _set_rng_states(restorable(saved))
        assert random.random() == expected


# A run's checkpoints as ModelCheckpoint leaves them, as fast as the disk takes them: at each
# validation the step's top-k file, last.ckpt (its hard link), the previous top-k file removed.
SAVING = """
import sys
from pathlib import Path
import torch
from runner.rank.checkpoint_io import AtomicCheckpointIO

directory, io, previous = Path(sys.argv[1]), AtomicCheckpointIO(), None
for step in range(1, 100000):
    state = {"global_step": step, "state_dict": {"w": torch.full((256, 256), float(step))}}
    top_k = directory / f"step={step}.ckpt"
    io.save_checkpoint(state, top_k)
    io.save_checkpoint(state, directory / "last.ckpt")
    if previous is not None:
        io.remove_checkpoint(previous)
    previous = top_k
    if step == 3:
        io.wait()  # the saves so far on the disk: what the test checks from here on
        (directory / "saving").touch()
"""


def checked(directory: Path) -> None:
    """What a process stopped or killed at any moment of its saves leaves: last.ckpt, and every
    checkpoint with a manifest of its own bytes (one without a manifest is read as unverified)."""
    assert torch.load(directory / "last.ckpt", weights_only=True)["global_step"] >= 3
    for path in directory.glob("*.ckpt"):
        verdict = checkpoints.verify(path)
        assert verdict.problem is None, (path.name, verdict)
        step = torch.load(path, weights_only=True)["global_step"]
        assert verdict.manifest is None or verdict.manifest["step"] == step
        assert path.name in ("last.ckpt", f"step={step}.ckpt")


@pytest.mark.slow
def test_a_process_stopped_or_killed_mid_save_leaves_last_ckpt_and_only_checkpoints_that_verify(tmp_path):
    saving = subprocess.Popen([sys.executable, "-c", SAVING, str(tmp_path)], cwd=PROJECT_ROOT, env=command_env(),
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "saving").exists():
        assert saving.poll() is None, saving.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # Stopped (SIGSTOP) at moments spread over its saves (each a few milliseconds), the disk holds
    # what a kill there would leave; then killed for real.
    for pause_s in [0.001 * k for k in range(1, 30, 2)]:
        time.sleep(pause_s)
        stop(saving.pid)
        try:
            checked(tmp_path)
        finally:
            os.kill(saving.pid, signal.SIGCONT)
    time.sleep(0.017)
    os.kill(saving.pid, signal.SIGKILL)
    saving.wait()
    checked(tmp_path)
    # What the kill left half done is a temporary file only, removed by the next run's first save.
    checkpoints.remove_leftovers(tmp_path)
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]
