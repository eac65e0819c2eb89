"""`lightfleet report [PATH ...] [--baseline JOB] [--out DIR]`: one table comparing runs and sweeps.

Reads each job directory (config.yaml, env.yaml, how it ended, csv/metrics.csv) and a sweep's
sweep.yaml, which lists the refused jobs with their reasons (runner/records/jobs.py). One row a
job: its strategies, the knobs that differ between the jobs, its status and its measurements, with
the speedup over a baseline job (runner/records/table.py). Writes report.csv (full precision),
report.md (readable numbers, also printed) and three plots (runner/records/plots.py):
throughput.png, throughput_memory.png (with the Pareto front) and loss_curves.png.
docs/report.md says what every column means.

Reads files only (no torch, Lightning or Hydra), so it runs in a second wherever the runs are.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from runner.core.errors import ConfigError, exit_on_user_error
from runner.core.paths import user_path
from runner.records.files import holds_sweep
from runner.records.jobs import Job, collect_jobs
from runner.records.plots import write_plots
from runner.records.table import header, pick_baseline, write_table


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit status 2, as every lightfleet error
        raise ConfigError("report", None, message)


def main(argv: List[str]) -> int:
    with exit_on_user_error():
        args = parse_args(argv)
        paths = [user_path(path) for path in args.paths] or [newest_sweep(Path("multirun"))]
        jobs = collect_jobs(paths)
        baseline = pick_baseline(jobs, args.baseline)
        out = user_path(args.out) if args.out else (paths[0] if len(paths) == 1 else Path("."))
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
    sweeps = [path for path in root.glob("*/*") if holds_sweep(path)]
    if not sweeps:
        raise ConfigError("report", None, f"no sweep under {root}/; give a run or sweep directory")
    return max(sweeps, key=lambda path: path.stat().st_mtime)


def write_report(jobs: Sequence[Job], baseline: Optional[Job], title: str, out: Path) -> List[Path]:
    """Write the table (CSV and markdown, the markdown also printed) and the plots into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    return [*write_table(jobs, baseline, title, out), *write_plots(jobs, out)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
