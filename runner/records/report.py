"""`lightfleet report [PATH ...] [--baseline JOB] [--out DIR]`: one table comparing runs and sweeps.

Reads each job directory (config.yaml, env.yaml, results.yaml or failure.yaml, csv/metrics.csv)
and a sweep's sweep.yaml, which lists the refused jobs with their reasons. One row a job: its strategies,
the knobs that differ between the jobs, its status and its measurements, with the speedup over a
baseline job. Writes report.csv (full precision), report.md (readable numbers, also printed) and
three plots: throughput.png, throughput_memory.png (with the Pareto front) and loss_curves.png.
docs/report.md says what every column means.

Reads files only (no torch, Lightning or Hydra), so it runs in a second wherever the runs are.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from runner.core.errors import ConfigError, exit_on_user_error

# Config keys that are never knobs: where files go, how they are logged, the run's name, and the
# seed, which has a column of its own.
NOT_KNOBS = ("paths", "hydra", "logger", "callbacks", "name", "seed")
MEASURES = ("status", "world_size", "step_time_ms", "samples_per_s", "tokens_per_s", "mfu", "speedup",
            "peak_memory_mb", "train_loss", "val_loss", "seed", "git_commit")
NO_THROUGHPUT = "no finished job reports samples/s"


@dataclass
class Job:
    name: str
    strategies: str  # "amp+recompute", "none", or "?" when unknown (a refused job without strategy=)
    knobs: Dict[str, Any]  # dotted config keys; only the overrides for a refused job
    status: str
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit status 2, as every lightfleet error
        raise ConfigError("report", None, message)


def main(argv: List[str]) -> int:
    with exit_on_user_error():
        args = parse_args(argv)
        paths = [Path(path) for path in args.paths] or [newest_sweep(Path("multirun"))]
        jobs = collect_jobs(paths)
        baseline = pick_baseline(jobs, args.baseline)
        out = Path(args.out) if args.out else (paths[0] if len(paths) == 1 else Path("."))
        written = write_report(jobs, baseline, header(paths, jobs, baseline), out)
    print(" ".join(str(path) for path in written))
    return 0


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = _Parser(prog="lightfleet report", description="Compare runs and sweep jobs: a table "
                     "(report.csv, report.md) and plots of throughput, memory and loss.")
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="run or sweep directories (default: the newest sweep under multirun/)")
    parser.add_argument("--baseline", metavar="JOB", help="the job speedups are measured against "
                        "(default: the first finished job without strategies)")
    parser.add_argument("--out", metavar="DIR", help="where to write the report (default: the one "
                        "run or sweep directory given, else the current directory)")
    return parser.parse_args(argv)


def newest_sweep(root: Path) -> Path:
    sweeps = [path for path in root.glob("*/*") if is_sweep(path)]
    if not sweeps:
        raise ConfigError("report", None, f"no sweep under {root}/; give a run or sweep directory")
    return max(sweeps, key=lambda path: path.stat().st_mtime)


def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def is_sweep(path: Path) -> bool:
    return (path / "multirun.yaml").is_file() or (path / "sweep.yaml").is_file()


# ---- reading the jobs ----------------------------------------------------------------------


def collect_jobs(paths: Sequence[Path]) -> List[Job]:
    """Every job of every path, in the order given; job names are prefixed by the path's name
    when there are several paths, so that names from two sweeps ("0", "0") stay apart."""
    names = [path.resolve().name for path in paths]
    if len(set(names)) < len(names):
        names = [str(path) for path in paths]
    jobs: List[Job] = []
    for path, name in zip(paths, names):
        if is_run(path):
            jobs.append(read_job(path, name))
        elif is_sweep(path):
            jobs += read_sweep(path, prefix=f"{name}/" if len(paths) > 1 else "")
        else:
            raise ConfigError("report", str(path), "is neither a run directory (holding config.yaml) nor "
                              "a sweep directory (holding multirun.yaml or sweep.yaml)")
    return jobs


def read_sweep(sweep_dir: Path, prefix: str) -> List[Job]:
    """The sweep's job directories and the refused jobs sweep.yaml lists, in job order."""
    jobs = {job_dir.relative_to(sweep_dir).as_posix(): job_dir for job_dir in job_dirs(sweep_dir)}
    listed = (load_yaml(sweep_dir / "sweep.yaml") or {}).get("jobs") or {}
    refused = {str(name): entry for name, entry in listed.items() if entry.get("status") == "refused"}
    read = [read_job(job_dir, prefix + name) for name, job_dir in jobs.items()]
    read += [refused_job(prefix + name, entry) for name, entry in refused.items() if name not in jobs]
    return sorted(read, key=lambda job: job_order(job.name))


def job_dirs(sweep_dir: Path) -> List[Path]:
    """Subdirectories holding config.yaml, one level deep or two (hydra.sweep.subdir=a/b). Hidden
    ones (.hydra) and those inside a job (its nodes/, ranks/ copies) are not jobs."""
    found = []
    for child in subdirs(sweep_dir):
        found += [child] if is_run(child) else [grandchild for grandchild in subdirs(child) if is_run(grandchild)]
    return found


def subdirs(path: Path) -> List[Path]:
    return sorted(child for child in path.iterdir() if child.is_dir() and not child.name.startswith("."))


def job_order(name: str) -> List[Any]:
    """Sort key: "2" before "10" (re.split alternates text and digits, so parts always compare alike)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def read_job(job_dir: Path, name: str) -> Job:
    config = load_yaml(job_dir / "config.yaml") or {}
    # config.yaml names every strategy; the selected ones hold their knobs, the others null.
    config["strategy"] = {name: knobs for name, knobs in (config.get("strategy") or {}).items() if knobs is not None}
    results = load_yaml(job_dir / "results.yaml")
    environment = load_yaml(job_dir / "env.yaml") or {}
    return Job(name=name, strategies=join_strategies(config["strategy"]), knobs=flatten(config),
               status="ok" if results is not None else failure_status(job_dir),
               results=results or {}, git_commit=str(environment.get("git_commit", "")),
               loss_curve=read_loss_curve(job_dir / "csv" / "metrics.csv"))


def refused_job(name: str, entry: Dict[str, Any]) -> Job:
    """A job the sweep refused before it ran: only its overrides and the reason are known."""
    overrides = dict(parse_override(override) for override in entry.get("overrides") or [] if "=" in override)
    strategies = overrides.pop("strategy", None)
    return Job(name=name, strategies="?" if strategies is None else join_strategies(strategies),
               knobs=overrides, status=f"refused: {one_line(entry.get('reason'))}")


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


def failure_status(job_dir: Path) -> str:
    failure = load_yaml(job_dir / "failure.yaml")
    if failure is None:  # killed, or still running: no record of how it ended
        return "failed: did not finish"
    if failure.get("status") == "out_of_memory":
        return "out of memory"
    exit_code = failure.get("exit_code")
    return f"failed{'' if exit_code is None else f' (exit {exit_code})'}: {one_line(failure.get('error'))}"


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


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def one_line(text: Any) -> str:
    return " ".join(str(text or "unknown").split())


# ---- the table -------------------------------------------------------------------------------


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
    if isinstance(value, float) and column == "mfu":
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
    return f"Report of {covered}: {len(jobs)} job{'s' * (len(jobs) != 1)}; {against}."


def markdown(title: str, columns: Sequence[str], rows: Sequence[Dict[str, Any]]) -> str:
    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(readable(column, row[column]) for column in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_report(jobs: Sequence[Job], baseline: Optional[Job], title: str, out: Path) -> List[Path]:
    """Write the table (CSV and markdown, the markdown also printed) and the plots into `out`."""
    knobs = differing_knobs(jobs)
    columns = ["job", "strategies", *knobs, *MEASURES]
    rows = [report_row(job, knobs, baseline) for job in by_throughput(jobs)]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "report.csv").open("w", newline="") as table:
        writer = csv.DictWriter(table, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)  # floats as repr: full precision; None as an empty cell
    text = markdown(title, columns, rows)
    (out / "report.md").write_text(text)
    print(text)
    return [out / "report.csv", out / "report.md", *write_plots(jobs, out)]


# ---- the plots -------------------------------------------------------------------------------


def pareto_front(points: Dict[str, Tuple[float, float]]) -> List[str]:
    """The names of {name: (peak_memory_mb, samples_per_s)} that no other point dominates (as
    fast or faster with no more memory, and better in one of the two), by increasing memory."""
    def dominated(memory: float, speed: float) -> bool:
        return any(other_speed >= speed and other_memory <= memory and (other_speed, other_memory) != (speed, memory)
                   for other_memory, other_speed in points.values())

    return sorted((name for name, point in points.items() if not dominated(*point)), key=lambda name: points[name])


def write_plots(jobs: Sequence[Job], out: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    written = []
    for filename, draw in (("throughput.png", draw_throughput), ("throughput_memory.png", draw_throughput_memory),
                           ("loss_curves.png", draw_loss_curves)):
        figure, axes = plt.subplots(figsize=(9, max(4.5, 0.35 * len(jobs) + 1.5)))
        draw(axes, jobs)
        with warnings.catch_warnings():  # long labels: the figure is still readable without a tight fit
            warnings.simplefilter("ignore", UserWarning)
            figure.tight_layout()
        figure.savefig(out / filename, dpi=100)
        plt.close(figure)
        written.append(out / filename)
    return written


def draw_throughput(axes: Any, jobs: Sequence[Job]) -> None:
    measured = [job for job in by_throughput(jobs) if job.finished and job.samples_per_s is not None]
    axes.set(title="Throughput by job", xlabel="throughput (samples/s)")
    if not measured:
        return note(axes, NO_THROUGHPUT)
    measured.reverse()  # barh draws from the bottom: the fastest on top
    bars = axes.barh([job.label for job in measured], [job.samples_per_s for job in measured])
    axes.bar_label(bars, fmt="%.3g", padding=3)


def draw_throughput_memory(axes: Any, jobs: Sequence[Job]) -> None:
    measured = {job.label: (job.results["peak_memory_mb"], job.samples_per_s) for job in jobs
                if job.finished and job.samples_per_s is not None and job.results.get("peak_memory_mb") is not None}
    axes.set(title="Throughput against peak memory", xlabel="peak memory, max over ranks (MB)",
             ylabel="throughput (samples/s)")
    if not measured:
        return note(axes, f"{NO_THROUGHPUT} and peak memory")
    axes.scatter(*zip(*measured.values()), label="job")
    for label, point in measured.items():
        axes.annotate(label, point, textcoords="offset points", xytext=(5, 5), fontsize=8)
    front = pareto_front(measured)
    axes.plot(*zip(*(measured[label] for label in front)), color="C3", marker="o", markersize=11,
              fillstyle="none", label="Pareto front (no job faster with no more memory)")
    axes.legend(fontsize=8)


def draw_loss_curves(axes: Any, jobs: Sequence[Job]) -> None:
    axes.set(title="Training loss", xlabel="step (optimizer steps)", ylabel="train_loss")
    logged = [job for job in jobs if job.loss_curve]
    if not logged:
        return note(axes, "no job logged train_loss" + ("" if any(job.finished for job in jobs) else ": no finished job"))
    for job in logged:
        axes.plot(*zip(*job.loss_curve), label=job.label)
    axes.legend(fontsize=8)


def note(axes: Any, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
