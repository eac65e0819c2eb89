"""The run directory's files, named here only (a test holds runner/ and plugins/ to that), and how a
job ended: the one vocabulary of outcomes that failure.yaml, sweep.yaml, the report and auto's
trials share. Pure: no torch, Lightning, Hydra or OmegaConf (`lightfleet report` and the Fleet
commands read these).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Union

import yaml

# A run directory's, made by the command (runner/records/run_dir.py) and filled by the ranks.
OWNER_YAML = "owner.yaml"  # the command that holds the directory (pid, host, since, command); made first, exclusively
CONFIG_YAML = "config.yaml"  # the resolved config: every rank reads it; reproducible from it alone
PLAN_YAML = "plan.yaml"  # the plan every rank carries out (its printed form, then its data)
ENV_YAML = "env.yaml"  # command, versions, git commit, host
BUILD_YAML = "build.yaml"  # what build resolved (e.g. the modules recompute wrapped)
RESULTS_YAML = "results.yaml"  # final metrics and measurements, by rank 0 when the run finished
FAILURE_YAML = "failure.yaml"  # how a run that did not finish ended: status (an outcome), exit_code, error
RESTARTS_YAML = "restarts.yaml"  # each restart of the ranks (trainer.max_restarts): its number, from_step, checkpoint
REHEARSAL_YAML = "rehearsal.yaml"  # lightfleet rehearse's: each rank kind's report, the device, the reserve, the verdict
REHEARSAL_REPORT = "rehearse/rank-{rank}.json"  # a rehearsed rank's report (its log: the same name, .log)
REFUSED_YAML = "refused.yaml"  # why a sweep's job never started: its overrides and the reason (alone in its directory)
METRICS_CSV = "csv/metrics.csv"  # the CSV logger's (conf/logger/csv.yaml)
LAST_CHECKPOINT = "checkpoints/last.ckpt"  # ModelCheckpoint's save_last (conf/callbacks/model_checkpoint.yaml)
TRAFFIC_DIR = "traffic"  # traffic/rank<R>.jsonl: each rank's collective bytes per optimizer step (measure.traffic=true)
LOGS_DIR = "logs"  # torchelastic's per-rank stdout/stderr, and the ranks' tracebacks
PROGRESS_LINE = "logs/progress.line"  # rank 0's progress bar as its latest line, which the command draws in place
PROGRESS_LINE_ENV = "LIGHTFLEET_PROGRESS_LINE"  # set by the command for its ranks: the path of PROGRESS_LINE
# How often a progress bar's line is due: on a terminal a few times a second (drawn in place), elsewhere
# (a pipe, a log file, a scheduler's output) every PLAIN_EVERY_S, a line each. Set by the command for its
# ranks (PROGRESS_EVERY_ENV), from the console it draws on; a rank without it looks at its own stdout.
TERMINAL_EVERY_S = 0.2
PLAIN_EVERY_S = 30.0
PROGRESS_EVERY_ENV = "LIGHTFLEET_PROGRESS_EVERY_S"
JOB_LOG = "lightfleet.log"  # the job's log: Hydra's (hydra.job.name), and every rank's records and warnings
NODES_DIR = "nodes"  # nodes/<NODE_RANK>/: a second node's copy of the command keeps its records there
RANKS_DIR = "ranks"  # ranks/<RANK>/: the same for a rank launched by torchrun or SLURM
FLEET_PROTOTXT = "fleet_strategy.prototxt"  # `lightfleet export-fleet RUN_DIR`'s default
AUTO_DIR = "auto"  # strategy=[auto]'s choice; a sweep directory whose jobs are the trials
CANDIDATES_CSV = "candidates.csv"
CHOICE_YAML = "choice.yaml"
TRIALS_DIR = "trials"  # trials/<k>/: a run directory each
REHEARSALS_DIR = "rehearsals"  # auto/rehearsals/<k>/ (strategy.auto.mode=rehearse): a rehearsal's run directory each
AGAIN = "_again"  # ends the directory of a trial auto ran again: trials/<k>_again/
TRIAL_LOG = "trial.log"
# A sweep directory's (auto/ is one too: its trials are its jobs).
MULTIRUN_YAML = "multirun.yaml"  # Hydra's
HYDRA_OVERRIDES = ".hydra/overrides.yaml"  # Hydra's, in each job directory
SWEEP_YAML = "sweep.yaml"  # the sweep's command line and every job it planned, with how each ended
SWEEP_STOPPED = ".stopped"  # the name of the signal that stopped the sweep: no job starts after it
ATTEMPTS_DIR = ".attempts"  # attempts/<job>.<k>/: a job's stopped attempt, moved aside when the sweep continues
WORKERS_DIR = ".workers"  # workers/<pid>: a launcher's process that has run a job of the sweep (signals go on to it)
# `lightfleet report`'s, in the one run or sweep directory it covers (or --out).
REPORT_CSV = "report.csv"
REPORT_MD = "report.md"
THROUGHPUT_PNG = "throughput.png"
THROUGHPUT_MEMORY_PNG = "throughput_memory.png"
LOSS_CURVES_PNG = "loss_curves.png"


def progress_every_s(stream: Any) -> float:
    """How often a bar drawn on `stream` is due (TERMINAL_EVERY_S, PLAIN_EVERY_S)."""
    return TERMINAL_EVERY_S if stream.isatty() else PLAIN_EVERY_S


# How a job ended: failure.yaml's and sweep.yaml's status.
FINISHED = "finished"
FAILED = "failed"
OUT_OF_MEMORY = "out_of_memory"  # told apart from failed: the cure differs
REFUSED = "refused"  # never started: the table or a check refused it
PREEMPTED = "preempted"  # stopped by a signal after saving LAST_CHECKPOINT: resume it
DIVERGED = "diverged"  # stopped where the loss or a parameter became NaN or Inf (runner/rank/divergence.py)
NOT_STARTED = "not_started"  # a sweep's job that a signal stopped the sweep before (sweep.yaml only)
OUTCOMES = (FINISHED, FAILED, OUT_OF_MEMORY, REFUSED, PREEMPTED, DIVERGED, NOT_STARTED)


@dataclass(frozen=True)
class Ending:
    """How a job directory ended, and the record that says so."""

    outcome: str  # one of OUTCOMES
    # results.yaml's figures, failure.yaml's status, exit_code and error, or refused.yaml's overrides
    # and reason; empty when no file says how it ended (killed, or still running: FAILED)
    record: Dict[str, Any] = field(default_factory=dict)


def job_ending(job_dir: Path) -> Ending:
    """How the job in `job_dir` ended: refused.yaml, results.yaml, failure.yaml, in that order."""
    for name, outcome in ((REFUSED_YAML, REFUSED), (RESULTS_YAML, FINISHED), (FAILURE_YAML, None)):
        record = read_yaml(job_dir / name)
        if record is not None:
            return Ending(outcome or record.get("status", FAILED), record)
    return Ending(FAILED)


def failure_outcome(error: str, otherwise: str = FAILED) -> str:
    """The outcome of a run that ended with `error`: out of memory is told apart."""
    return OUT_OF_MEMORY if "out of memory" in error.lower() else otherwise


def holds_run(path: Path) -> bool:
    """A training run's directory (a rehearsal's holds a config too, and trains nothing)."""
    return (path / CONFIG_YAML).is_file() and not holds_rehearsal(path)


def holds_rehearsal(path: Path) -> bool:
    """`lightfleet rehearse`'s directory, from its first rank's start on."""
    return (path / REHEARSAL_YAML).is_file() or (path / Path(REHEARSAL_REPORT).parent).is_dir()


def holds_sweep(path: Path) -> bool:
    return (path / MULTIRUN_YAML).is_file() or (path / SWEEP_YAML).is_file()


def rank_traceback(rank: Union[int, str]) -> str:
    """Where in the run directory rank `rank` writes the traceback of its failure."""
    return f"{LOGS_DIR}/traceback.rank{rank}.txt"


def read_yaml(path: Path) -> Any:
    """The YAML file at `path`; None when there is none."""
    return yaml.safe_load(path.read_text()) if path.is_file() else None
