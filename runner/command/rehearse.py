"""`lightfleet rehearse [KEY=VALUE ...]`: a run of any trainer.devices x trainer.num_nodes,
rehearsed on this machine before any GPU is allocated (docs/rehearse.md).

The same one preflight as a run, less what needs the cluster's hardware (runner/command/preflight.py
says which stage a rehearsal skips, and why), plans the run for the cluster's devices; a run
directory like a run's holds its config and plan. Then each kind of rank the plan's layout holds
(runner/config/rehearse.py: first, middle and last pipeline stage; the heaviest ZeRO stage 1 rank
where its report names one) is built and stepped on fake tensors in a fresh process of the rank
side (`RANK_MODULE`: a fake process group is one per process), `rehearse.at_once` at a time, a
console line as each finishes. rehearsal.yaml keeps every report with its verdict: its peak plus
the reserve against the device's memory. Where a rank does not fit, the command ends with exit
status 2 and one line naming what would make it fit.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from runner.command import preflight
from runner.command.command_line import parse, quote_checkpoint_names
from runner.config.compat import check, load_table
from runner.config.rehearse import (RankKind, RehearseConfig, Target, Verdict, console_line, heaviest, rank_kinds,
                                    refusal, to_fit, verdict)
from runner.core.errors import ConfigError, Refusal, exit_on_user_error
from runner.core.paths import python_module
from runner.core.prediction import Prediction, load_devices, predict
from runner.core.world import Layout, World
from runner.rank.parent import INTERRUPTED, exit_status
from runner.records.files import REHEARSAL_REPORT, REHEARSAL_YAML

if TYPE_CHECKING:  # imported once the preflight allows the rehearsal
    from runner.config.checks import RunSpec
    from runner.core.plan import Plan

# The rank side: `python -m RANK_MODULE RUN_DIR --rank R --steps S --device-type cuda|cpu --out REPORT.json`.
RANK_MODULE = "runner.rank.rehearse"
HELP = """\
usage: lightfleet rehearse [KEY=VALUE ...]

Rehearse the run the overrides compose (any trainer.devices x trainer.num_nodes) on this machine,
without GPUs and without a cluster's environment: each kind of rank (first, middle and last
pipeline stage; the heaviest ZeRO stage 1 rank) is built by the run's own build on fake tensors in a
fake process group of the run's size and steps rehearse.steps optimizer steps. Prints per rank
kind its peak memory plus a reserve against the device's memory (rehearse.device=h100|h200|a100,
or rehearse.device_memory_gb=GIB), the memory's parts and the bytes of each collective a step;
writes them to RUN_DIR/rehearsal.yaml. Exit status 2 where a rank does not fit, with what would
make it fit. dry_run=true prints the plan and the ranks it would rehearse. docs/rehearse.md.
"""


class RankFailed(Exception):
    """A rehearsed rank that ended without its report: its one line and exit status."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.code = code


def main(args: Sequence[str]) -> int:
    if {"-h", "--help"} & set(args):
        print(HELP, end="")
        return 0
    args = [quote_checkpoint_names(arg) for arg in args]
    try:
        with exit_on_user_error():
            preflight.command_line(args)
            return rehearse(args)
    except KeyboardInterrupt:  # during the preflight (the ranks' rehearsal takes it itself)
        print("lightfleet: interrupted", file=sys.stderr)
        return INTERRUPTED


def rehearse(args: Sequence[str]) -> int:
    from omegaconf import OmegaConf

    from runner.core.plan import format_plan
    from runner.records.run_dir import create_run_dir

    parsed, _, config_name = parse(list(args))
    flags = {"-m": parsed.multirun, "--cfg": parsed.cfg, "--info": parsed.info,
             "--hydra-help": parsed.hydra_help, "--shell-completion": parsed.shell_completion}
    for flag, given in flags.items():
        if given:
            raise ConfigError("lightfleet rehearse", flag, "rehearses the one run its overrides compose; "
                              "give only KEY=VALUE (and --config-dir, --config-name)")
    cfg = preflight.compose(parsed.overrides, parsed.config_dir, config_name)
    if preflight.auto_selected(cfg):  # its plan holds no strategy yet: the rehearsal would be of none
        raise ConfigError("strategy", "[auto]", "lightfleet rehearse rehearses one plan, and auto's is chosen when "
                          "it runs; to choose by rehearsing every candidate: lightfleet 'strategy=[auto]' "
                          "strategy.auto.mode=rehearse (docs/auto.md)")
    flight = preflight.check_job(cfg, rehearsal=True)
    spec, plan = flight.spec, flight.plan
    knobs: RehearseConfig = OmegaConf.to_object(spec.cfg.rehearse)
    target = knobs.target(spec.trainer.accelerator)
    world = World(**plan.world)
    kinds = kinds_of(spec, plan)
    if spec.cfg.dry_run:
        print(f"{format_plan(plan)}\nlightfleet rehearse would rehearse: "
              f"{'; '.join(f'rank {kind.rank} ({kind.words})' for kind in kinds)}")
        return 0
    run_dir, _ = preflight.run_directory(cfg, plan, rehearsal=True)
    spec.cfg.paths.output_dir = str(run_dir)
    create_run_dir(spec.cfg, plan, ["rehearse", *args], run_dir)
    print(f"lightfleet: run directory {run_dir}\nlightfleet: rehearsing {len(kinds)} kind(s) of rank of "
          f"{world.world_size} processes for {target.name} ({', '.join(f'rank {kind.rank}' for kind in kinds)}), "
          f"{knobs.at_once} at a time, {knobs.steps} steps each on fake tensors: a model of billions of "
          f"parameters takes about a minute a kind", flush=True)

    from runner.command.launch import stopping_at_once  # torch's and Lightning's: after the preflight
    from runner.rank.preemption import Preempted

    try:
        with stopping_at_once():  # a signal ends the ranks with the command (run_ranks' finally)
            rehearsed = rehearse_dir(run_dir, spec, plan, knobs, target)
    except (RankFailed, Preempted) as failure:
        print(ending_of(failure), file=sys.stderr)
        return exit_status(failure.signum) if isinstance(failure, Preempted) else failure.code
    if rehearsed.predictions:
        print(f"lightfleet: predicted {rehearsed.slowest.line()}", flush=True)
    if rehearsed.problem:
        raise rehearsed.problem
    print(f"lightfleet: every kind of rank fits {target.name}'s {target.memory_gb:g} GiB: {run_dir / REHEARSAL_YAML}")
    return 0


def kinds_of(spec: "RunSpec", plan: "Plan") -> List[RankKind]:
    """The kinds of rank the plan's layout holds (runner/config/rehearse.py)."""
    sharding = spec.strategies.get("sharding")
    return rank_kinds(layout_of(plan), sharding.stage if sharding else None)


def layout_of(plan: "Plan") -> Layout:
    return plan.layout or Layout(dp_replicate=World(**plan.world).world_size)


@dataclass
class Rehearsed:
    """What rehearsing a run's rank kinds found: each kind's report, verdict and prediction, and the
    refusal of the kind that misses most (None: every kind fits)."""

    reports: Dict[RankKind, Dict[str, Any]]
    verdicts: List[Verdict]
    problem: Optional[ConfigError]
    predictions: Dict[RankKind, Prediction]

    @property
    def slowest(self) -> Prediction:
        """The run goes at its slowest rank's pace (a pipeline at its slowest stage's)."""
        return max(self.predictions.values(), key=lambda prediction: prediction.step_s)

    @property
    def peak(self) -> int:
        return max(one.peak for one in self.verdicts)

    @property
    def needs(self) -> int:
        return max(one.needs for one in self.verdicts)


def rehearse_dir(run_dir: Path, spec: "RunSpec", plan: "Plan", knobs: RehearseConfig, target: Target,
                 said: Callable[[str], None] = partial(print, flush=True)) -> Rehearsed:
    """Rehearse the run whose config and plan `run_dir` holds: each kind of rank, a line `said` as each
    finishes, then the verdicts and predictions, all into run_dir/rehearsal.yaml (its verdict the
    failure where a rank fails: RankFailed, or a signal: Preempted, raised on)."""
    from runner.rank.preemption import Preempted
    from runner.records.run_dir import write_yaml

    layout = layout_of(plan)
    sharding = spec.strategies.get("sharding")
    stage = sharding.stage if sharding else None
    record = {"device": {"name": target.name, "memory_gb": target.memory_gb, "device_type": target.device_type},
              "reserve": {"cuda_context_gb": knobs.reserve_context_gb, "nccl_gb": knobs.reserve_nccl_gb,
                          "fragmentation": knobs.reserve_fragmentation},
              "world": plan.world, "layout": layout.to_dict()}

    def each(kind: RankKind, report: Mapping[str, Any]) -> None:
        said(console_line(verdict(kind, report, knobs, target), report))

    try:
        reports = run_ranks(run_dir, kinds_of(spec, plan), knobs.steps, target.device_type, knobs.at_once, each,
                            partial(heaviest, layout=layout, sharding_stage=stage))
    except (RankFailed, Preempted) as failure:
        write_yaml(run_dir / REHEARSAL_YAML, {**record, "fits": None, "verdict": ending_of(failure)})
        raise
    verdicts, problem = judged(reports, knobs, target, spec, plan)
    predictions = predicted(reports, knobs, target, spec, layout)
    rehearsed = Rehearsed(reports, verdicts, problem, predictions)
    record.update(fits=problem is None, verdict=f"lightfleet: error: {problem}" if problem else "fits", ranks=[
        {"rank": one.kind.rank, "kind": one.kind.words, "fits": one.fits, "needs_bytes": one.needs,
         "peak_bytes": one.peak, "reserve_bytes": one.reserve, "report": reports[one.kind],
         **({"prediction": asdict(predictions[one.kind])} if one.kind in predictions else {})} for one in verdicts])
    if predictions:
        record["prediction"] = asdict(rehearsed.slowest)
    write_yaml(run_dir / REHEARSAL_YAML, record)
    return rehearsed


def ending_of(failure: Exception) -> str:
    """A rehearsal's last line when a rank failed (its own line) or a signal stopped it."""
    if isinstance(failure, RankFailed):
        return str(failure)
    return f"lightfleet: rehearsal stopped by {signal.Signals(failure.signum).name}"


def judged(reports: Mapping[RankKind, Mapping[str, Any]], knobs: RehearseConfig, target: Target,
           spec: "RunSpec", plan: "Plan") -> Tuple[List[Verdict], Optional[ConfigError]]:
    """Each kind's verdict, by rank, and the refusal of the one that misses most (None: all fit)."""
    verdicts = sorted((verdict(kind, report, knobs, target) for kind, report in reports.items()),
                      key=lambda one: one.kind.rank)
    worst = max(verdicts, key=lambda one: one.needs - one.memory)
    if worst.fits:
        return verdicts, None
    ways = to_fit(reports[worst.kind], plan.strategies, spec.strategies, allowed, plan.world, spec.batch_size)
    return verdicts, refusal(worst, knobs, ways)


def predicted(reports: Mapping[RankKind, Mapping[str, Any]], knobs: RehearseConfig, target: Target,
              spec: "RunSpec", layout: Layout) -> Dict[RankKind, Prediction]:
    """Each kind's step time on rehearse.device (runner/core/prediction.py); none for a run on CPUs,
    which the device table does not describe."""
    if target.device_type != "cuda":
        return {}
    pipeline = spec.strategies.get("pipeline")
    schedule = {"micro_batches": pipeline.accumulate_steps, "vpp_degree": pipeline.vpp_degree} if pipeline else {}
    device = load_devices()[knobs.device]
    return {kind: predict(report, device, layout, **schedule) for kind, report in reports.items()}


def allowed(names: List[str]) -> bool:
    """Whether the table allows the strategies `names` together."""
    try:
        check(names, load_table())
    except (ConfigError, Refusal):
        return False
    return True


def run_ranks(run_dir: Path, kinds: Sequence[RankKind], steps: int, device_type: str, at_once: int,
              said: Callable[[RankKind, Mapping[str, Any]], None],
              more: Callable[[Mapping[str, Any], List[int]], Optional[RankKind]]) -> Dict[RankKind, Dict[str, Any]]:
    """Each kind's report, from a fresh process of the rank side each, `at_once` at a time, `said`
    as each finishes; the kind a report asks `more` for (the heaviest rank it names) is rehearsed
    too. A rank that fails stops the others: RankFailed."""
    pending, running, reports = list(kinds), {}, {}
    try:
        while pending or running:
            while pending and len(running) < at_once:
                kind = pending.pop(0)
                running[kind] = start_rank(run_dir, kind, steps, device_type)
            time.sleep(0.05)
            for kind, process in list(running.items()):
                if process.poll() is None:
                    continue
                del running[kind]
                reports[kind] = report_of(run_dir, kind, process.returncode)
                said(kind, reports[kind])
                extra = more(reports[kind], [known.rank for known in [*reports, *running, *pending]])
                pending += [extra] if extra else []
    finally:  # a failure or a signal: the others are not needed any more
        for process in running.values():
            process.terminate()
            process.wait()
    return reports


def start_rank(run_dir: Path, kind: RankKind, steps: int, device_type: str) -> subprocess.Popen:
    report = run_dir / REHEARSAL_REPORT.format(rank=kind.rank)
    report.parent.mkdir(parents=True, exist_ok=True)
    with open(report.with_suffix(".log"), "w") as log:
        # Without the working directory on its path (a `runner/` of the user's there shadows nothing).
        return subprocess.Popen([*python_module(RANK_MODULE), str(run_dir), "--rank", str(kind.rank),
                                 "--steps", str(steps), "--device-type", device_type, "--out", str(report)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def report_of(run_dir: Path, kind: RankKind, code: int) -> Dict[str, Any]:
    """The report a rank wrote, or its failure in one line: its own refusal as it said it (a layout
    that fails on the cluster fails here), else its last line and its log."""
    report = run_dir / REHEARSAL_REPORT.format(rank=kind.rank)
    if code == 0 and report.is_file():
        return json.loads(report.read_text())
    log = report.with_suffix(".log")
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    if code == 2 and lines and lines[-1].startswith(("lightfleet: error: ", "lightfleet: refused: ")):
        raise RankFailed(f"{lines[-1]} (rank {kind.rank}: {kind.words})", 2)
    ending = f"killed by {signal.Signals(-code).name}" if code < 0 else error_of(lines) or f"exit status {code}"
    raise RankFailed(f"lightfleet: rehearsal failed: rank {kind.rank} ({kind.words}): {ending}; log {log}", 1)


def error_of(lines: Sequence[str]) -> Optional[str]:
    """The error a rank's output ends with: its traceback's `XError: ...` line (torch prefixes a
    rank's lines with `[rankR]: `; an error's message may run on over more lines), else its last line."""
    plain = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in lines]
    errors = [line for line in plain if re.match(r"[\w.]+(Error|Exception|Interrupt)\b.*: ", line)]
    return (errors or plain or [None])[-1]
