"""The command's time before the first step and after fit (issue 43): lightfleet's quickstart
against bench/handwritten.py, interleaved, each process stamped by the same callback (`Stamp`):
seconds from the process's start to its first training step and from fit's end to its exit, wall
and CPU (the machine is shared: CPU time says what the process itself did).

    python bench/startup.py --repeats 5 --steps 1 50     # results in bench/startup.json
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
from typing import Dict, List

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


def sides(steps: int, out: str, i: int) -> Dict[str, List[str]]:
    return {
        "lightfleet": [sys.executable, "-m", "runner", "experiment=quickstart", f"trainer.max_steps={steps}",
                       "trainer.enable_progress_bar=false", f"paths.output_dir={out}/lightfleet{i}",
                       "+callbacks.stamp._target_=bench.startup.Stamp"],
        "handwritten": [sys.executable, "bench/startup.py", "handwritten", "--steps", str(steps),
                        "--out", f"{out}/handwritten{i}"],
    }


def measure(command: List[str], stamp: Path) -> Dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**ENV, STAMP_ENV: str(stamp)})
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(f"bench: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    marks = json.loads(stamp.read_text())
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"to_first_step_s": marks["first_step"] - start, "to_first_step_cpu_s": marks["first_step_cpu"],
            "fit_s": marks["fit_end"] - marks["first_step"], "after_fit_s": end - marks["fit_end"],
            "after_fit_cpu_s": cpu - marks["fit_end_cpu"], "wall_s": end - start, "cpu_s": cpu}


def compare(steps: int, repeats: int) -> Dict[str, object]:
    runs: Dict[str, List[Dict[str, float]]] = {"lightfleet": [], "handwritten": []}
    with tempfile.TemporaryDirectory() as out:
        for i in range(repeats):
            order = list(runs) if i % 2 == 0 else list(reversed(runs))  # neither side always first
            for side in order:
                runs[side].append(measure(sides(steps, out, i)[side], Path(out) / f"stamp-{side}{i}.json"))
    figures: Dict[str, object] = {}
    for figure in runs["lightfleet"][0]:
        per_side = {side: [run[figure] for run in runs[side]] for side in runs}
        differences = sorted(a - b for a, b in zip(per_side["lightfleet"], per_side["handwritten"]))
        figures[figure] = {**{side: statistics.median(values) for side, values in per_side.items()},
                           "difference": statistics.median(differences),
                           "difference_from": differences[0], "difference_to": differences[-1]}
    return {"steps": steps, "repeats": repeats, "figures": figures, "raw": runs}


def main() -> None:
    if sys.argv[1:2] == ["handwritten"]:
        return handwritten(sys.argv[2:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 50])
    parser.add_argument("--out", default=str(ROOT / "bench" / "startup.json"))
    args = parser.parse_args()
    results = {}
    for steps in args.steps:
        results[steps] = result = compare(steps, args.repeats)
        print(f"{steps} step(s), {args.repeats} pairs, medians (lightfleet - script: median, from..to):")
        for figure, value in result["figures"].items():
            print(f"  {figure:22s} {value['lightfleet']:7.3f} {value['handwritten']:7.3f}  "
                  f"{value['difference']:+.3f} ({value['difference_from']:+.3f}..{value['difference_to']:+.3f})")
    Path(args.out).write_text(json.dumps({"load": os.getloadavg(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
