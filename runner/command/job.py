"""One job of the `lightfleet` command: what Hydra runs in the job's directory.

Hydra has made the job's directory (`hydra.runtime.output_dir`) and its log file. The job takes
the command's preflight of it (runner/command/preflight.py) as the command hands it over: a
single run's (`run_checked`), or a sweep job's, looked up by its overrides in whatever process
the launcher runs it (`run_sweep_job`; a job the command never saw, one an optimising sweeper
such as Optuna chose, runs the preflight's job stages itself, once). It records config, plan and
environment there and starts its processes (runner/command/launch.py). A sweep job returns the
run's `optimized_metric` for sweepers that optimise one, and for a job that could not run the
worst value of the sweep's direction (`no_result`), so that Optuna goes on and steers away from it.
"""
from __future__ import annotations

import logging
import math
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, TextIO, Tuple

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner.command import launch, sweeps
from runner.command.console import to_log_files
from runner.command.preflight import Flight, check_job
from runner.config.checks import RunSpec
from runner.core.errors import ConfigError, Refusal, error_line, exit_on_user_error
from runner.core.paths import user_code_last
from runner.core.plan import Plan, format_plan
from runner.core import collector
from runner.core.clock import mark_start
from runner.records import files
from runner.records.checkpoints import CheckpointNotWritten
from runner.records.run_dir import create_run_dir, record_failure, write_yaml
from runner.core.world import World, external_rank
from runner.rank.parent import DIVERGED_EXIT, INTERRUPTED, STOPPED, exit_status

log = logging.getLogger(__name__)


def run_checked(flight: Flight, run_dir: Path, _cfg: DictConfig) -> None:
    """The one job of a single run, with the command's preflight of it; `run_dir` is the run's
    directory (the job records into it, or into its subdirectory for a second node or an
    externally launched rank: Hydra's job directory)."""
    hydra = HydraConfig.get()
    records = Path(hydra.runtime.output_dir)
    spec, command = flight.spec, list(hydra.overrides.task)
    spec.cfg.paths.output_dir = str(run_dir)
    spec.cfg.verbose = spec.cfg.verbose or bool(hydra.verbose)
    with exit_on_user_error():
        try:
            code = train_run(spec, flight.plan, command, records, flight.start_step)
        except (ConfigError, Refusal):
            raise
        except CheckpointNotWritten:  # a full disk, said and recorded by train_run
            sys.exit(1)
        except Exception as error:  # the user's code failed in this process: one line, the rest in the log
            log_to_file_only("run failed")
            print(f"lightfleet: run failed: {error_line(error)}; traceback in "
                  f"{records / (hydra.job.name + '.log')}", file=sys.stderr)
            sys.exit(1)
        if code:
            sys.exit(code)


def run_sweep_job(checked: Mapping[Tuple[str, ...], Flight], cfg: DictConfig) -> Optional[float]:
    """One job of a sweep (`sweep_job`), unless a signal has stopped the sweep: then it does not
    start (runner/command/sweeps.py). A signal before training starts stops it at once, as a run's
    does, and marks the sweep stopped. A job in the command's own process (the basic launcher) ends
    the sweep there, so that the sweeper launches nothing more; one in a launcher's worker returns."""
    from runner.rank.preemption import Preempted

    user_code_last()  # a launcher's worker process (joblib, submitit) imports the user's modules too
    hydra = HydraConfig.get()
    records, sweep_dir = Path(hydra.runtime.output_dir), Path(hydra.sweep.dir)
    sweeps.join_as_worker(sweep_dir)
    try:
        with launch.stopping_at_once():  # until training takes the signals over
            stopped = sweeps.stopped_by(sweep_dir)
            if stopped is None:
                return sweep_job(checked, cfg, records, sweep_dir)
    except Preempted as stop:  # nothing trained yet: nothing to save
        stopped = stop.signum
        sweeps.mark_stopped(sweep_dir, stopped)
        if files.holds_run(records):
            preempted(records, records, stopped)
    if not files.holds_run(records):  # only Hydra's files: the job stays "not started" in sweep.yaml
        shutil.rmtree(records)
    if sweeps.in_command():  # the sweeper launches nothing more
        sys.exit(exit_status(stopped))
    return no_result()


def sweep_job(checked: Mapping[Tuple[str, ...], Flight], cfg: DictConfig, records: Path,
              sweep_dir: Path) -> Optional[float]:
    """One job of a sweep, with the command's preflight of it when the command checked it
    (`checked`, by the job's overrides), else checked here, once."""
    hydra = HydraConfig.get()
    command = list(hydra.overrides.task)
    try:
        flight = checked.get(tuple(command)) or check_job(cfg)
    except (ConfigError, Refusal) as problem:
        print(f"lightfleet: job {hydra.job.num} ({' '.join(command)}) skipped: {problem}", file=sys.stderr)
        shutil.rmtree(records)  # only Hydra's files: the job never started; it leaves its reason
        records.mkdir()
        write_yaml(records / files.REFUSED_YAML, {"overrides": command, "reason": str(problem)})
        return no_result()
    spec = flight.spec
    spec.cfg.paths.output_dir, spec.cfg.paths.sweep_dir = str(records), str(sweep_dir)
    spec.cfg.verbose = spec.cfg.verbose or bool(hydra.verbose)
    print(f"lightfleet: job {hydra.job.num}: {' '.join(command)}", flush=True)
    mark_start()  # the job's start-up time counts from here, not from the sweep's start
    try:
        code = train_run(spec, flight.plan, command, records, flight.start_step)
        if code in STOPPED:  # the sweep stops with its job, as a run does
            sweeps.mark_stopped(sweep_dir, signal.SIGINT if code == INTERRUPTED else signal.SIGTERM)
            if sweeps.in_command():
                sys.exit(code)
        return objective(spec, records) if code == 0 else no_result()
    except ConfigError as error:  # e.g. a module name only the built model can reject
        print(f"lightfleet: job {hydra.job.num} error: {error}", file=sys.stderr)
    except CheckpointNotWritten:  # a full disk, said and recorded by train_run
        pass
    except Exception as error:  # the job's own code failed in this process: the sweep goes on
        log_to_file_only(f"job {hydra.job.num} failed")
        print(f"lightfleet: job {hydra.job.num} failed: {error_line(error)}; traceback in {records / (hydra.job.name + '.log')}", file=sys.stderr)
    return no_result()


def changed_length(cfg: DictConfig) -> Optional[str]:
    """The line that says a resume trains to another trainer.max_steps than the run its
    checkpoint comes from: a schedule spanning max_steps (the built-in models' lr_decay) is then
    another from the first step on, so the run no longer ends as an uninterrupted one would."""
    saved = Path(cfg.ckpt_path).parent.parent / files.CONFIG_YAML  # the run's, beside checkpoints/
    if not saved.is_file():
        return None
    before = OmegaConf.load(saved).trainer.get("max_steps")
    if before in (None, -1) or before == cfg.trainer.max_steps:
        return None
    return (f"lightfleet: note: trainer.max_steps {before} -> {cfg.trainer.max_steps}: a learning-rate schedule "
            f"over max_steps (lr_decay) now spans {cfg.trainer.max_steps} steps, so the steps from here on are "
            f"not those of the run it continues, nor of a {cfg.trainer.max_steps}-step run from the start "
            f"(a resume with the same max_steps ends bit for bit where the run would have)")


def train_run(spec: RunSpec, plan: Plan, command: Sequence[str], records: Path, start_step: Optional[int]) -> int:
    """Record the run in `records` and train (from `start_step`, ckpt_path's, if any); a failed
    rank becomes one line naming its log."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from runner.rank.divergence import Diverged
    from runner.rank.preemption import Preempted

    choosing = ""  # strategy=[auto]'s choice, said apart from the training on the done line
    if "auto" in plan.strategies:  # chosen now, before any rank starts
        from runner.command.autotune import JUDGES, choose

        collector.resume()  # auto weighs many candidates: their garbage is collected as it goes
        try:
            with launch.stopping_at_once():  # a trial or rehearsal under way is stopped with the command
                chosen = choose(spec, records, command)
        except Preempted as stop:
            mode = spec.strategies["auto"].mode
            runs = JUDGES[mode].runs_dir
            say(f"lightfleet: stopped by {signal.Signals(stop.signum).name} in strategy=[auto]'s {mode}, nothing "
                f"trained" + (f"; its {runs} so far: {records / files.AUTO_DIR / runs}" if runs else ""), sys.stderr)
            return exit_status(stop.signum)
        if chosen is None:  # strategy.auto.search_only, or chosen for a cluster (mode=rehearse)
            return 0
        spec, plan, choosing = chosen.spec, chosen.plan, f"; {chosen.words}"
        mark_start()  # the run's start-up and wall time (results.yaml) count from here, the choice's apart
    create_run_dir(spec.cfg, plan, command, records)
    run_dir = Path(spec.cfg.paths.output_dir)
    say(f"{format_plan(plan, everything=False)}\nlightfleet: run directory {run_dir}")
    if start_step is not None:
        say(f"lightfleet: {'evaluating' if spec.cfg.evaluate else 'continuing from'} step {start_step} "
            f"(checkpoint {spec.cfg.ckpt_path})")
        if not spec.cfg.evaluate and (longer := changed_length(spec.cfg)):
            say(longer)
    started = time.monotonic()
    try:
        launch.run(records, World(**plan.world))
    except (SignalException, Preempted) as stop:  # a checkpoint at the agreed step, or none if still starting
        # In this process, Preempted knows the step; from the agent, the signal the ranks were passed.
        signum, step = (stop.signum, stop.step) if isinstance(stop, Preempted) else (stop.sigval, None)
        return preempted(records, run_dir, signum, step)
    except Diverged as stop:  # in this process: recorded here
        say(f"lightfleet: {stop}", sys.stderr)
        record_failure(records, DIVERGED_EXIT, str(stop), status=files.DIVERGED)
        return DIVERGED_EXIT
    except ChildFailedError as failure:
        codes = {rank: f.exitcode for rank, f in sorted(failure.failures.items())}
        # The ranks signalled, not this process (a scheduler's SIGTERM to them alone): they stopped
        # as on the command's own, and the agent may have ended the slower one (its SIGTERM). A rank
        # killed otherwise (SIGKILL: the out-of-memory killer) is a failure, not a preemption.
        if any(code in STOPPED for code in codes.values()) and all(code in STOPPED or code == -signal.SIGTERM
                                                                   for code in codes.values()):
            return preempted(records, run_dir, signal.SIGINT if INTERRUPTED in codes.values() else signal.SIGTERM)
        if DIVERGED_EXIT in codes.values():  # the ranks recorded it, all at the same step
            say(f"lightfleet: {files.job_ending(records).record['error']}", sys.stderr)
            return DIVERGED_EXIT
        return failed(records, run_dir, failure, codes)
    except CheckpointNotWritten as full:  # in this process: one line, no traceback (the log shares the full disk)
        print(f"lightfleet: run failed: {full}{record_failure(records, 1, str(full))}", file=sys.stderr, flush=True)
        raise
    except Exception as error:  # in this process: recorded, then handled as any error
        record_failure(records, 2 if isinstance(error, ConfigError) else 1, error_line(error))
        raise
    ending = files.job_ending(run_dir)
    if ending.outcome == files.FINISHED and spec.cfg.evaluate:
        say(f"lightfleet: evaluated: {metrics_line(ending.record)}; run directory {run_dir}")
    elif ending.outcome == files.FINISHED:  # rank 0's results; a second node's copy of the command has none
        say(f"lightfleet: done: {summary_line(ending.record, time.monotonic() - started, start_step or 0)}"
            f"{choosing}; run directory {run_dir}")
        note = input_bound_note(ending.record, spec.cfg.data)
        if note:
            say(note)
        restarts = files.read_yaml(records / files.RESTARTS_YAML)
        if restarts:  # trainer.max_restarts: the ranks were started again after one died
            say(f"lightfleet: note: the ranks were restarted {len(restarts)} time(s) after a rank died, resuming "
                f"from step(s) {', '.join(str(restart['from_step']) for restart in restarts)} "
                f"({records / files.RESTARTS_YAML})")
    return 0


# A rank that died of a signal: what most likely sent it, for the summary line.
SIGNAL_WORDS = {
    signal.SIGKILL: "killed from outside, often the out-of-memory killer",
    signal.SIGSEGV: "a segmentation fault: an invalid memory access in native code",
    signal.SIGBUS: "a bus error: memory that cannot be read, often a full /dev/shm (the data loader workers' "
                   "shared memory) or a memory-mapped file truncated under it",
    signal.SIGABRT: "aborted by native code (a failed assertion or an uncaught C++ exception)",
    signal.SIGILL: "an illegal instruction: a library built for another CPU",
    signal.SIGFPE: "an arithmetic fault in native code",
    signal.SIGTERM: "stopped from outside before it could checkpoint",
}


def killed_by(signum: int) -> str:
    """`SIGKILL: killed from outside, ...`: a signal's name and what most likely sent it."""
    try:
        name = signal.Signals(signum).name
    except ValueError:  # a real-time signal
        name = f"signal {signum}"
    return f"{name}: {SIGNAL_WORDS.get(signum, signal.strsignal(signum) or 'unknown')}"


def failed(records: Path, run_dir: Path, failure: Any, codes: Dict[int, int]) -> int:
    """Say why ranks failed (torch's ChildFailedError `failure`), record it, and return the exit status.
    A rank killed by a signal is named first: the others then fail on their lost peer. One the agent
    stopped (SIGTERM) is named only when no rank failed of itself: it was stopped because of that one."""
    killed = sorted(((rank, code) for rank, code in codes.items() if code < 0),
                    key=lambda killing: killing[1] == -signal.SIGTERM)
    if killed and not (killed[0][1] == -signal.SIGTERM and any(code > 0 for code in codes.values())):
        rank, code = killed[0]
        reason = killed_by(-code)
    else:
        rank, first = failure.get_first_failure()
        reason = last_error_line(records / files.LOGS_DIR, first.local_rank)
    # A rank that exits 2 has printed a bad-input line; the others were stopped because of it.
    code = 2 if 2 in codes.values() else 1
    resumable = code == 1 and (run_dir / files.LAST_CHECKPOINT).exists()
    resume = f"; continue with: lightfleet resume {run_dir}" if resumable else ""
    unrecorded = record_failure(records, code, reason)  # first: the line says if it could not be
    say(f"lightfleet: run failed: rank {rank}: {reason.removeprefix('lightfleet: ')} (exit status by "
        f"rank {codes}; logs in {records / files.LOGS_DIR}){unrecorded}{resume}", sys.stderr)
    return code


def preempted(records: Path, run_dir: Path, signum: int, step: Optional[int] = None) -> int:
    """Say how to continue a run a signal stopped, record it, and return its exit status."""
    from runner.rank.preemption import resume_line

    line = resume_line(run_dir, signum, step)
    say(line, sys.stderr)
    record_failure(records, exit_status(signum), line.removeprefix("lightfleet: "), status=files.PREEMPTED)
    return exit_status(signum)


def metrics_line(results: Dict[str, Any]) -> str:
    """An evaluation's figures: every validation and test metric."""
    shown = [f"{name} {value:.4g}" for name, value in sorted(results.items())
             if name.startswith(("val_", "test_")) and name != "val_step" and isinstance(value, float)]
    return ", ".join(shown) or "no val_ or test_ metric logged"


def summary_line(results: Dict[str, Any], seconds: float, first_step: int = 0) -> str:
    """Steps (those this run trained, from `first_step` when it resumed), wall time, throughput,
    peak memory (max over ranks) and final losses of a finished run."""
    last = results["global_step"]
    trained = f"{last - first_step} steps (steps {first_step + 1} to {last})" if first_step else f"{last} steps"
    parts = [f"{trained} in {results.get('wall_s', seconds):.1f} s"]
    if results.get("samples_per_s"):
        tokens = f" ({results['tokens_per_s']:,.0f} tokens/s)" if results.get("tokens_per_s") else ""
        parts.append(f"{results['samples_per_s']:,.1f} samples/s{tokens}")
    if results.get("mfu"):
        parts.append(f"MFU {results['mfu']:.1%}")
    if results.get("peak_memory_mb"):
        parts.append(f"peak memory {results['peak_memory_mb']:,.0f} MB")
    if results.get("data_wait_fraction") is not None:
        parts.append(f"waiting for data {results['data_wait_fraction']:.0%} of the step time")
    if results.get("device_idle_fraction") is not None:
        parts.append(f"device idle between batches {results['device_idle_fraction']:.0%}")
    if "train_loss" in results:
        parts.append(f"train_loss {results['train_loss']:.4g}")
    if "val_loss" in results:  # from the last validation, which need not be at the last step
        step = results.get("val_step")
        at = f" (at step {step})" if step not in (None, results["global_step"]) else ""
        parts.append(f"val_loss {results['val_loss']:.4g}{at}")
    return ", ".join(parts)


INPUT_BOUND = 0.1  # the share of the step time the loader takes above which the summary says so
# A loading time below this is a loader's own cost for a batch (collating, the iterator's bookkeeping),
# which workers and prefetching cannot hide: tiny models on data in memory take so, whatever their fraction.
INPUT_BOUND_MIN_WAIT_S = 0.001
INPUT_KNOBS = {"num_workers": "more loader workers", "pin_memory": "pinned memory (on GPUs)",
               "prefetch_factor": "more batches prefetched by each worker"}


def input_bound_note(results: Dict[str, Any], data: Any) -> Optional[str]:
    """A line saying that the input does not keep up, and the data's knobs that help, when the
    loader took more than INPUT_BOUND of the step time (and at least INPUT_BOUND_MIN_WAIT_S a step)
    and, on a GPU, the device sat idle between batches for at least half that time (a host that
    loads while the device computes holds nothing up)."""
    fraction, idle = results.get("data_wait_fraction"), results.get("device_idle_fraction")
    if fraction is None or fraction <= INPUT_BOUND or results["data_wait_s"] < INPUT_BOUND_MIN_WAIT_S:
        return None
    if idle is not None and idle < fraction / 2:
        return None
    knobs = [f"{why} (data.{name}, now {data[name]})" for name, why in INPUT_KNOBS.items() if name in data]
    help_ = "; ".join(knobs) if knobs else "loading the data ahead of the steps (a DataLoader's num_workers)"
    return (f"lightfleet: note: the input does not keep up: loading the batches took {fraction:.0%} of the "
            f"step time ({results['data_wait_s'] * 1000:.3g} ms a step). What helps: {help_}")


def say(text: str, stream: Optional[TextIO] = None) -> None:
    """Print the job's own line(s) (on stdout unless `stream`) and keep them in the job's log file
    (lightfleet.log). Under torchrun or SLURM, where every rank runs the command, rank 0 speaks
    for the run on the console; the others keep their lines in their own log."""
    if external_rank() == 0:
        print(text, file=stream or sys.stdout, flush=True)
    to_log_files(log.makeRecord(log.name, logging.INFO, __file__, 0, text, (), None))


def log_to_file_only(message: str) -> None:
    """`message` and the traceback being handled, to the job's log file: the console gets one line."""
    to_log_files(log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), sys.exc_info()))


def last_error_line(logs: Path, local_rank: int) -> str:
    """The last line a failed rank wrote to stderr: its one-line error, or its traceback's last line."""
    for stderr in sorted(logs.glob(f"*/attempt_*/{local_rank}/stderr.log"), reverse=True):
        lines = [line for line in stderr.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1].split(":", 1)[1].strip() if lines[-1].startswith("[rank") else lines[-1].strip()
    return "no error message (see the rank logs)"


def no_result() -> float:
    """What a job that could not run gives its sweeper: the worst value of an optimising sweeper's
    `direction` (+inf when minimising), NaN for the others. Not NaN for Optuna: with
    hydra-optuna-sweeper 1.3 and optuna 2.10 one NaN ends the whole sweep with a traceback (the
    sweeper's study.tell raises on it, then again when it marks the trial failed)."""
    direction = HydraConfig.get().sweeper.get("direction")  # a name, an enum member, or a list (several objectives)
    name = getattr(direction, "name", direction)
    return {"minimize": math.inf, "maximize": -math.inf}.get(name, math.nan) if isinstance(name, str) else math.nan


def objective(spec: RunSpec, records: Path) -> Optional[float]:
    """The final value of `optimized_metric` (None when the run names none)."""
    metric = spec.cfg.optimized_metric
    if metric is None:
        return None
    results = files.read_yaml(Path(spec.cfg.paths.output_dir) / files.RESULTS_YAML)
    if metric not in results:
        raise ConfigError("optimized_metric", metric, f"the run logged no such metric; it logged: "
                          f"{', '.join(sorted(results))}", results)
    return float(results[metric])
