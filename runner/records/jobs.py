"""The jobs `lightfleet report` compares, read from run and sweep directories: each job directory's
config, environment, results or failure and loss curve, and the refused jobs a sweep.yaml lists."""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from runner.core.errors import ConfigError
from runner.records.files import (CONFIG_YAML, DIVERGED, ENV_YAML, FINISHED, HYDRA_OVERRIDES, METRICS_CSV,
                                  MULTIRUN_YAML, NOT_STARTED, OUT_OF_MEMORY, PREEMPTED, REFUSED, REFUSED_YAML,
                                  REHEARSAL_YAML, SWEEP_YAML, holds_rehearsal, holds_run, holds_sweep, job_ending,
                                  read_yaml)


@dataclass
class Job:
    name: str
    strategies: str  # "amp+recompute", "none", or "?" when unknown (a refused job without strategy=)
    knobs: Dict[str, Any]  # dotted config keys; only the overrides for a refused job
    status: str  # how it ended, as the table says it (`status_text`)
    results: Dict[str, Any] = field(default_factory=dict)
    git_commit: str = ""
    loss_curve: List[Tuple[float, float]] = field(default_factory=list)  # (step, train_loss)

    @property
    def finished(self) -> bool:
        return self.status == "ok"

    @property
    def samples_per_s(self) -> Optional[float]:
        return self.results.get("samples_per_s")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.strategies})"


def collect_jobs(paths: Sequence[Path]) -> List[Job]:
    """Every job of every path, in the order given; job names are prefixed by the path's name
    when there are several paths, so that names from two sweeps ("0", "0") stay apart."""
    names = [path.resolve().name for path in paths]
    if len(set(names)) < len(names):
        names = [str(path) for path in paths]
    jobs: List[Job] = []
    for path, name in zip(paths, names):
        if holds_run(path):
            jobs.append(read_job(path, name))
        elif holds_sweep(path):
            jobs += read_sweep(path, prefix=f"{name}/" if len(paths) > 1 else "")
        elif holds_rehearsal(path):
            raise ConfigError("report", str(path), f"is a rehearsal (lightfleet rehearse), which trains nothing: "
                              f"its figures and verdict are in {REHEARSAL_YAML}")
        else:
            raise ConfigError("report", str(path), f"is neither a run directory (holding {CONFIG_YAML}) nor "
                              f"a sweep directory (holding {MULTIRUN_YAML} or {SWEEP_YAML})")
    return jobs


def read_sweep(sweep_dir: Path, prefix: str) -> List[Job]:
    """The sweep's job directories and the jobs sweep.yaml lists as refused or never started, in job order."""
    jobs = {job_dir.relative_to(sweep_dir).as_posix(): job_dir for job_dir in job_dirs(sweep_dir)}
    listed = (read_yaml(sweep_dir / SWEEP_YAML) or {}).get("jobs") or {}
    unrun = {str(name): entry for name, entry in listed.items() if entry.get("status") in (REFUSED, NOT_STARTED)}
    read = [read_job(job_dir, prefix + name) for name, job_dir in jobs.items()]
    read += [unrun_job(prefix + name, entry) for name, entry in unrun.items() if name not in jobs]
    return sorted(read, key=lambda job: job_order(job.name))


def job_dirs(sweep_dir: Path, refused: bool = False) -> List[Path]:
    """Subdirectories holding config.yaml (with `refused`, or refused.yaml), one level deep or two
    (hydra.sweep.subdir=a/b). Hidden ones (.hydra, a sweep's attempts) and those inside a job (its
    nodes/, ranks/ copies) are not jobs."""
    def is_job(path: Path) -> bool:
        return holds_run(path) or (refused and (path / REFUSED_YAML).is_file())

    found = []
    for child in subdirs(sweep_dir):
        found += [child] if is_job(child) else [grandchild for grandchild in subdirs(child) if is_job(grandchild)]
    return found


def sweep_jobs(sweep_dir: Path, planned: Sequence[Tuple[int, Sequence[str]]]) -> Dict[str, Dict[str, Any]]:
    """What sweep.yaml lists: every job of the sweep by name (its directory; its number for one
    never started), with its overrides and how it ended (failure.yaml's or refused.yaml's record
    for one that did not finish). `planned`: the jobs the sweeper planned, (number, overrides)."""
    jobs = {}
    for job in job_dirs(sweep_dir, refused=True):
        name, ending = job.relative_to(sweep_dir).as_posix(), job_ending(job)
        if ending.outcome == REFUSED:
            jobs[name] = {**ending.record, "status": REFUSED}
        elif (job / HYDRA_OVERRIDES).is_file():
            # failure.yaml says how a job that did not finish ended (status, exit_code, error)
            told = ending.record if ending.outcome != FINISHED and ending.record else {"status": ending.outcome}
            jobs[name] = {"overrides": read_yaml(job / HYDRA_OVERRIDES), **told}
    seen = {tuple(entry.get("overrides") or ()) for entry in jobs.values()}
    jobs.update({str(number): {"overrides": list(overrides), "status": NOT_STARTED}
                 for number, overrides in planned if tuple(overrides) not in seen})
    return dict(sorted(jobs.items(), key=lambda item: job_order(item[0])))


def subdirs(path: Path) -> List[Path]:
    return sorted(child for child in path.iterdir() if child.is_dir() and not child.name.startswith("."))


def job_order(name: str) -> List[Any]:
    """Sort key: "2" before "10" (re.split alternates text and digits, so parts always compare alike)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def read_job(job_dir: Path, name: str) -> Job:
    config = read_yaml(job_dir / CONFIG_YAML) or {}
    # config.yaml names every strategy; the selected ones hold their knobs, the others null.
    config["strategy"] = {name: knobs for name, knobs in (config.get("strategy") or {}).items() if knobs is not None}
    ending = job_ending(job_dir)
    environment = read_yaml(job_dir / ENV_YAML) or {}
    return Job(name=name, strategies=join_strategies(config["strategy"]), knobs=flatten(config),
               status=status_text(ending.outcome, ending.record),
               results=ending.record if ending.outcome == FINISHED else {},
               git_commit=str(environment.get("git_commit", "")), loss_curve=read_loss_curve(job_dir / METRICS_CSV))


def unrun_job(name: str, entry: Dict[str, Any]) -> Job:
    """A job the sweep refused before it ran, or never started: only its overrides (and the reason) are known."""
    overrides = dict(parse_override(override) for override in entry.get("overrides") or [] if "=" in override)
    strategies = overrides.pop("strategy", None)
    return Job(name=name, strategies="?" if strategies is None else join_strategies(strategies),
               knobs=overrides, status=status_text(entry["status"], entry))


def status_text(outcome: str, record: Dict[str, Any]) -> str:
    """How a job ended (an outcome and the record saying so: runner/records/files.py), as the
    table's status column says it: docs/report.md."""
    if outcome == FINISHED:
        return "ok"
    if outcome == REFUSED:
        return f"refused: {one_line(record.get('reason'))}"
    if outcome == NOT_STARTED:
        return "not started"
    if outcome == PREEMPTED:  # its line says by what, and where it continues
        return one_line(record.get("error") or "preempted")
    if not record:  # killed, or still running: no record of how it ended
        return "failed: did not finish"
    if outcome == OUT_OF_MEMORY:
        return "out of memory"
    if outcome == DIVERGED:  # its error says so first: "diverged: the loss became non-finite ... at step N; ..."
        return one_line(record.get("error"))
    exit_code = record.get("exit_code")
    return f"failed{'' if exit_code is None else f' (exit {exit_code})'}: {one_line(record.get('error'))}"


def parse_override(override: str) -> Tuple[str, Any]:
    """`+key=value` -> (key, value), the value read as YAML (4, true, null, [amp,recompute]) to
    compare with what config.yaml holds."""
    key, _, value = override.partition("=")
    try:
        return key.lstrip("+"), yaml.safe_load(value)
    except yaml.YAMLError:  # Hydra's own syntax (choice(...), quoted paths): kept as written
        return key.lstrip("+"), value


def join_strategies(strategies: Any) -> str:
    """Strategy names from config.yaml's mapping, or an override's list (or single name)."""
    names = [strategies] if isinstance(strategies, str) else list(strategies)
    return "+".join(sorted(map(str, names))) or "none"


def read_loss_curve(metrics_csv: Path) -> List[Tuple[float, float]]:
    """(step, train_loss) of the CSV logger's rows that logged train_loss (other rows leave it empty)."""
    if not metrics_csv.is_file():
        return []
    with metrics_csv.open(newline="") as lines:
        return [(float(row["step"]), float(row["train_loss"])) for row in csv.DictReader(lines)
                if row.get("train_loss") and row.get("step")]


def flatten(mapping: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values, empty mappings add no key."""
    flat: Dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def one_line(text: Any) -> str:
    return " ".join(str(text or "unknown").split())
