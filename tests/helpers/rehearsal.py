"""A rehearsed rank's process (runner/rank/rehearse.py) over a run directory the command would
write, as `lightfleet rehearse` starts it: one fresh process per rank."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from runner.command.planning import plan_for
from runner.config.checks import validate
from runner.config.compose import compose_config
from runner.records.run_dir import create_run_dir
from tests.helpers.commands import command_env


def rehearse(run_dir: Path, overrides: List[str], rank: int, steps: int = 2,
             device_type: str = "cpu") -> Tuple[subprocess.CompletedProcess, Optional[Dict[str, Any]]]:
    """The rank's process over a run directory the command would write; (the process, its report)."""
    if not run_dir.exists():
        spec = validate(compose_config([*overrides, f"paths.output_dir={run_dir}"]))
        create_run_dir(spec.cfg, plan_for(spec), ["lightfleet", "rehearse", *overrides], run_dir)
    out = run_dir / f"rank{rank}.json"
    done = subprocess.run([sys.executable, "-m", "runner.rank.rehearse", str(run_dir), "--rank", str(rank),
                           "--steps", str(steps), "--device-type", device_type, "--out", str(out)],
                          env=command_env(), capture_output=True, text=True, timeout=600)
    return done, json.loads(out.read_text()) if done.returncode == 0 else None


def zero_partition(param_groups: List[Dict[str, Any]], world: int) -> Tuple[List[int], List[int]]:
    """ZeroRedundancyOptimizer's partition, written out: whole tensors, each group's largest first,
    each to the rank holding the fewest elements so far. (elements per rank, tensors per rank)."""
    held, counts = [0] * world, [0] * world
    for group in param_groups:
        for parameter in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = held.index(min(held))
            held[rank] += parameter.numel()
            counts[rank] += 1
    return held, counts
