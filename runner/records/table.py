"""`lightfleet report`'s table: one row a job, the knobs that differ between the jobs, the speedup
over a baseline job; report.csv (full precision) and report.md (readable numbers, also printed)."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from runner.core.errors import ConfigError
from runner.records.files import REPORT_CSV, REPORT_MD
from runner.records.jobs import Job

# Config keys that are never knobs: where files go, how they are logged, the run's name, and the
# seed, which has a column of its own.
NOT_KNOBS = ("paths", "hydra", "logger", "callbacks", "name", "seed")
# Fewer measured steps than this make a job's speed a few samples of a noisy clock: the report says so.
MIN_MEASURED_STEPS = 20
MEASURES = ("status", "world_size", "step_time_ms", "data_wait", "samples_per_s", "tokens_per_s", "mfu", "speedup",
            "peak_memory_mb", "train_loss", "val_loss", "seed", "git_commit")


def differing_knobs(jobs: Sequence[Job]) -> List[str]:
    """Config keys with different values in the jobs that have them, in the order the configs list
    them. A key only some jobs have (the knobs of a strategy only they select) is no column: the
    strategies column tells them apart; a refused job has only the keys its overrides set."""
    keys = dict.fromkeys(key for job in jobs for key in job.knobs if key.split(".")[0] not in NOT_KNOBS)
    return [key for key in keys if len({knob_text(job.knobs[key]) for job in jobs if key in job.knobs}) > 1]


def pick_baseline(jobs: Sequence[Job], name: Optional[str]) -> Optional[Job]:
    """The job named by --baseline, else the first finished job without strategies (None: none)."""
    if name is None:
        return next((job for job in jobs if job.finished and job.strategies == "none"), None)
    names = [job.name for job in jobs]
    if name not in names:
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise ConfigError("--baseline", name, f"is no job of this report (jobs: {shown or 'none'})", names)
    baseline = jobs[names.index(name)]
    if baseline.samples_per_s is None:
        raise ConfigError("--baseline", name, f"has no samples_per_s to compare with ({baseline.status})")
    return baseline


def by_throughput(jobs: Sequence[Job]) -> List[Job]:
    """Highest samples/s first; jobs without one (refused, failed) after, in job order."""
    measured = [job for job in jobs if job.samples_per_s is not None]
    return sorted(measured, key=lambda job: -job.samples_per_s) + [job for job in jobs if job.samples_per_s is None]


def report_row(job: Job, knobs: Sequence[str], baseline: Optional[Job]) -> Dict[str, Any]:
    """The job's cells as values (None: unknown); knob values as written in YAML."""
    results, speed = job.results, job.samples_per_s
    step_time = results.get("step_time_median_s")
    base = baseline.samples_per_s if baseline else None
    return {"job": job.name, "strategies": job.strategies,
            **{key: knob_text(job.knobs[key]) if key in job.knobs else None for key in knobs},
            "status": job.status, "world_size": results.get("world_size"),
            "step_time_ms": None if step_time is None else step_time * 1000,
            "data_wait": results.get("data_wait_fraction"),
            "samples_per_s": speed, "tokens_per_s": results.get("tokens_per_s"), "mfu": results.get("mfu"),
            "speedup": speed / base if speed is not None and base else None,
            "peak_memory_mb": results.get("peak_memory_mb"), "train_loss": results.get("train_loss"),
            "val_loss": results.get("val_loss"), "seed": job.knobs.get("seed"),
            "git_commit": job.git_commit[:8] or None}


def knob_text(value: Any) -> str:
    """A config value as YAML/JSON writes it (null, true, [1, 2]); strings as they are."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def readable(column: str, value: Any) -> str:
    """A cell of report.md: 3 significant digits, mfu as a percentage, speedup as a factor."""
    if value is None:
        return ""
    if isinstance(value, float) and column in ("mfu", "data_wait"):
        return f"{significant(value * 100)}%"
    if isinstance(value, float):
        return significant(value) + ("x" if column == "speedup" else "")
    return str(value).replace("|", "\\|")  # a `|` in an error line would split the cell


def significant(value: float, digits: int = 3) -> str:
    """1234.5 -> "1230", 0.012345 -> "0.0123", 1.5 -> "1.50"."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    if abs(value) < 1e-3:
        return f"{value:.{digits}g}"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    return f"{round(value, decimals):.{max(decimals, 0)}f}"


def header(paths: Sequence[Path], jobs: Sequence[Job], baseline: Optional[Job]) -> str:
    covered = ", ".join(str(path) for path in paths)
    against = (f"baseline (speedup 1x): job {baseline.label}" if baseline else
               "no baseline (no finished job without strategies; name one with --baseline JOB): speedup is empty")
    missing = [job.name for job in jobs if not job.finished and not job.status.startswith("refused")]
    lacking = (f" Missing results: job{'s' * (len(missing) != 1)} {', '.join(missing)} (see status); "
               f"lightfleet resume SWEEP_DIR continues a stopped sweep." if missing else "")
    return f"Report of {covered}: {len(jobs)} job{'s' * (len(jobs) != 1)}; {against}.{lacking}"


def markdown(title: str, columns: Sequence[str], rows: Sequence[Dict[str, Any]], notes: Sequence[str] = ()) -> str:
    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(readable(column, row[column]) for column in columns) + " |" for row in rows]
    return "\n".join([*lines, *(["", *notes] if notes else [])]) + "\n"


def few_steps_notes(jobs: Sequence[Job]) -> List[str]:
    """A line for each finished job whose speed rests on fewer than MIN_MEASURED_STEPS steps."""
    notes = []
    for job in jobs:
        steps = job.results.get("measured_steps")
        if job.finished and steps is not None and steps < MIN_MEASURED_STEPS:
            notes.append(f"Note: job {job.label} measured {steps} step{'s' * (steps != 1)} (after "
                         f"{job.results.get('warmup_steps', 0)} warm-up): its speed and speedup are within the "
                         f"noise; measure at least {MIN_MEASURED_STEPS} (trainer.max_steps, measure.warmup_steps).")
    return notes


def write_table(jobs: Sequence[Job], baseline: Optional[Job], title: str, out: Path) -> List[Path]:
    """Write the table into `out` as CSV and markdown (the markdown also printed)."""
    knobs = differing_knobs(jobs)
    columns = ["job", "strategies", *knobs, *MEASURES]
    rows = [report_row(job, knobs, baseline) for job in by_throughput(jobs)]
    with (out / REPORT_CSV).open("w", newline="") as table:
        writer = csv.DictWriter(table, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)  # floats as repr: full precision; None as an empty cell
    text = markdown(title, columns, rows, few_steps_notes(jobs))
    (out / REPORT_MD).write_text(text)
    print(text)
    return [out / REPORT_CSV, out / REPORT_MD]
