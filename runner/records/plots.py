"""`lightfleet report`'s plots: throughput by job, throughput against peak memory with the Pareto
front, and the training loss curves. matplotlib is imported when they are drawn, not before."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from runner.records.files import LOSS_CURVES_PNG, THROUGHPUT_MEMORY_PNG, THROUGHPUT_PNG
from runner.records.jobs import Job
from runner.records.table import by_throughput, significant

NO_THROUGHPUT = "no finished job reports samples/s"
EDGE_ROOM = 1.2  # the memory plot's axes end this factor beyond its largest point
# The loss curves' styles by job number: a (line, marker) pair repeats after 8 jobs, with the colour after 40.
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


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
    for filename, draw in ((THROUGHPUT_PNG, draw_throughput), (THROUGHPUT_MEMORY_PNG, draw_throughput_memory),
                           (LOSS_CURVES_PNG, draw_loss_curves)):
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
    axes.bar_label(bars, labels=[significant(job.samples_per_s) for job in measured], padding=3)


def draw_throughput_memory(axes: Any, jobs: Sequence[Job]) -> None:
    measured = {job.label: (job.results["peak_memory_mb"], job.samples_per_s) for job in jobs
                if job.finished and job.samples_per_s is not None and job.results.get("peak_memory_mb") is not None}
    axes.set(title="Throughput against peak memory", xlabel="peak memory, max over ranks (MB)",
             ylabel="throughput (samples/s)")
    if not measured:
        return note(axes, f"{NO_THROUGHPUT} and peak memory")
    axes.scatter(*zip(*measured.values()), label="job")
    # From zero: a zoomed axis makes a few MB of noise look like differences between the jobs; a
    # fifth beyond the largest, so that no point sits on an edge, its circle and label cut off.
    memories, speeds = zip(*measured.values())
    axes.set_xlim(0, EDGE_ROOM * max(memories))
    axes.set_ylim(0, EDGE_ROOM * max(speeds))
    for label, (memory, speed) in measured.items():
        leftwards = memory > 0.5 * max(memories)  # a label on the right half reads towards the middle
        axes.annotate(label, (memory, speed), textcoords="offset points", xytext=(-5 if leftwards else 5, 5),
                      ha="right" if leftwards else "left", fontsize=8)
    front = pareto_front(measured)
    axes.plot(*zip(*(measured[label] for label in front)), color="C3", marker="o", markersize=11,
              fillstyle="none", label="Pareto front (no job faster with no more memory)")
    axes.legend(fontsize=8)


def draw_loss_curves(axes: Any, jobs: Sequence[Job]) -> None:
    axes.set(title="Training loss", xlabel="step (optimizer steps)", ylabel="train_loss")
    logged = [job for job in jobs if job.loss_curve]
    if not logged:
        return note(axes, "no job logged train_loss" + ("" if any(job.finished for job in jobs) else ": no finished job"))
    for index, job in enumerate(logged):
        # A style of its own and hollow markers: a curve drawn over an identical one leaves it visible.
        same = next((other.label for other in logged[:index] if other.loss_curve == job.loss_curve), None)
        axes.plot(*zip(*job.loss_curve), label=job.label if same is None else f"{job.label}, the same curve as {same}",
                  linestyle=LINE_STYLES[index % len(LINE_STYLES)], marker=MARKERS[index % len(MARKERS)],
                  markersize=5, fillstyle="none")  # marked: a one-point curve shows
    axes.legend(fontsize=8)


def note(axes: Any, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes)
