"""lightfleet benchmarks: each one a ratio of two things measured side by side, interleaved, in one
run (machines are noisy: compare, don't clock). Prints a table and writes a JSON results file.

    python bench/run.py                       # every benchmark, results in bench/results.json
    python bench/run.py refusal --repeats 9   # one benchmark
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent


# One torch thread on both sides: threads spin-waiting on a shared machine add noise larger than
# the overheads measured here, and both sides get the same setting.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def timed(command: List[str], expect: int = 0) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=ENV)
    elapsed = time.perf_counter() - start
    if done.returncode != expect:
        sys.exit(f"bench: {' '.join(command)} exited {done.returncode} (expected {expect}):\n{done.stderr[-2000:]}")
    return elapsed


def side_by_side(a: Callable[[int], List[str]], b: Callable[[int], List[str]], repeats: int,
                 expect_a: int = 0) -> Dict[str, List[float]]:
    """Run a, b, a, b, ... so that drifting machine load hits both alike."""
    times: Dict[str, List[float]] = {"a": [], "b": []}
    for i in range(repeats):
        times["a"].append(timed(a(i), expect_a))
        times["b"].append(timed(b(i)))
    return times


def paired_ratio(times: Dict[str, List[float]]) -> float:
    """Median over the back-to-back pairs of a/b: each pair saw the same machine load."""
    return statistics.median(a / b for a, b in zip(times["a"], times["b"]))


def end_to_end(repeats: int, steps: int) -> Dict[str, object]:
    """lightfleet's whole command (compose, check, plan, record, build, fit) vs a hand-written
    Lightning script training the same model on the same data for the same steps. Goal <= 1.03."""
    with tempfile.TemporaryDirectory() as tmp:
        times = side_by_side(
            lambda i: [sys.executable, "-m", "runner", "experiment=quickstart", f"trainer.max_steps={steps}",
                       "trainer.enable_progress_bar=false", f"paths.output_dir={tmp}/lightfleet{i}"],
            lambda i: [sys.executable, "bench/handwritten.py", "--steps", str(steps), "--out", f"{tmp}/handwritten{i}"],
            repeats)
    ratio = paired_ratio(times)
    return {"lightfleet_s": statistics.median(times["a"]), "handwritten_s": statistics.median(times["b"]),
            "ratio": ratio, "goal": "ratio <= 1.03", "met": ratio <= 1.03, "steps": steps, "raw": times}


def refusal(repeats: int, steps: int) -> Dict[str, object]:
    """Time to refuse a forbidden combination vs time to merely `import pytorch_lightning`.
    Goal: refusal <= 0.3 s and at least 5x faster."""
    times = side_by_side(lambda i: [sys.executable, "-m", "runner", "strategy=[lars,lamb]"],
                         lambda i: [sys.executable, "-c", "import pytorch_lightning"], repeats, expect_a=2)
    refuse, speedup = statistics.median(times["a"]), 1 / paired_ratio(times)
    return {"refusal_s": refuse, "import_lightning_s": statistics.median(times["b"]), "speedup": speedup,
            "goal": "refusal <= 0.3 s and speedup >= 5", "met": refuse <= 0.3 and speedup >= 5, "raw": times}


BENCHMARKS = {"end_to_end": end_to_end, "refusal": refusal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side (median taken)")
    parser.add_argument("--steps", type=int, default=3000, help="training steps of the end-to-end runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")

    results = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores", "benchmarks": {}}
    for name in args.names or list(BENCHMARKS):
        print(f"{name}: running {args.repeats} x 2 ...", flush=True)
        result = BENCHMARKS[name](args.repeats, args.steps)
        results["benchmarks"][name] = result
        summary = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items() if k != "raw"}
        print(f"{name}: {summary}", flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
