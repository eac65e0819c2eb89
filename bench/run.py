"""lightfleet benchmarks: each one a ratio of two things measured side by side, interleaved, in one
run (machines are noisy: compare, don't clock). Prints a table and writes a JSON results file.

    python bench/run.py                       # every benchmark, results in bench/results.json
    python bench/run.py refusal --repeats 9   # one benchmark
    python bench/run.py measure               # the cost of runs measuring themselves (runner/rank/measure.py)
    python bench/run.py callbacks             # what each callback of a run costs per step
    python bench/run.py validation_checkpoints  # a validation's top-k file and last.ckpt, lightfleet vs Lightning
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ for the in-process benchmarks when lightfleet is not installed


# One torch thread on both sides: threads spin-waiting on a shared machine add noise larger than
# the overheads measured here, and both sides get the same setting.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def timed(command: List[str], expect: int = 0, cpu: Optional[List[float]] = None) -> float:
    """The wall seconds `command` took; its CPU seconds (user and system, its processes') appended
    to `cpu` when given: less swayed than the wall by other jobs on a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=ENV)
    elapsed = time.perf_counter() - start
    if done.returncode != expect:
        sys.exit(f"bench: {' '.join(command)} exited {done.returncode} (expected {expect}):\n{done.stderr[-2000:]}")
    if cpu is not None:
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return elapsed


def side_by_side(a: Callable[[int], List[str]], b: Callable[[int], List[str]], repeats: int,
                 expect_a: int = 0) -> Dict[str, List[float]]:
    """Run a, b, a, b, ... so that drifting machine load hits both alike: wall seconds in "a" and
    "b", CPU seconds in "a_cpu" and "b_cpu"."""
    times: Dict[str, List[float]] = {"a": [], "b": [], "a_cpu": [], "b_cpu": []}
    for i in range(repeats):
        times["a"].append(timed(a(i), expect_a, times["a_cpu"]))
        times["b"].append(timed(b(i), cpu=times["b_cpu"]))
    return times


def paired_ratio(times: Dict[str, List[float]]) -> float:
    """Median over the back-to-back pairs of a/b: each pair saw the same machine load."""
    return statistics.median(a / b for a, b in zip(times["a"], times["b"]))


def end_to_end(repeats: int, steps: int) -> Dict[str, object]:
    """lightfleet's whole command (compose, check, plan, record, build, fit) vs a hand-written
    Lightning script training the same model on the same data for the same steps, with the same
    validation cadence, CSV logger and checkpoints, the output a pipe (as under a scheduler). Two
    rows: the bar off on both sides; and as users run them, lightfleet's defaults (its steps bar)
    against the script with Lightning's default bar. Goal <= 1.03 in both."""
    rows: Dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row, bar in (("bar_off", False), ("as_users_run_it", True)):
            times = side_by_side(
                lambda i: [sys.executable, "-m", "runner", "experiment=quickstart", f"trainer.max_steps={steps}",
                           *([] if bar else ["trainer.enable_progress_bar=false"]),
                           f"paths.output_dir={tmp}/lightfleet-{row}{i}"],
                lambda i: [sys.executable, "bench/handwritten.py", "--steps", str(steps),
                           "--out", f"{tmp}/handwritten-{row}{i}", *(["--progress-bar"] if bar else [])],
                repeats)
            pairs = sorted(a / b for a, b in zip(times["a"], times["b"]))
            cpu = {"a": times["a_cpu"], "b": times["b_cpu"]}
            rows[row] = {"lightfleet_s": statistics.median(times["a"]), "handwritten_s": statistics.median(times["b"]),
                         "ratio": paired_ratio(times), "pairs_from": pairs[0], "pairs_to": pairs[-1],
                         "lightfleet_cpu_s": statistics.median(cpu["a"]), "handwritten_cpu_s": statistics.median(cpu["b"]),
                         "cpu_ratio": paired_ratio(cpu), "raw": times}
    return {**rows, "goal": "ratio <= 1.03 in both rows", "steps": steps,
            "met": all(row["ratio"] <= 1.03 for row in rows.values())}


def refusal(repeats: int, steps: int) -> Dict[str, object]:
    """Time to refuse a forbidden combination vs time to merely `import pytorch_lightning`.
    Goal: refusal <= 0.3 s and at least 5x faster."""
    times = side_by_side(lambda i: [sys.executable, "-m", "runner", "strategy=[lars,lamb]"],
                         lambda i: [sys.executable, "-c", "import pytorch_lightning"], repeats, expect_a=2)
    refuse, speedup = statistics.median(times["a"]), 1 / paired_ratio(times)
    return {"refusal_s": refuse, "import_lightning_s": statistics.median(times["b"]), "speedup": speedup,
            "goal": "refusal <= 0.3 s and speedup >= 5", "met": refuse <= 0.3 and speedup >= 5, "raw": times}


# Steps left out at the start of the measure benchmark's runs, as RunMeter leaves out its warm-up.
WARMUP_STEPS = 10


def quickstart_measuring(enabled: str, steps: int, tmp: str) -> Callable[[int], List[str]]:
    """The quickstart experiment with measure.enabled set, its steps after warm-up timed by the same
    injected callback on both sides (bench/throughput.py's StepWindow, into a JSON file); validation
    and checkpoints off so the timed window holds training steps only."""
    def command(i: int) -> List[str]:
        window = "+callbacks.window."
        return [sys.executable, "-m", "runner", "experiment=quickstart", f"trainer.max_steps={steps}",
                f"measure.enabled={enabled}", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0",
                "callbacks=none", "trainer.enable_checkpointing=false", f"paths.output_dir={tmp}/{enabled}{i}",
                f"{window}_target_=bench.throughput.StepWindow", f"{window}warmup={WARMUP_STEPS}",
                f"{window}steps={steps}", f"{window}out={tmp}/window-{enabled}{i}.json"]
    return command


class HookClock:
    """Wraps every hook `callback`'s class overrides so that each call's duration (time.perf_counter)
    is kept in `durations[hook]`; notes when the first call began and the last one ended."""

    def __init__(self, callback: Any, base: type) -> None:
        self.durations: Dict[str, List[float]] = defaultdict(list)
        self.first = self.last = 0.0
        for name in dir(type(callback)):
            hook = getattr(type(callback), name)  # None: a hook Lightning skips (runner/rank/hooks.py)
            if name.startswith("on_") and callable(hook) and hook is not getattr(base, name, None):
                setattr(callback, name, self._timed(name, getattr(callback, name)))

    def _timed(self, name: str, hook: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.last = time.perf_counter()
                self.first = self.first or start
                self.durations[name].append(self.last - start)
        return timed

    def figures(self, steps: int) -> Dict[str, object]:
        """Seconds inside the hooks as a share of the seconds from the first hook's start to the last
        one's end (on_train_start to on_train_end: all of training); and the share of a step that
        logs nothing (the hooks' median calls), which a longer logging interval tends to."""
        training_s = self.last - self.first
        inside_s = sum(sum(calls) for calls in self.durations.values())
        median_s = {name: statistics.median(calls) for name, calls in self.durations.items()}
        per_step_s = median_s.get("on_train_batch_start", 0.0) + median_s.get("on_train_batch_end", 0.0)
        return {"hook_share": inside_s / training_s, "step_ms": training_s / steps * 1e3,
                "hooks_us_per_step": inside_s / steps * 1e6, "quiet_step_share": per_step_s * steps / training_s,
                "by_hook": {name: {"calls": len(calls), "total_s": sum(calls), "median_us": median_s[name] * 1e6}
                            for name, calls in self.durations.items()}}


def meter_hook_share(steps: int) -> Dict[str, object]:
    """In this process: the quickstart model and data trained by a plain pl.Trainer (as
    bench/handwritten.py does, but without validation, checkpoints and logger, so all the time
    counted is training steps: the strictest share) with a RunMeter whose hooks time themselves."""
    import pytorch_lightning as pl
    import torch

    from runner.rank.build import instantiate_checked
    from runner.config.compose import compose_config
    from runner.rank.measure import RunMeter

    torch.set_num_threads(1)  # as the subprocesses (ENV)
    cfg = compose_config(["experiment=quickstart"])
    pl.seed_everything(cfg.seed, verbose=False)
    meter = RunMeter(cfg.measure.warmup_steps)
    clock = HookClock(meter, pl.Callback)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=cfg.trainer.log_every_n_steps,
                         limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[meter])
    trainer.fit(instantiate_checked("model", cfg.model), datamodule=instantiate_checked("data", cfg.data))
    return clock.figures(steps)


def measured_vs_not(repeats: int, steps: int) -> Dict[str, Dict[str, List[float]]]:
    """Quickstart runs with measure.enabled=true (a) and false (b), interleaved: the seconds of their
    steps after warm-up and of their whole processes."""
    with tempfile.TemporaryDirectory() as tmp:
        measured, unmeasured = quickstart_measuring("true", steps, tmp), quickstart_measuring("false", steps, tmp)
        wall = side_by_side(measured, unmeasured, repeats)
        steady = {side: [json.loads(Path(f"{tmp}/window-{enabled}{i}.json").read_text())["seconds"]
                         for i in range(repeats)] for side, enabled in (("a", "true"), ("b", "false"))}
    return {"steady_s": steady, "wall_s": wall}


def measurement_overhead(repeats: int, steps: int) -> Dict[str, object]:
    """What lightfleet measuring itself (runner/rank/measure.py's RunMeter) costs, on the quickstart MLP,
    whose steps are short (the shorter the step, the larger the share): steady-state time of the
    steps after warm-up with measure.enabled=true over false, interleaved; and, because run-to-run
    noise exceeds 1%, the time inside RunMeter's hooks as a share of training time, in-process
    (median of `repeats` runs). Goal: hooks <= 1% of step time."""
    times = measured_vs_not(repeats, steps)
    runs = sorted((meter_hook_share(steps) for _ in range(repeats)), key=lambda run: run["hook_share"])
    median_run = runs[len(runs) // 2]
    return {"steady_state_ratio": paired_ratio(times["steady_s"]), "whole_run_ratio": paired_ratio(times["wall_s"]),
            "hook_share": median_run["hook_share"], "goal": "hook_share <= 0.01",
            "met": median_run["hook_share"] <= 0.01, "steps": steps, "warmup_steps": WARMUP_STEPS,
            "in_process": median_run, "raw": {**times, "hook_shares": [run["hook_share"] for run in runs]}}


def callback_costs(repeats: int, steps: int) -> Dict[str, object]:
    """What each callback of a lightfleet run costs per step, as users run it (the quickstart with its
    defaults: the steps bar on, the output a pipe, CSV logger, checkpoints, validation every 16
    steps): bench/throughput.py's CallbackClock times every hook of every callback; medians over
    `repeats` runs. Goal: each lightfleet callback <= 1% of the step."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i in range(repeats):
            timed([sys.executable, "-m", "runner", "experiment=quickstart", f"trainer.max_steps={steps}",
                   f"paths.output_dir={tmp}/run{i}", "+callbacks.clock._target_=bench.throughput.CallbackClock",
                   f"+callbacks.clock.out={tmp}/clock{i}.json"])
            runs.append(json.loads(Path(f"{tmp}/clock{i}.json").read_text()))
    names = runs[0]["callbacks"]
    costs = {name: {figure: statistics.median(run["callbacks"][name][figure] for run in runs)
                    for figure in ("us_per_step", "share")} for name in names}
    for name, cost in costs.items():
        cost["hooks_us_per_step"] = {hook: statistics.median(run["callbacks"][name]["hooks_us_per_step"][hook]
                                                             for run in runs)
                                     for hook in runs[0]["callbacks"][name]["hooks_us_per_step"]}
    own = {name: cost for name, cost in costs.items() if name != "ModelCheckpoint"}  # Lightning's: both sides have it
    return {"step_ms": statistics.median(run["step_ms"] for run in runs), "callbacks": costs,
            "goal": "each of lightfleet's callbacks <= 1% of the step", "steps": steps,
            "met": all(cost["share"] <= 0.01 for cost in own.values()), "raw": runs}


def validation_checkpoints(repeats: int, steps: int) -> Dict[str, object]:
    """What one validation's checkpoints cost the training step, as ModelCheckpoint(save_last=True)
    writes them: the step's top-k file, then last.ckpt of the same bytes, the previous top-k file
    removed. lightfleet's AtomicCheckpointIO (whole files with manifests, durable: fsynced; the disk's
    part in its background thread, whose time is reported apart: it is waited for before the next
    validation, as the 16 steps between two validations give it) against Lightning's
    TorchCheckpointIO (neither, all on the step), on the quickstart's checkpoint after 20 steps, in
    this directory's filesystem; interleaved, median of `repeats` x 20 validations each."""
    import shutil

    import pytorch_lightning as pl
    import torch
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

    from runner.config.compose import compose_config
    from runner.rank.build import instantiate_checked
    from runner.rank.checkpoint_io import AtomicCheckpointIO

    torch.set_num_threads(1)
    cfg = compose_config(["experiment=quickstart"])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=20, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(instantiate_checked("model", cfg.model), datamodule=instantiate_checked("data", cfg.data))
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    where = Path(tempfile.mkdtemp(prefix="bench-validation-checkpoints-", dir=ROOT))
    sides = {"lightfleet": AtomicCheckpointIO(), "lightning": TorchCheckpointIO()}
    times: Dict[str, List[float]] = {side: [] for side in sides}
    background: List[float] = []  # lightfleet's writer, after the step went on
    try:
        for validation in range(repeats * 20):
            for side, io in sides.items():
                top_k, last = where / side / f"step={validation}.ckpt", where / side / "last.ckpt"
                state = {**checkpoint, "global_step": validation}  # each validation's own step
                start = time.perf_counter()
                io.save_checkpoint(state, top_k)
                io.save_checkpoint(state, last)
                if validation:
                    io.remove_checkpoint(where / side / f"step={validation - 1}.ckpt")
                times[side].append(time.perf_counter() - start)
                if isinstance(io, AtomicCheckpointIO):
                    io.wait()
                    background.append(time.perf_counter() - start)
    finally:
        sides["lightfleet"].teardown()
        shutil.rmtree(where)
    ms = {side: statistics.median(seconds) * 1e3 for side, seconds in times.items()}
    ratio = paired_ratio({"a": times["lightfleet"], "b": times["lightning"]})
    return {"lightfleet_ms": ms["lightfleet"], "lightning_ms": ms["lightning"],
            "lightfleet_until_on_disk_ms": statistics.median(background) * 1e3, "ratio": ratio,
            "goal": "lightfleet's durable pair costs the step no more than Lightning's pair (it was 2.17 / 1.26 ms a file)",
            "met": ratio <= 1.0, "raw": {**times, "lightfleet_until_on_disk": background}}


def summary(result: Any) -> Any:
    """`result` without its raw figures, numbers rounded: what the console shows."""
    if isinstance(result, dict):
        return {key: summary(value) for key, value in result.items() if key != "raw"}
    return round(result, 3) if isinstance(result, float) else result


BENCHMARKS = {"end_to_end": end_to_end, "callbacks": callback_costs, "refusal": refusal,
              "measure": measurement_overhead, "validation_checkpoints": validation_checkpoints}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side (median taken)")
    parser.add_argument("--steps", type=int, default=3000, help="training steps of the end-to-end and measure runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")

    # A subset run replaces its own benchmarks' entries and keeps the others', each with its date.
    earlier = json.loads(args.out.read_text())["benchmarks"] if args.out.exists() else {}
    results = {"python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "benchmarks": earlier}
    for name in args.names or list(BENCHMARKS):
        print(f"{name}: running {args.repeats} x 2 ...", flush=True)
        result = BENCHMARKS[name](args.repeats, args.steps)
        results["benchmarks"][name] = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), **result}
        print(f"{name}: {summary(result)}", flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
