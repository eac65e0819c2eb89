"""The command's time before the first step and after fit (issue 43): lightfleet's quickstart
against bench/handwritten.py, interleaved, each process stamped by the same callback (`Stamp`):
seconds from the process's start to its first training step and from fit's end to its exit, wall
and CPU (the machine is shared: CPU time says what the process itself did).

    python bench/startup.py --repeats 5 --steps 1 50     # results in bench/startup.json
    python bench/startup.py --before /tmp/old-checkout   # and lightfleet of another checkout (a copy of
                                                         # an older tree holding this file), interleaved
    python bench/startup.py handwritten --steps 1 --out DIR   # (internal) the script, stamped
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
STAMP_ENV = "LIGHTFLEET_BENCH_STAMP"  # the JSON file the stamping callback writes
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # as bench/run.py: one torch thread on both sides


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _stamp_callback():
    import pytorch_lightning as pl

    class Stamp(pl.Callback):
        """Notes time and CPU at the first training step and at fit's end, and writes them at exit."""

        def __init__(self) -> None:
            self.marks: Dict[str, float] = {}

        def on_train_batch_start(self, *args: object) -> None:
            if "first_step" not in self.marks:
                self.marks.update(first_step=time.time(), first_step_cpu=_cpu_s())

        def on_fit_end(self, *args: object) -> None:
            self.marks.update(fit_end=time.time(), fit_end_cpu=_cpu_s())
            Path(os.environ[STAMP_ENV]).write_text(json.dumps(self.marks))

    return Stamp


def Stamp():  # noqa: N802 (a callback's `_target_`: +callbacks.stamp._target_=bench.startup.Stamp)
    return _stamp_callback()()


def handwritten(argv: List[str]) -> None:
    """bench/handwritten.py as it runs, with the stamp added to its Trainer's callbacks (it imports
    Lightning first itself: importing it here first costs it nothing)."""
    import pytorch_lightning as pl

    init = pl.Trainer.__init__

    def stamped(self, *args, callbacks=(), **kwargs):
        init(self, *args, callbacks=[*callbacks, Stamp()], **kwargs)

    pl.Trainer.__init__ = stamped
    sys.argv = ["bench/handwritten.py", *argv]
    runpy.run_path(str(ROOT / "bench" / "handwritten.py"), run_name="__main__")


def sides(steps: int, out: str, i: int, before: Optional[str]) -> Dict[str, Tuple[List[str], Path]]:
    """Each side's command line and the directory it runs in."""
    def lightfleet(name: str) -> List[str]:
        return [sys.executable, "-m", "runner", "experiment=quickstart", f"trainer.max_steps={steps}",
                "trainer.enable_progress_bar=false", f"paths.output_dir={out}/{name}{i}",
                "+callbacks.stamp._target_=bench.startup.Stamp"]

    commands = {"lightfleet": (lightfleet("lightfleet"), ROOT),
                "handwritten": ([sys.executable, "bench/startup.py", "handwritten", "--steps", str(steps),
                                 "--out", f"{out}/handwritten{i}"], ROOT)}
    if before:
        commands["before"] = (lightfleet("before"), Path(before))
    return commands


def measure(command: List[str], cwd: Path, stamp: Path) -> Dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**ENV, STAMP_ENV: str(stamp)})
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(f"bench: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    marks = json.loads(stamp.read_text())
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"to_first_step_s": marks["first_step"] - start, "to_first_step_cpu_s": marks["first_step_cpu"],
            "fit_s": marks["fit_end"] - marks["first_step"], "after_fit_s": end - marks["fit_end"],
            "after_fit_cpu_s": cpu - marks["fit_end_cpu"], "wall_s": end - start, "cpu_s": cpu}


def compare(steps: int, repeats: int, before: Optional[str]) -> Dict[str, object]:
    """Each lightfleet side against the script: medians, and the median of the differences of
    the pairs run back to back (with the smallest and largest), the sides' order rotating."""
    runs: Dict[str, List[Dict[str, float]]] = {side: [] for side in sides(steps, "", 0, before)}
    with tempfile.TemporaryDirectory() as out:
        for i in range(repeats):
            commands = sides(steps, out, i, before)
            order = list(commands)[i % len(commands):] + list(commands)[:i % len(commands)]
            for side in order:
                runs[side].append(measure(*commands[side], Path(out) / f"stamp-{side}{i}.json"))
    figures: Dict[str, Dict[str, object]] = {}
    for side in (side for side in runs if side != "handwritten"):
        for figure in runs[side][0]:
            ours, script = [run[figure] for run in runs[side]], [run[figure] for run in runs["handwritten"]]
            differences = sorted(a - b for a, b in zip(ours, script))
            figures.setdefault(side, {})[figure] = {
                "lightfleet": statistics.median(ours), "handwritten": statistics.median(script),
                "difference": statistics.median(differences), "from": differences[0], "to": differences[-1]}
    return {"steps": steps, "repeats": repeats, "figures": figures, "raw": runs}


def main() -> None:
    if sys.argv[1:2] == ["handwritten"]:
        return handwritten(sys.argv[2:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 50])
    parser.add_argument("--before", help="another checkout's lightfleet as a third side")
    parser.add_argument("--out", default=str(ROOT / "bench" / "startup.json"))
    args = parser.parse_args()
    results = {}
    for steps in args.steps:
        results[steps] = result = compare(steps, args.repeats, args.before)
        for side, figures in result["figures"].items():
            print(f"{side} ({steps} step(s), {args.repeats} pairs): side, script, difference (pairs from..to)")
            for figure, value in figures.items():
                print(f"  {figure:20s} {value['lightfleet']:7.3f} {value['handwritten']:7.3f}  "
                      f"{value['difference']:+.3f} ({value['from']:+.3f}..{value['to']:+.3f})")
    Path(args.out).write_text(json.dumps({"load": os.getloadavg(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
