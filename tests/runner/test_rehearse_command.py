"""`lightfleet rehearse` (issue 42, part "command"): its refusals, the rank kinds it picks from a
layout, its verdict against the device's memory, and the whole command's console lines,
rehearsal.yaml and exit status.

Most whole-command tests run the real command with `RANK_MODULE` pointed at STAND_IN, a script
that writes a rank's report (`python -m runner.rank.rehearse`'s) with the figures below, so that
the command's orchestration, console and verdict are checked against figures fixed here;
`test_a_tiny_model_fits_and_does_not_fit_a_tiny_device` runs the real ranks.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import yaml

from runner.config.rehearse import GIB, RankKind, RehearseConfig, heaviest, rank_kinds, to_fit, verdict
from runner.core.errors import ConfigError
from runner.core.world import Layout
from tests.helpers.commands import command_env
from tests.helpers.preemption import wait_for, wait_gone
from tests.helpers.user_code import shadowing_packages

MIB = 2**20
# The stand-in's figures, per rank: 4 MiB parameters, 4 MiB gradients, 8 MiB optimizer states,
# 20 MiB activations, a step's peak of 37 MiB; ZeRO stage 1's heaviest rank is the last one.
STAND_IN = '''
import argparse, json, os, sys
from pathlib import Path
import yaml
parser = argparse.ArgumentParser()
parser.add_argument("run_dir")
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--device-type", choices=("cuda", "cpu"), required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()
plan = yaml.safe_load((Path(args.run_dir) / "plan.yaml").read_text())
config = yaml.safe_load((Path(args.run_dir) / "config.yaml").read_text())
world = plan["world"]["world_size"]
if os.environ.get("STAND_IN_WAITS"):  # a rank the test signals the command during
    Path(args.out).with_suffix(".pid").write_text(str(os.getpid()))
    import time
    time.sleep(120)
if os.environ.get("STAND_IN_FAILS"):  # a traceback whose message runs over two lines, as torch's do
    print("Traceback (most recent call last):\\n[rank0]:   File \\"x.py\\", line 1\\n[rank0]: RuntimeError: The "
          "tensor has no data\\n[rank0]: If you are using Caffe2, call mutable_data()", file=sys.stderr)
    sys.exit(1)
if os.environ.get("STAND_IN_REFUSES"):
    print("lightfleet: error: strategy.sharding.mp_degree=3: does not divide the model's 4 heads", file=sys.stderr)
    sys.exit(2)
MiB = 2**20
stage1 = config["strategy"].get("sharding") and config["strategy"]["sharding"]["stage"] == 1
report = {"rank": args.rank, "world_size": world, "kind": "stand-in",
          "memory": {"parameters": 4 * MiB, "gradients": 4 * MiB, "optimizer_states": 8 * MiB,
                     "activations": 20 * MiB, "temporaries": MiB, "buffers": 0, "step_peak": 37 * MiB,
                     "checkpoint_peak": 16 * MiB, "host": 0},
          "collectives": [{"op": "all_gather", "group_size": world, "nodes": 1, "calls": 4, "bytes": 3 * 10**9},
                          {"op": "reduce_scatter", "group_size": world, "nodes": 1, "calls": 4, "bytes": 10**9}],
          "flops": {"float32": 1e9}, "memory_traffic_bytes": 1e9, "samples_per_step": 8, "tokens_per_step": None,
          "heaviest_rank": world - 1 if stage1 else None, "formula": {}, "seconds": 0.1,
          "asked": {"steps": args.steps, "device_type": args.device_type}}
Path(args.out).write_text(json.dumps(report))
'''
DRIVER = '''
import sys
import runner.command.rehearse as rehearse
rehearse.RANK_MODULE = "stand_in_rank"
from runner.command.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print("imported:", ",".join(m for m in ("torch", "pytorch_lightning") if m in sys.modules))
sys.exit(code)
'''


def stand_in_command(cwd: Path, *args: str, **env: str) -> tuple:
    """The real command line and environment, run from `cwd`, whose ranks are STAND_IN's."""
    (cwd / "stand_in_rank.py").write_text(STAND_IN)
    (cwd / "drive.py").write_text(DRIVER)
    environment = command_env(**env)
    environment["PYTHONPATH"] += os.pathsep + str(cwd)
    return [sys.executable, str(cwd / "drive.py"), "rehearse", *args], environment


def with_stand_in(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The real command, fresh, from `cwd`, whose ranks are STAND_IN's."""
    command, environment = stand_in_command(cwd, *args, **env)
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=300)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightfleet: error: "), lines
    return lines[0]


# --------------------------------------------------------------------------- refusals


@pytest.mark.slow
@pytest.mark.parametrize("overrides, fragment", [
    (["rehearse.device=h1000"], "rehearse.device='h1000': allowed: h100, h200, b200, a100, a100_40gb, l40s, v100, mi300x (conf/devices.yaml), or "
                                "rehearse.device_memory_gb for another (did you mean h100?)"),
    (["rehearse.steps=1"], "rehearse.steps=1: must be >= 2"),
    (["rehearse.device_memory_gb=0"], "rehearse.device_memory_gb=0.0: must be > 0 GiB"),
    (["rehearse.reserve_fragmentation=1.5"], "rehearse.reserve_fragmentation=1.5: must be in [0, 1)"),
    (["trainer.accelerator=cpu"], "rehearse.device_memory_gb: a run with trainer.accelerator=cpu is rehearsed"),
    (["trainer.devices=auto"], "trainer.devices='auto': lightfleet rehearse needs a known process count"),
    (["trainer.accelerator=tpu"], "trainer.accelerator='tpu': a rehearsal is of a run on CUDA devices or CPUs"),
    (["strategy=[sharding,dgc]"], "refused"),
])
def test_a_bad_knob_is_one_line_before_torch_and_nothing_is_written(tmp_path, overrides, fragment):
    done = with_stand_in(tmp_path, *overrides, "paths.output_dir=out")
    if fragment == "refused":  # the table's own line
        assert done.returncode == 2 and done.stderr.startswith("lightfleet: refused: "), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    else:
        assert fragment in one_line(done)
    assert done.stdout.strip() == "imported:", done.stdout  # refused before torch and Lightning
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_sweep_is_refused_and_a_cluster_needs_no_rendezvous_variables(tmp_path):
    assert "lightfleet rehearse='-m': rehearses the one run" in one_line(
        with_stand_in(tmp_path, "-m", "rehearse.steps=2,3", "paths.output_dir=out"))
    assert not (tmp_path / "out").exists()
    # 16 nodes, without MASTER_ADDR or NODE_RANK: a run refuses them, a rehearsal needs none.
    done = with_stand_in(tmp_path, "trainer.devices=8", "trainer.num_nodes=16", "strategy=[sharding]",
                         "strategy.sharding.stage=3", "data.batch_size=2", "dry_run=true", "paths.output_dir=out")
    assert done.returncode == 0, done.stderr
    assert "lightfleet rehearse would rehearse: rank 0 (sharding stage 3, dp_shard 128)" in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_rehearse_help_and_a_rehearsal_without_overrides(tmp_path):
    """`lightfleet rehearse --help` without Hydra or torch; `lightfleet rehearse` alone rehearses
    the default run (one process of the MLP) for an H100."""
    done = with_stand_in(tmp_path, "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: lightfleet rehearse [KEY=VALUE ...]\n")
    assert "imported: \n" in done.stdout
    done = with_stand_in(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^rank 0 \(one process\): peak 37.0 MiB \+ reserve 1.0 GiB of 80.0 GiB: fits \|", done.stdout,
                     flags=re.M), done.stdout


# --------------------------------------------------------------------------- rank kinds (pure)


@pytest.mark.parametrize("layout, stage, expected", [
    (Layout(), None, [(0, "one process")]),
    (Layout(dp_replicate=8), None, [(0, "dp_replicate 8")]),
    (Layout(dp_shard=128), 3, [(0, "sharding stage 3, dp_shard 128")]),
    (Layout(dp_replicate=4, dp_shard=32), 2, [(0, "sharding stage 2, dp_replicate 4, dp_shard 32")]),
    (Layout(dp_shard=16, tp=8), 3, [(0, "sharding stage 3, dp_shard 16, tp 8")]),
    # rank = ((r * S + s) * P + p) * T + t: stage p at coordinate 0 elsewhere is rank p * T
    (Layout(pp=2), None, [(0, "pipeline stage 0 of 2 (first)"), (1, "pipeline stage 1 of 2 (last)")]),
    (Layout(dp_shard=32, pp=4), 1, [(0, "pipeline stage 0 of 4 (first), sharding stage 1, dp_shard 32"),
                                    (1, "pipeline stage 1 of 4 (middle), sharding stage 1, dp_shard 32"),
                                    (3, "pipeline stage 3 of 4 (last), sharding stage 1, dp_shard 32")]),
    (Layout(dp_shard=2, pp=8, tp=4), None, [(0, "pipeline stage 0 of 8 (first), dp_shard 2, tp 4"),
                                            (4, "pipeline stage 1 of 8 (middle), dp_shard 2, tp 4"),
                                            (28, "pipeline stage 7 of 8 (last), dp_shard 2, tp 4")]),
])
def test_the_ranks_that_differ_are_one_per_pipeline_position(layout, stage, expected):
    assert [(kind.rank, kind.words) for kind in rank_kinds(layout, stage)] == expected


def test_the_heaviest_rank_a_report_names_is_added_once_with_its_own_stage():
    layout = Layout(dp_shard=32, pp=4)
    added = heaviest({"heaviest_rank": 127}, [0, 1, 3], layout, 1)
    assert added == RankKind(127, "pipeline stage 3 of 4 (last), sharding stage 1, dp_shard 32: the most model state")
    assert heaviest({"heaviest_rank": 3}, [0, 1, 3], layout, 1) is None
    assert heaviest({"heaviest_rank": None}, [0], layout, 1) is None


# --------------------------------------------------------------------------- the verdict (pure)


def report(world_size: int = 8, step_peak: int = 10 * GIB, checkpoint_peak: int = 0, **parts: int) -> dict:
    return {"world_size": world_size, "memory": {"step_peak": step_peak, "checkpoint_peak": checkpoint_peak, **parts}}


def test_the_reserve_is_the_cuda_context_nccl_and_a_tenth_of_the_peak():
    knobs = RehearseConfig()
    on_h100 = knobs.target("auto")
    judged = verdict(RankKind(0, "x"), report(step_peak=10 * GIB), knobs, on_h100)
    assert (on_h100.name, on_h100.memory, on_h100.device_type) == ("h100", 80 * GIB, "cuda")
    assert judged.reserve == {"cuda_context": GIB, "nccl": GIB, "fragmentation": GIB}
    assert judged.needs == 13 * GIB and judged.fits
    alone = verdict(RankKind(0, "x"), report(world_size=1, step_peak=10 * GIB), knobs, on_h100)
    assert alone.reserve["nccl"] == 0  # one process has no NCCL communicator
    # A checkpoint save that peaks higher than the step is the peak.
    saving = verdict(RankKind(0, "x"), report(step_peak=10 * GIB, checkpoint_peak=73 * GIB), knobs, on_h100)
    assert saving.peak == 73 * GIB and saving.at_checkpoint and not saving.fits  # 73 + 2 + 7.3 > 80
    on_cpu = RehearseConfig(device_memory_gb=16).target("cpu")
    assert verdict(RankKind(0, "x"), report(), RehearseConfig(device_memory_gb=16), on_cpu).reserve == {
        "cuda_context": 0, "nccl": 0, "fragmentation": GIB}
    with pytest.raises(ConfigError, match="rehearse.device_memory_gb: a run with trainer.accelerator=cpu"):
        RehearseConfig().target("cpu")
    assert RehearseConfig(device="a100", device_memory_gb=40).target("gpu").memory == 40 * GIB


class Knobs:
    def __init__(self, **values):
        self.__dict__.update(values)


def everything(_names: List[str]) -> bool:
    return True


@pytest.mark.parametrize("strategies, knobs, memory, batch_size, expected", [
    # activations larger than the model states: their cures first
    ([], {}, {"parameters": 1, "activations": 9}, 8,
     ["recompute ('strategy=[recompute]')", "a smaller micro-batch (data.batch_size=4, with gradient_merge to keep "
      "the global batch)", "sharding ('strategy=[sharding]' strategy.sharding.stage=3)"]),
    (["amp", "sharding"], {"sharding": Knobs(stage=2)}, {"optimizer_states": 9, "activations": 1}, 1,
     ["more sharding (strategy.sharding.stage=3)", "more processes (trainer.num_nodes=4)",
      "recompute ('strategy=[amp,sharding,recompute]')"]),
    (["recompute", "sharding"], {"sharding": Knobs(stage=3)}, {"parameters": 9, "activations": 1}, 1,
     ["more processes (trainer.num_nodes=4)"]),
    (["pipeline", "sharding"], {"sharding": Knobs(stage=1), "pipeline": Knobs(accumulate_steps=8)},
     {"parameters": 9, "activations": 1}, 16,
     ["more processes (trainer.num_nodes=4)", "recompute ('strategy=[pipeline,sharding,recompute]')",
      "a smaller micro-batch (strategy.pipeline.accumulate_steps=16)"]),
])
def test_what_would_make_it_fit_is_what_the_plan_does_not_do_yet(strategies, knobs, memory, batch_size, expected):
    assert to_fit({"memory": memory}, strategies, knobs, everything, {"devices": 8, "num_nodes": 2},
                  batch_size) == expected


def test_a_selection_the_table_refuses_is_not_offered():
    table_says_no = lambda names: "recompute" not in names  # noqa: E731
    assert to_fit({"memory": {"activations": 9}}, [], {}, table_says_no, {"devices": 2, "num_nodes": 1}, 1) == [
        "sharding ('strategy=[sharding]' strategy.sharding.stage=3)"]


# --------------------------------------------------------------------------- the whole command


QUIET = ("trainer.enable_progress_bar=false",)


@pytest.mark.slow
def test_the_whole_command_with_stand_in_ranks_fits_and_does_not_fit(tmp_path):
    """ZeRO stage 1 over 4 pipeline stages of 128 processes: first, middle and last stage, then the
    heaviest rank the reports name; each a console line; rehearsal.yaml; then the same against a
    device of 1.5 GiB: exit 2 and one line naming what would make it fit, nothing written lost."""
    layout = ["trainer.devices=8", "trainer.num_nodes=16", "strategy=[pipeline,sharding]", "strategy.sharding.pp_degree=4",
              "strategy.pipeline.accumulate_steps=8", "model=gpt", "data=language_model", "model.n_layers=4",
              "data.batch_size=16", "rehearse.steps=3"]
    done = with_stand_in(tmp_path, *layout, "paths.output_dir=fits")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert ("lightfleet: rehearsing 3 kind(s) of rank of 128 processes for h100 (rank 0, rank 1, rank 3), 2 at a "
            "time, 3 steps each on fake tensors") in done.stdout
    # 37 MiB + 1 GiB + 1 GiB + 3.7 MiB = 2.0 GiB of 80
    line = ("peak 37.0 MiB + reserve 2.0 GiB of 80.0 GiB: fits | params 4.0 MiB grads 4.0 MiB optimizer 8.0 MiB "
            "activations 20.0 MiB | all_gather 3.0 GB reduce_scatter 1.0 GB a step")
    for rank, words in ((0, "pipeline stage 0 of 4 (first), sharding stage 1, dp_shard 32"),
                        (1, "pipeline stage 1 of 4 (middle), sharding stage 1, dp_shard 32"),
                        (3, "pipeline stage 3 of 4 (last), sharding stage 1, dp_shard 32"),
                        (127, "pipeline stage 3 of 4 (last), sharding stage 1, dp_shard 32: the most model state")):
        assert f"rank {rank} ({words}): {line}" in lines, done.stdout
    run = tmp_path / "fits"
    assert f"lightfleet: every kind of rank fits h100's 80 GiB: {run / 'rehearsal.yaml'}" in lines
    record = yaml.safe_load((run / "rehearsal.yaml").read_text())
    assert record["fits"] is True and record["verdict"] == "fits"
    assert record["device"] == {"name": "h100", "memory_gb": 80, "device_type": "cuda"}
    assert record["layout"] == {"dp_replicate": 1, "dp_shard": 32, "pp": 4, "tp": 1}
    assert [(r["rank"], r["fits"], r["peak_bytes"]) for r in record["ranks"]] == [
        (rank, True, 37 * MIB) for rank in (0, 1, 3, 127)]
    assert record["ranks"][0]["reserve_bytes"] == {"cuda_context": GIB, "nccl": GIB, "fragmentation": int(3.7 * MIB)}
    assert record["ranks"][0]["report"]["asked"] == {"steps": 3, "device_type": "cuda"}
    assert {"config.yaml", "plan.yaml", "env.yaml"} <= {path.name for path in run.iterdir()}
    # Planned for the cluster's GPUs on a machine without one: a CUDA run turns cudnn.benchmark on.
    assert yaml.safe_load((run / "plan.yaml").read_text())["trainer_args"]["benchmark"] == {"value": True,
                                                                                         "by": "collective"}

    small = with_stand_in(tmp_path, *layout, "rehearse.device_memory_gb=1.5", "paths.output_dir=small")
    assert one_line(small) == (
        "lightfleet: error: rehearse.device_memory_gb=1.5: rank 0 (pipeline stage 0 of 4 (first), sharding stage 1, "
        "dp_shard 32) needs 2.0 GiB (peak 37.0 MiB + reserve 2.0 GiB) of 1.5 GiB, short by 552.7 MiB; to fit, try a "
        "smaller micro-batch (strategy.pipeline.accumulate_steps=16), or more processes (trainer.num_nodes=32)")
    assert "of 1.5 GiB: does not fit |" in small.stdout
    record = yaml.safe_load((tmp_path / "small" / "rehearsal.yaml").read_text())
    assert record["fits"] is False and record["verdict"] == small.stderr.strip()
    assert (run / "rehearsal.yaml").is_file()  # the first rehearsal's directory is untouched


@pytest.mark.slow
def test_a_rank_that_refuses_its_layout_or_fails_is_one_line(tmp_path):
    done = with_stand_in(tmp_path, "trainer.devices=4", "strategy=[sharding]", "paths.output_dir=out",
                         STAND_IN_REFUSES="1")
    assert one_line(done) == ("lightfleet: error: strategy.sharding.mp_degree=3: does not divide the model's 4 heads "
                              "(rank 0: sharding stage 1, dp_shard 4)")
    record = yaml.safe_load((tmp_path / "out" / "rehearsal.yaml").read_text())
    assert record["fits"] is None and record["verdict"] == done.stderr.strip()
    failed = with_stand_in(tmp_path, "trainer.devices=4", "strategy=[sharding]", "paths.output_dir=failed",
                           STAND_IN_FAILS="1")
    log = tmp_path / "failed" / "rehearse" / "rank-0.log"
    assert failed.returncode == 1 and failed.stderr == (
        f"lightfleet: rehearsal failed: rank 0 (sharding stage 1, dp_shard 4): RuntimeError: The tensor has no data; "
        f"log {log}\n")


@pytest.mark.slow
def test_sigterm_to_the_command_ends_its_ranks_and_says_so(tmp_path):
    command, environment = stand_in_command(tmp_path, "trainer.devices=2", "paths.output_dir=out", STAND_IN_WAITS="1")
    started = subprocess.Popen(command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    pid_file = tmp_path / "out" / "rehearse" / "rank-0.pid"
    wait_for(pid_file, started)
    rank = int(pid_file.read_text())
    started.send_signal(signal.SIGTERM)
    out, err = started.communicate(timeout=60)
    assert started.returncode == 143, err
    assert err.strip() == "lightfleet: rehearsal stopped by SIGTERM"
    wait_gone([rank], within=10)
    record = yaml.safe_load((tmp_path / "out" / "rehearsal.yaml").read_text())
    assert record["fits"] is None and record["verdict"] == err.strip()
    # Not a run that failed: lightfleet report and resume say what the directory is.
    report = subprocess.run([*command[:command.index("rehearse")], "report", "out"], cwd=tmp_path, env=environment,
                            capture_output=True, text=True)
    assert report.returncode == 2 and report.stderr == (
        "lightfleet: error: report='out': is a rehearsal (lightfleet rehearse), which trains nothing: its figures "
        "and verdict are in rehearsal.yaml\n")


@pytest.mark.slow
def test_a_tiny_model_fits_and_does_not_fit_a_tiny_device(tmp_path):
    """The real ranks: the default MLP over 2 processes of stage-2 sharding fits an H100; against
    0.5 GiB (less than the CUDA context and NCCL's buffers) it does not. The user's directory has a
    `runner/` package, which the ranks started there must not import (they did: `python -m` puts
    the working directory first); the command is `python -P -m runner`, as the installed
    `lightfleet` script does not look there either."""
    shadowing_packages(tmp_path, "runner", "plugins")

    def lightfleet(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-P", "-m", "runner", *args], cwd=tmp_path, env=command_env(),
                              capture_output=True, text=True, timeout=600)

    args = ("rehearse", "trainer.devices=2", "strategy=[sharding]", "strategy.sharding.stage=2", *QUIET)
    done = lightfleet(*args, "paths.output_dir=fits")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 (sharding stage 2, dp_shard 2): peak " in done.stdout and ": fits | params " in done.stdout
    record = yaml.safe_load((tmp_path / "fits" / "rehearsal.yaml").read_text())
    assert record["fits"] is True and record["ranks"][0]["report"]["world_size"] == 2
    small = lightfleet(*args, "rehearse.device_memory_gb=0.5", "paths.output_dir=small")
    assert "rehearse.device_memory_gb=0.5: rank 0 (sharding stage 2, dp_shard 2) needs " in one_line(small)
