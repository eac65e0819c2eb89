"""Checkpoints are written whole or not at all, verified before use, and read as data only
(runner/records/checkpoints.py, runner/rank/checkpoint_io.py; docs/reliability.md, "Faults at a
cluster's edges").

The faults are real: the run directory on a small tmpfs (a filesystem other than the system temp
directory's, as a cluster's scratch volume), filled at step 20 by `FillDisk` (tests/helpers/
full_disk.py) as another job on the volume would; bytes overwritten in a checkpoint file; a
checkpoint whose pickle calls os.system. Three runs serve every test of the module: the one the
full disk stops, the same run uninterrupted, and the first resumed from the checkpoint that stood;
and a run of checkpoint directories (sharding stage 3 in 2 processes) the full disk stops.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from runner.command.planning import plan_for
from runner.core.plan import format_plan
from runner.records import checkpoints
from runner.records.run_dir import write_yaml
from tests.helpers.full_disk import BALLAST, small_filesystem
from tests.helpers.resume import assert_same_end

STEPS, EVERY, FULL_AT = 30, 10, 20
# Quickstart's model and data, a checkpoint every 10 steps, the two newest kept (by step), every
# rank's final state saved (tests/helpers/probe.py) to compare a resume bit for bit.
RUN = ("experiment=quickstart", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1",
       "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
       f"+callbacks.model_checkpoint.every_n_train_steps={EVERY}", "+callbacks.model_checkpoint.save_top_k=2",
       "+callbacks.model_checkpoint.monitor=step", "+callbacks.model_checkpoint.mode=max",
       "+callbacks.final._target_=tests.helpers.probe.FinalState")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, lightfleet_in):
    """(where, the full disk's run, the uninterrupted run, the resumed run): completed processes."""
    where = tmp_path_factory.mktemp("checkpoints")
    with small_filesystem(where / "scratch", "4m") as scratch:
        stopped = lightfleet_in(where, *RUN, f"paths.output_dir={scratch / 'run'}",
                                "+callbacks.fill._target_=tests.helpers.full_disk.FillDisk",
                                f"+callbacks.fill.volume={scratch}", f"+callbacks.fill.at_step={FULL_AT}",
                                "+callbacks.fill.leave_bytes=100000")
        full = lightfleet_in(where, *RUN, "paths.output_dir=full")
        # The checkpoint that stood, resumed off the full volume (FillDisk finds its file and does nothing).
        resumed = lightfleet_in(where, "resume", str(scratch / "run"), "paths.output_dir=resumed")
        shutil.copytree(scratch / "run", where / "stopped")  # what the tests read, once the volume is gone
        yield where, stopped, full, resumed


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_last_checkpoint_stands(runs):
    where, stopped, _, _ = runs
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    run = where / "scratch" / "run"
    (line,) = stopped.stderr.splitlines()
    assert line.startswith(f"lightfleet: run failed: no space left on device for checkpoint "
                           f"{run}/checkpoints/epoch=0-step={FULL_AT}.ckpt: it needs ")
    assert f"the checkpoint that stands is {run}/checkpoints/last.ckpt (step {EVERY})" in line
    assert "Traceback" not in stopped.stdout + stopped.stderr
    failure = yaml.safe_load((where / "stopped" / "failure.yaml").read_text())
    assert failure["status"] == "failed" and failure["exit_code"] == 1 and "no space left" in failure["error"]
    # Nothing under a checkpoint's name but whole checkpoints, no temporary file left anywhere.
    names = sorted(path.name for path in (where / "stopped").rglob("*") if path.is_file())
    assert not [name for name in names if name.startswith(".") and "tmp" in name], names
    assert sorted(path.name for path in (where / "stopped" / "checkpoints").iterdir()) == [
        f"epoch=0-step={EVERY}.ckpt", f"epoch=0-step={EVERY}.ckpt.manifest.json", "last.ckpt",
        "last.ckpt.manifest.json"]
    for name in (f"epoch=0-step={EVERY}.ckpt", "last.ckpt"):
        saved = where / "stopped" / "checkpoints" / name
        assert checkpoints.verify(saved).problem is None
        assert torch.load(saved, weights_only=True)["global_step"] == EVERY


@pytest.mark.slow
def test_the_run_resumed_from_the_checkpoint_that_stood_ends_bit_for_bit(runs):
    where, _, full, resumed = runs
    assert full.returncode == 0, full.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (where / "resumed" / BALLAST).exists()
    assert_same_end(where / "full", where / "resumed", EVERY)


@pytest.mark.slow
def test_retention_removes_checkpoints_with_their_manifests(runs):
    where, _, full, _ = runs
    assert full.returncode == 0, full.stderr[-3000:]
    assert sorted(path.name for path in (where / "full" / "checkpoints").iterdir()) == sorted(
        name + suffix for name in (f"epoch=0-step={2 * EVERY}.ckpt", f"epoch=0-step={STEPS}.ckpt", "last.ckpt")
        for suffix in ("", checkpoints.MANIFEST_SUFFIX))


def damaged_copy(where: Path, name: str) -> Path:
    """A copy of the uninterrupted run with `name` damaged: 4 KB overwritten in its middle, its size unchanged."""
    copy = where / f"damaged-{name}"
    shutil.copytree(where / "full", copy)
    checkpoint = copy / "checkpoints" / name
    size = checkpoint.stat().st_size
    with open(checkpoint, "r+b") as file:
        file.seek(size // 2)
        file.write(os.urandom(4096))
    assert checkpoint.stat().st_size == size
    return copy


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_naming_the_newest_intact_one(runs, lightfleet_in):
    where = runs[0]
    copy = damaged_copy(where, "last.ckpt")
    intact = copy / "checkpoints" / f"epoch=0-step={STEPS}.ckpt"
    # Unrefused, the resume would train on from the damaged weights (the issue: to NaN or, elsewhere, silently).
    for command, longer in (("resume", [f"trainer.max_steps={STEPS + 10}"]), ("eval", [])):
        refused = lightfleet_in(where, command, str(copy), *longer)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr.splitlines() == [
            f"lightfleet: error: ckpt_path='{copy}/checkpoints/last.ckpt': is damaged: its bytes differ from those "
            f"its manifest's sha256 was taken of; the newest intact checkpoint of the run is {intact} (step {STEPS}): "
            f"lightfleet {command} {copy} \"ckpt_path='{intact}'\""]


@pytest.mark.slow
def test_a_truncated_checkpoint_is_refused_naming_the_newest_intact_one(runs, lightfleet_in):
    where = runs[0]
    copy = where / "truncated"
    shutil.copytree(where / "full", copy)
    checkpoint = copy / "checkpoints" / f"epoch=0-step={STEPS}.ckpt"
    size = checkpoint.stat().st_size
    os.truncate(checkpoint, 86016)  # as the issue found last.ckpt after a full disk
    refused = lightfleet_in(where, "resume", str(copy), f"ckpt_path='{checkpoint}'")
    assert refused.returncode == 2
    intact = copy / "checkpoints" / "last.ckpt"
    assert refused.stderr.splitlines() == [
        f"lightfleet: error: ckpt_path='{checkpoint}': is truncated: 86,016 bytes of the {size:,} its manifest says; "
        f"the newest intact checkpoint of the run is {intact} (step {STEPS}): "
        f"lightfleet resume {copy} \"ckpt_path='{intact}'\""]
    # Without its manifest (a file lightfleet did not write) the truncated file is still refused, naming the same one.
    checkpoints.manifest_path(checkpoint).unlink()
    refused = lightfleet_in(where, "resume", str(copy), f"ckpt_path='{checkpoint}'")
    (line,) = refused.stderr.splitlines()
    assert "is not a checkpoint lightfleet can read" in line and line.endswith(f"\"ckpt_path='{intact}'\"")


@pytest.mark.slow
def test_a_checkpoint_without_manifest_loads_with_a_note_and_leftovers_are_removed(runs, lightfleet_in):
    where = runs[0]
    copy = where / "unverified"
    shutil.copytree(where / "full", copy)
    checkpoint = copy / "checkpoints" / "last.ckpt"
    checkpoints.manifest_path(checkpoint).unlink()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = copy / "checkpoints" / f".last.ckpt~{os.uname().nodename}~{gone.stdout.strip()}.lightfleet-tmp"
    leftover.write_bytes(b"half a checkpoint")  # what a write killed mid-way leaves
    planned = lightfleet_in(where, "resume", str(copy), f"trainer.max_steps={STEPS + 10}", "dry_run=true")
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert (f"note: {checkpoint} has no manifest (last.ckpt.manifest.json): not written by lightfleet, its bytes "
            f"are not verified") in planned.stdout.splitlines()
    assert not leftover.exists()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, lightfleet_in):
    """(where, completed process) of a 2-process sharding stage 3 run (checkpoint directories, every
    rank writing its shard) stopped by the full disk at step 20."""
    where = tmp_path_factory.mktemp("sharded")
    with small_filesystem(where / "scratch", "4m") as scratch:
        stopped = lightfleet_in(where, *RUN, "strategy=[sharding]", "strategy.sharding.stage=3", "trainer.devices=2",
                                f"paths.output_dir={scratch / 'run'}",
                                "+callbacks.fill._target_=tests.helpers.full_disk.FillDisk",
                                f"+callbacks.fill.volume={scratch}", f"+callbacks.fill.at_step={FULL_AT}",
                                "+callbacks.fill.leave_bytes=100000")
        shutil.copytree(scratch / "run", where / "stopped")
        yield where, stopped


@pytest.mark.slow
def test_a_full_disk_leaves_sharded_checkpoint_directories_whole_and_a_damaged_shard_is_refused(sharded, lightfleet_in):
    where, stopped = sharded
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    run, copy = where / "scratch" / "run", where / "stopped"
    assert "Traceback" not in stopped.stderr
    last_line = stopped.stderr.splitlines()[-1]
    assert last_line.startswith(f"lightfleet: run failed: rank 0: no space left on device for checkpoint "
                                f"{run}/checkpoints/epoch=1-step={FULL_AT}.ckpt")
    assert f"the checkpoint that stands is {run}/checkpoints/last.ckpt (step {EVERY})" in last_line
    # Two whole directories with their manifests; nothing half written under a checkpoint's name, no temporary one.
    assert sorted(path.name for path in (copy / "checkpoints").iterdir()) == [
        f"epoch=0-step={EVERY}.ckpt", f"epoch=0-step={EVERY}.ckpt.manifest.json", "last.ckpt",
        "last.ckpt.manifest.json"]
    last = copy / "checkpoints" / "last.ckpt"
    assert checkpoints.verify(last).problem is None
    assert sorted(checkpoints.read_manifest(last)["files"]) == sorted(path.name for path in last.iterdir())
    with open(last / "__1_0.distcp", "r+b") as shard:  # 4 KB overwritten in rank 1's shard, its size unchanged
        shard.seek(1024)
        shard.write(os.urandom(4096))
    refused = lightfleet_in(where, "resume", str(copy))
    intact = copy / "checkpoints" / f"epoch=0-step={EVERY}.ckpt"
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"lightfleet: error: ckpt_path='{last}': is damaged: the bytes of its file __1_0.distcp differ from those its "
        f"manifest's sha256 was taken of; the newest intact checkpoint of the run is {intact} (step {EVERY}): "
        f"lightfleet resume {copy} \"ckpt_path='{intact}'\""]


def test_every_plan_claims_lightfleets_checkpoint_writer_shown_in_full_not_on_the_console(spec_for):
    for strategies in (["strategy=[]"], ["strategy=[sharding]", "strategy.sharding.stage=3"]):
        plan = plan_for(spec_for("trainer.devices=2", *strategies))
        assert (plan.checkpoint_io.by, plan.checkpoint_io.component.target) == (
            "lightfleet", "runner.rank.checkpoint_io:AtomicCheckpointIO")
        assert "checkpoint io: runner.rank.checkpoint_io:AtomicCheckpointIO()  <- lightfleet" in format_plan(plan)
        assert "checkpoint io" not in format_plan(plan, everything=False)
        assert "lightning strategy: " in format_plan(plan, everything=False)


def test_a_crafted_checkpoint_never_runs_its_pickle(lightfleet, tmp_path):
    marker = tmp_path / "marker"
    # A pickle that calls os.system when unpickled, beside a real-looking checkpoint's keys.
    crafted = subprocess.run([sys.executable, "-c", f"""if True:
        import os, torch
        class Payload:
            def __reduce__(self):
                return (os.system, ("touch {marker}",))
        torch.save({{"state_dict": {{}}, "global_step": 3, "payload": Payload()}}, "evil.ckpt")"""],
                             cwd=tmp_path, capture_output=True, text=True)
    assert crafted.returncode == 0, crafted.stderr
    refused = lightfleet("experiment=quickstart", "ckpt_path=evil.ckpt", "dry_run=true")
    assert not marker.exists()
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"lightfleet: error: ckpt_path='{tmp_path / 'evil.ckpt'}': needs more than data to load (posix.system): "
        f"lightfleet loads checkpoints weights-only (torch.load(weights_only=True)), so a checkpoint's pickle never "
        f"runs code"]


def test_a_record_that_does_not_fit_leaves_no_temporary_file(tmp_path):
    with small_filesystem(tmp_path / "small", "64k") as small:
        (small / "ballast").write_bytes(b"\0" * (shutil.disk_usage(small).free))
        with pytest.raises(OSError):
            write_yaml(small / "failure.yaml", {"error": "x" * 10000})
        assert sorted(path.name for path in small.iterdir()) == ["ballast"]
