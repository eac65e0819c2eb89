"""Does strategy=[auto] pick well, cheaply? Times `lightfleet 'strategy=[auto]'` (search mode,
search_only) on the built-in GPT (enlarged: d_model 128, 4 layers, 64 tokens) over N CPU processes,
then runs every candidate it did not prune or refuse at full length, one plain run after another
(the exhaustive sweep), and finally auto's choice and the sweep's best again, interleaved. Goals:
auto's wall time <= 25% of the sweep's; its choice's full-length samples/s >= 90% of the best's.
Both sides: OMP_NUM_THREADS=1, no validation, checkpoints, loggers or progress bar (as auto's trials).

With --memory-bound, the same for each case of MEMORY_BOUND_CASES: the memory per process
(strategy.auto.device_memory_gb) set where memory binds: no strategy alone fits, and at most a
third (or three) of the candidates do (found from auto's own estimates); the sweep then runs the
candidates that fit. One more goal: auto's choice fits, in every case.

    python bench/auto.py                                   # defaults, results in bench/auto.json
    python bench/auto.py --memory-bound --full-steps 700   # results in bench/auto_memory_bound.json
    python bench/auto.py --budget 30 --full-steps 100 --max-candidates 6 --out /tmp/auto.json
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ and bench/ when lightfleet is not installed
from bench.run import paired_ratio, side_by_side, timed  # noqa: E402
from bench.spawning import machine  # noqa: E402
from bench.throughput import LIGHTFLEET_QUIET  # noqa: E402
from runner.config.compat import load_table  # noqa: E402
from runner.core.contribution import Facts  # noqa: E402
from runner.strategies.auto import AutoConfig, Candidate, candidates  # noqa: E402

# conf/model/gpt.yaml's decoder is so small (about 15 ms a step) that process start-up would be
# most of every run; this one takes about 0.12 s a step with 2 processes on one thread each.
GPT = ["model=gpt", "data=language_model", "model.d_model=128", "model.n_layers=4", "model.seq_len=64",
       "data.seq_len=64"]
# As auto's trials (runner/command/autotune.py TRIAL_TRAINER): training steps only, so that the sweep's wall
# time is not inflated by work the trials skip.
LEAN = [*LIGHTFLEET_QUIET, "trainer.limit_val_batches=0"]
# Statuses auto gives candidates it would never train: the sweep leaves them out too.
NOT_RUNNABLE = ("pruned", "refused")
# --memory-bound's cases: processes, and at most which share and how many of the candidates fit.
MEMORY_BOUND_CASES = {"2 processes, a third fit": (2, 1 / 3, None), "2 processes, at most three fit": (2, 1.0, 3),
                      "1 process, a third fit": (1, 1 / 3, None)}


def run_auto(args: argparse.Namespace, out_dir: Path, *extra: str) -> Dict[str, Any]:
    """auto's search, timed: its wall time, its choice.yaml and its candidates.csv rows."""
    command = [sys.executable, "-m", "runner", "strategy=[auto]", *GPT, *LEAN, f"trainer.devices={args.devices}",
               "strategy.auto.search_only=true", f"strategy.auto.budget_s={args.budget}",
               f"strategy.auto.trial_steps={args.trial_steps}", f"paths.output_dir={out_dir}", *extra]
    wall_s = timed(command)
    choice = yaml.safe_load((out_dir / "auto" / "choice.yaml").read_text())
    with (out_dir / "auto" / "candidates.csv").open(newline="") as table:
        rows = list(csv.DictReader(table))
    return {"wall_s": wall_s, "choice": choice, "rows": rows, "command": command}


def derived_candidates(choice: Dict[str, Any]) -> Dict[str, Candidate]:
    """auto's candidates again, by label, from the pure API and the facts and knobs choice.yaml
    records: their strategies and knobs come from here, not from parsing labels."""
    listed = candidates(Facts(**choice["facts"]), AutoConfig(**choice["knobs"]), load_table().allowed)
    return {c.label: c for c in listed}


def memory_bound_limit(args: argparse.Namespace, out_dir: Path, share: float, count: Optional[int]) -> int:
    """Bytes per process where no strategy alone fits and at most `share` (and `count`) of the
    candidates do, the largest such limit, from the estimates of auto's rules on this model (no
    trial: the facts only)."""
    rules_only = run_auto(args, out_dir, "strategy.auto.mode=rules", "strategy.auto.device_memory_gb=1000")
    facts, rows = Facts(**rules_only["choice"]["facts"]), load_table().allowed
    for limit in sorted({c.memory.total for c in candidates(facts, AutoConfig(), rows)}, reverse=True):
        listed = candidates(dataclasses.replace(facts, device_memory_bytes=int(limit)), AutoConfig(), rows)
        fitting = [c for c in listed if c.status != "pruned"]
        if fitting and all(len(c.strategies) >= 2 for c in fitting) and len(fitting) <= min(
                share * len(listed), count or len(listed)):
            return int(limit)
    sys.exit(f"bench: no memory limit leaves every single strategy out while at most {share:.0%} "
             f"(and {count}) of the candidates fit")


def to_sweep(rows: List[Dict[str, str]], chosen: str, cap: Optional[int]) -> List[Dict[str, str]]:
    """The rows auto could have trained, in its order (fastest estimate first); with `cap`, the
    first `cap` of them plus the chosen one, so that its full-length figure exists."""
    runnable = [row for row in rows if row["status"] not in NOT_RUNNABLE]
    if cap is None:
        return runnable
    kept = runnable[:cap]
    return kept + [row for row in runnable[cap:] if row["strategies"] == chosen]


def overrides(c: Candidate, batch_size: int) -> List[str]:
    """The command-line overrides that train candidate `c` as a plain run."""
    knobs = [f"strategy.{name}.{knob}={value}"
             for name, values in c.strategies.items() for knob, value in values.items()]
    if "gradient_merge" in c.strategies:
        # As auto's trials do (runner/command/autotune.py with_strategies): k micro-batches of batch / k
        # keep the global batch the same.
        knobs.append(f"data.batch_size={batch_size // c.strategies['gradient_merge']['k_steps']}")
    return [f"strategy=[{','.join(c.strategies)}]", *knobs]


def full_command(args: argparse.Namespace, c: Candidate, batch_size: int, run_dir: Path) -> List[str]:
    """A full-length plain run of `c` into `run_dir`."""
    return [sys.executable, "-m", "runner", *GPT, *LEAN, f"trainer.devices={args.devices}",
            f"trainer.max_steps={args.full_steps}", *overrides(c, batch_size), f"paths.output_dir={run_dir}"]


def samples_per_s(run_dir: Path) -> float:
    return yaml.safe_load((run_dir / "results.yaml").read_text())["samples_per_s"]


def run_sweep(args: argparse.Namespace, auto: Dict[str, Any], out_dir: Path) -> List[Dict[str, Any]]:
    """Every runnable candidate at full length, one after another; a row per candidate."""
    derived = derived_candidates(auto["choice"])
    batch_size = auto["choice"]["facts"]["batch_size"]
    swept = to_sweep(auto["rows"], auto["choice"]["chosen"], args.max_candidates)
    table = []
    for index, row in enumerate(swept):
        if row["strategies"] not in derived:
            sys.exit(f"bench: candidates.csv lists {row['strategies']!r}, which the pure API does not derive "
                     f"from choice.yaml's facts: auto's candidates and runner.strategies.auto disagree")
        c, run_dir = derived[row["strategies"]], out_dir / row["candidate"]
        wall_s = timed(full_command(args, c, batch_size, run_dir))
        trial = float(row["samples_per_s"]) if row["samples_per_s"] else None
        table.append({"candidate": c.label, "auto_status": row["status"], "trial_samples_per_s": trial,
                      "full_samples_per_s": samples_per_s(run_dir), "full_wall_s": wall_s,
                      "overrides": overrides(c, batch_size)})
        print(f"sweep {index + 1}/{len(swept)} {c.label}: {table[-1]['full_samples_per_s']:,.1f} samples/s, "
              f"{wall_s:.1f} s", flush=True)
    return table


def confirm(args: argparse.Namespace, auto: Dict[str, Any], best: str, out_dir: Path) -> Optional[Dict[str, Any]]:
    """auto's choice and the sweep's best again at full length, interleaved (chosen, best, chosen,
    ...): one run of each differs by more than the 10% the goal reads (runs of one command differ
    by 15-25% on this shared machine), and the best of 20 single runs is biased upward. Median
    over the back-to-back pairs of chosen / best samples/s; None when auto chose the best."""
    chosen = auto["choice"]["chosen"]
    if chosen == best or args.confirm_repeats == 0:
        return None
    derived, batch_size = derived_candidates(auto["choice"]), auto["choice"]["facts"]["batch_size"]

    def runs_of(label: str, side: str) -> Callable[[int], List[str]]:
        return lambda i: full_command(args, derived[label], batch_size, out_dir / f"{side}{i}")

    print(f"confirming: {chosen} vs {best}, {args.confirm_repeats} interleaved pairs ...", flush=True)
    side_by_side(runs_of(chosen, "a"), runs_of(best, "b"), args.confirm_repeats)  # "a", "b": as paired_ratio reads
    measured = {side: [samples_per_s(out_dir / f"{side}{i}") for i in range(args.confirm_repeats)] for side in "ab"}
    ratio = paired_ratio(measured)
    return {"chosen_samples_per_s": measured["a"], "best_samples_per_s": measured["b"], "ratio": ratio,
            "met": ratio >= 0.90}


def verdict(auto: Dict[str, Any], table: List[Dict[str, Any]], runnable: int) -> Dict[str, Any]:
    """The two ratios the goals are read on (the second, from the sweep's single runs)."""
    chosen = auto["choice"]["chosen"]
    sweep_s = sum(row["full_wall_s"] for row in table)
    best = max(table, key=lambda row: row["full_samples_per_s"])
    chosen_full = next(row["full_samples_per_s"] for row in table if row["candidate"] == chosen)
    wall_ratio, speed_ratio = auto["wall_s"] / sweep_s, chosen_full / best["full_samples_per_s"]
    chosen_row = next(row for row in auto["rows"] if row["strategies"] == chosen)
    return {"chosen": chosen, "chosen_fits": chosen_row["status"] not in NOT_RUNNABLE,
            "confirmation": auto["choice"]["reason"] or "the top two trials were not within noise", "auto_wall_s": auto["wall_s"], "sweep_wall_s": sweep_s, "wall_ratio": wall_ratio,
            "wall_goal": "<= 0.25", "wall_met": wall_ratio <= 0.25, "best": best["candidate"],
            "best_full_samples_per_s": best["full_samples_per_s"], "chosen_full_samples_per_s": chosen_full,
            "speed_ratio": speed_ratio, "speed_goal": ">= 0.90", "speed_met": speed_ratio >= 0.90,
            "swept": len(table), "runnable": runnable, "capped": len(table) < runnable}


def met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def report(figures: Dict[str, Any], table: List[Dict[str, Any]], confirmed: Optional[Dict[str, Any]]) -> str:
    lines = ["| candidate | auto's status | trial samples/s | full-length samples/s | full-length wall s |",
             "| --- | --- | --- | --- | --- |"]
    for row in sorted(table, key=lambda row: -row["full_samples_per_s"]):
        trial = f"{row['trial_samples_per_s']:,.1f}" if row["trial_samples_per_s"] is not None else "—"
        mark = " (chosen)" if row["candidate"] == figures["chosen"] else ""
        lines.append(f"| {row['candidate']}{mark} | {row['auto_status']} | {trial} "
                     f"| {row['full_samples_per_s']:,.1f} | {row['full_wall_s']:.1f} |")
    capped = (f" (CAPPED: {figures['swept']} of {figures['runnable']} runnable candidates; the full sweep "
              f"would take longer)" if figures["capped"] else "")
    lines += ["", f"auto's choice fits by its estimate: {figures['chosen_fits']} (goal: always: "
                  f"{met(figures['chosen_fits'])}); confirmation: {figures['confirmation']}",
              f"auto wall {figures['auto_wall_s']:.1f} s / sweep wall {figures['sweep_wall_s']:.1f} s{capped} "
                  f"= {figures['wall_ratio']:.3f} (goal <= 0.25: {met(figures['wall_met'])})",
              f"sweep: chosen {figures['chosen']} {figures['chosen_full_samples_per_s']:,.1f} / best {figures['best']} "
              f"{figures['best_full_samples_per_s']:,.1f} samples/s = {figures['speed_ratio']:.3f} "
              f"(goal >= 0.90: {met(figures['speed_met'])})"]
    if confirmed:
        pairs = ", ".join(f"{a:,.1f}/{b:,.1f}" for a, b in zip(confirmed["chosen_samples_per_s"],
                                                              confirmed["best_samples_per_s"]))
        lines.append(f"confirmed, interleaved pairs (chosen/best samples/s: {pairs}): median ratio "
                     f"{confirmed['ratio']:.3f} (goal >= 0.90: {met(confirmed['met'])})")
    return "\n".join(lines)


def run_case(args: argparse.Namespace, work: Path, limit: List[str]) -> Dict[str, Any]:
    """auto's search, the sweep and the confirmation of one case; its report printed."""
    print(f"auto: searching, {args.devices} processes, budget {args.budget:g} s, {args.trial_steps} steps a trial ...",
          flush=True)
    auto = run_auto(args, work / "auto", *limit)
    print(f"auto: chose {auto['choice']['chosen']} in {auto['wall_s']:.1f} s", flush=True)
    table = run_sweep(args, auto, work / "full")
    runnable = sum(row["status"] not in NOT_RUNNABLE for row in auto["rows"])
    figures = verdict(auto, table, runnable)
    confirmed = confirm(args, auto, figures["best"], work / "confirm")
    print(report(figures, table, confirmed), flush=True)
    return {"devices": args.devices, "auto_overrides": [arg for arg in auto["command"][3:] if not arg.startswith("paths.")],
            "memory_limit": limit, "figures": figures, "confirmed": confirmed, "table": table,
            "auto_candidates": auto["rows"]}


def memory_bound_cases(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    """Every case of MEMORY_BOUND_CASES, and what they add up to."""
    cases = {}
    for name, (devices, share, count) in MEMORY_BOUND_CASES.items():
        case_args = argparse.Namespace(**{**vars(args), "devices": devices})
        limit = memory_bound_limit(case_args, work / f"{devices}_{share:.2f}_{count}" / "estimates", share, count)
        gib = f"{math.ceil(limit / 2**30 * 1e9) / 1e9:.9f}"  # rounded up: the candidate at the limit fits
        print(f"\n== {name}: strategy.auto.device_memory_gb={gib} ({limit / 2**20:.1f} MiB per process)", flush=True)
        cases[name] = run_case(case_args, work / f"{devices}_{share:.2f}_{count}", [f"strategy.auto.device_memory_gb={gib}"])
    figures = [case["figures"] for case in cases.values()]
    summary = {"cases": len(cases), "infeasible_choices": sum(not f["chosen_fits"] for f in figures),
               "speed_ratios": [f["speed_ratio"] for f in figures], "wall_ratios": [f["wall_ratio"] for f in figures],
               "confirmations": sum("both ran again" in f["confirmation"] for f in figures),
               "confirmations_that_changed_the_choice": sum("took the lead" in f["confirmation"] for f in figures)}
    print(f"\nover the {len(cases)} cases: {json.dumps(summary)}")
    return {"cases": cases, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=60.0, help="strategy.auto.budget_s: seconds of trials")
    parser.add_argument("--trial-steps", type=int, default=20, help="strategy.auto.trial_steps")
    parser.add_argument("--full-steps", type=int, default=150, help="trainer.max_steps of each sweep run")
    parser.add_argument("--devices", type=int, default=2, help="processes (trainer.devices) on both sides")
    parser.add_argument("--max-candidates", type=int, default=None,
                        help="sweep only the first N runnable candidates (+ the chosen one); says so in the output")
    parser.add_argument("--confirm-repeats", type=int, default=3,
                        help="interleaved full-length pairs of the chosen and the sweep's best (0: none)")
    parser.add_argument("--memory-bound", action="store_true",
                        help="set the memory where no strategy alone fits and at most a third of the candidates do")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default: bench/auto.json, or bench/auto_memory_bound.json)")
    args = parser.parse_args()
    args.out = args.out or ROOT / "bench" / ("auto_memory_bound.json" if args.memory_bound else "auto.json")

    with tempfile.TemporaryDirectory() as tmp:
        found = memory_bound_cases(args, Path(tmp)) if args.memory_bound else run_case(args, Path(tmp), [])
    results = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
               "settings": {key: (str(value.relative_to(ROOT)) if isinstance(value, Path) and value.is_relative_to(ROOT)
                                  else str(value) if isinstance(value, Path) else value)
                            for key, value in vars(args).items()},
               "model": GPT, **found}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
