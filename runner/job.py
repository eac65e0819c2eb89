"""One job of the `lightfleet` command: Hydra's task function.

Hydra has made the job's directory (`hydra.runtime.output_dir`) and its log file. The job checks
its config (again, cheaply: a sweeper such as Optuna makes jobs the command never saw), records
config, plan and environment there and launches its processes (runner/launch.py). It returns
the run's `optimized_metric` for sweepers that optimise one, and NaN for a job that could not run
(Optuna marks that trial failed and goes on).
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence, Tuple

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.compat import check, load_table
from runner.config import RunSpec, validate
from runner.errors import ConfigError, Refusal, exit_on_user_error, require
from runner.plan import Plan, format_plan, make_plan
from runner.records import create_run_dir, find_checkpoint, records_subdir
from runner.world import World, check_multi_node


def prepare(cfg: DictConfig) -> Tuple[RunSpec, Plan]:
    """Validate, check against the table, plan, and check the world against the machine. The one
    place plans are made; every rank reads the plan the job saves."""
    from runner.launch import check_devices

    spec = validate(cfg)
    check(list(spec.strategies), load_table())
    plan = make_plan(spec.strategies, spec.trainer, spec.batch_size)
    check_multi_node(World(**plan.world))
    check_devices(spec.trainer.accelerator, World(**plan.world))
    run = spec.cfg
    require(run.ckpt_path is not None or not run.evaluate, "evaluate", True, "needs ckpt_path=PATH|last: the weights to evaluate")
    require(not run.test or "pipeline" not in spec.strategies, "test", True,
            "the pipeline strategy runs fit and validation only")
    if run.ckpt_path is not None:  # where the command ran, also after hydra.job.chdir
        run.ckpt_path = find_checkpoint(run.ckpt_path, run.paths.root_dir, Path(HydraConfig.get().runtime.cwd))
    return spec, plan


def run_job(cfg: DictConfig) -> Optional[float]:
    hydra = HydraConfig.get()
    records = Path(hydra.runtime.output_dir)
    command = list(hydra.overrides.task)
    if hydra.mode != RunMode.MULTIRUN:
        with exit_on_user_error():
            spec, plan = prepare(cfg)
            # paths.output_dir records the directory Hydra runs in (it may have been named by
            # hydra.run.dir); a second node or rank keeps its records in a subdirectory of it.
            depth = len(Path(records_subdir(World(**plan.world))).parts)
            spec.cfg.paths.output_dir = str(records.parents[depth - 1] if depth else records)
            spec.cfg.verbose = spec.cfg.verbose or bool(hydra.verbose)
            code = launch(spec, plan, command, records)
            if code:
                sys.exit(code)
            return objective(spec, records)
    try:
        spec, plan = prepare(cfg)
    except (ConfigError, Refusal) as problem:
        print(f"lightfleet: job {hydra.job.num} ({' '.join(command)}) skipped: {problem}", file=sys.stderr)
        shutil.rmtree(records)  # only Hydra's files: the job never started
        return math.nan
    spec.cfg.paths.output_dir, spec.cfg.paths.sweep_dir = str(records), hydra.sweep.dir
    spec.cfg.verbose = spec.cfg.verbose or bool(hydra.verbose)
    print(f"lightfleet: job {hydra.job.num}: {' '.join(command)}", flush=True)
    try:
        return objective(spec, records) if launch(spec, plan, command, records) == 0 else math.nan
    except ConfigError as error:  # e.g. a module name only the built model can reject
        print(f"lightfleet: job {hydra.job.num} error: {error}", file=sys.stderr)
        return math.nan


def launch(spec: RunSpec, plan: Plan, command: Sequence[str], records: Path) -> int:
    """Record the run in `records` and train; a failed rank becomes one line naming its log."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from runner import launch as launcher

    create_run_dir(spec.cfg, plan, command, records)
    run_dir = Path(spec.cfg.paths.output_dir)
    print(f"{format_plan(plan)}\nlightfleet: run directory {run_dir}", flush=True)
    started = time.monotonic()
    try:
        launcher.run(records, World(**plan.world))
    except ChildFailedError as failure:
        codes = {rank: f.exitcode for rank, f in sorted(failure.failures.items())}
        print(f"lightfleet: run failed: exit status by rank {codes}; logs in {records / 'logs'}", file=sys.stderr)
        # A rank that exits 2 has printed a bad-input line; the others were stopped because of it.
        return 2 if 2 in codes.values() else 1
    if (run_dir / "results.yaml").is_file():  # rank 0's; a second node's copy of the command has none
        results = yaml.safe_load((run_dir / "results.yaml").read_text())
        losses = "".join(f", {name} {results[name]:.4g}" for name in ("train_loss", "val_loss") if name in results)
        print(f"lightfleet: done: {results['global_step']} steps in {time.monotonic() - started:.1f} s{losses}; "
              f"run directory {run_dir}", flush=True)
    return 0


def objective(spec: RunSpec, records: Path) -> Optional[float]:
    """The final value of `optimized_metric` (None when the run names none)."""
    metric = spec.cfg.optimized_metric
    if metric is None:
        return None
    results = yaml.safe_load((Path(spec.cfg.paths.output_dir) / "results.yaml").read_text())
    if metric not in results:
        raise ConfigError("optimized_metric", metric, f"the run logged no such metric; it logged: "
                          f"{', '.join(sorted(results))}", results)
    return float(results[metric])
