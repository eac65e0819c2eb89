"""What a multi-process run on CPUs costs to start: ranks forked from the command (the default on
CPUs, docs/reliability.md "How ranks start") against fresh `python -m runner.train` ranks
(LIGHTFLEET_FRESH_RANKS=1, as where CUDA is), on the same 2-process quickstart run of a few steps,
interleaved. Measures the CPU seconds of the command and its ranks (user + system, from the
children's resource usage) and the wall seconds. Goal: forked CPU <= 0.5 x fresh.

    python bench/launch.py                      # 5 pairs, results in bench/launch.json
    python bench/launch.py --repeats 3 --out /tmp/launch.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ when lightfleet is not installed
from bench.spawning import machine  # noqa: E402
from runner.command.launch import FRESH_RANKS  # noqa: E402

RUN = ["experiment=quickstart", "trainer.devices=2", "trainer.max_steps=10", "trainer.val_check_interval=5",
       "trainer.enable_progress_bar=false"]


def cost(output_dir: str, fresh: bool) -> Dict[str, float]:
    """One run's CPU and wall seconds."""
    env = {key: value for key, value in os.environ.items() if key != FRESH_RANKS}
    if fresh:
        env[FRESH_RANKS] = "1"
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run([sys.executable, "-m", "runner", *RUN, f"paths.output_dir={output_dir}"], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "launch.json"))
    args = parser.parse_args()
    runs: Dict[str, List[Dict[str, float]]] = {"forked": [], "fresh": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # forked, fresh, forked, ...: drifting load hits both alike
            runs["forked"].append(cost(f"{tmp}/forked{i}", fresh=False))
            runs["fresh"].append(cost(f"{tmp}/fresh{i}", fresh=True))
    ratio = statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in zip(runs["forked"], runs["fresh"]))
    median = {name: {key: statistics.median(run[key] for run in kept) for key in ("cpu_s", "wall_s")}
              for name, kept in runs.items()}
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "command": ["lightfleet", *RUN], "median": median, "cpu_ratio": ratio,
              "goal": "forked cpu <= 0.5 x fresh", "met": ratio <= 0.5, "raw": runs}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"2-process quickstart, {args.repeats} pairs: forked ranks {median['forked']['cpu_s']:.1f} s of CPU "
          f"({median['forked']['wall_s']:.1f} s wall), fresh ranks {median['fresh']['cpu_s']:.1f} s of CPU "
          f"({median['fresh']['wall_s']:.1f} s wall): CPU ratio {ratio:.2f} (goal <= 0.5: "
          f"{'met' if result['met'] else 'NOT met'}); results in {args.out}")


if __name__ == "__main__":
    main()
