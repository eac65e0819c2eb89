"""Train one run from its saved config: the same code path for a single process and for every
rank of a multi-process run (started by runner/command/launch.py: forked_rank, or runner/train.py)."""
from __future__ import annotations

import csv
import logging
import os
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from runner.core.errors import ConfigError, Refusal, error_line, exit_on_user_error, require
from runner.core.plan import Plan
from runner.core.clock import started_at
from runner.records.checkpoints import CheckpointNotWritten
from runner.records.files import (CONFIG_YAML, DIVERGED, JOB_LOG, LAST_CHECKPOINT, METRICS_CSV, RESTARTS_YAML,
                                  RESULTS_YAML, rank_traceback, read_yaml)
from runner.records.run_dir import checkpoint_contents, read_plan, record_failure, write_yaml
from runner.rank.parent import DIVERGED_EXIT, start_clean, tie_to_command


# Where the libraries are installed: their log records and warnings go to the job's log only
# (lightfleet's own and the user's code reach the console as well).
LIBRARIES = tuple({os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "purelib", "platlib")})
OWN_SOURCES = tuple(str(Path(__file__).parents[2] / package) + os.sep for package in ("runner", "plugins"))
# Libraries whose loggers have console handlers of their own, bypassing the job's log: Lightning's
# top loggers when imported before logging is configured (as the command imports them), torch's
# registered ones (torch, torch.distributed, torch.distributed.fsdp, ...) always.
LIBRARY_PACKAGES = ("pytorch_lightning", "lightning_fabric", "torch")
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # set by torch's elastic agent in each rank it starts: 0, then 1, ...


class NotFromLibraries(logging.Filter):
    """The console's filter unless verbose: the libraries' records and warnings (Lightning's device
    lines and tips, torch's and torchdata's warnings) stay in the job's log; lightfleet's and the
    user's code's pass, and so does the report of a profiler the user asked for (trainer.profiler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("pytorch_lightning.profilers"):
            return True
        # logging.captureWarnings' records hold the warning as Python prints it: its file first.
        return not from_libraries(record.getMessage() if record.name == "py.warnings" else record.pathname)


def from_libraries(source: str) -> bool:
    """Whether the file `source` (of a log record or a warning) is an installed library's, not
    lightfleet's (installed too, from a wheel) nor the user's code."""
    return source.startswith(LIBRARIES) and not source.startswith(OWN_SOURCES)


def log_to_job_log(records: Path, verbose: bool) -> None:
    """Every log record and Python warning of this process into the job's log (records/lightfleet.log,
    the file Hydra's job logging writes), and onto the console all but the libraries', unless `verbose`.
    A single-process run has Hydra's handlers; a rank started by runner/command/launch.py gets its own,
    appending to the same file with its rank in every line."""
    root = logging.getLogger()
    if not any(isinstance(handler, logging.FileHandler) for handler in root.handlers):
        job_log = logging.FileHandler(records / JOB_LOG)
        rank = os.environ.get("RANK", "0")
        job_log.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(job_log)
        root.addHandler(logging.StreamHandler())  # stderr: the rank's log, and rank 0's on the console
        root.setLevel(logging.INFO)
    for handler in root.handlers:
        if not isinstance(handler, logging.FileHandler) and not verbose:
            handler.addFilter(NotFromLibraries())
    for name, library in list(logging.Logger.manager.loggerDict.items()):  # through the root's handlers
        if isinstance(library, logging.Logger) and name.partition(".")[0] in LIBRARY_PACKAGES:
            consoles = [handler for handler in library.handlers if type(handler) is logging.StreamHandler]
            for handler in consoles:  # exactly StreamHandler: torch's trace log (a subclass) stays as it is
                library.removeHandler(handler)
            library.propagate = library.propagate or bool(consoles)
    logging.captureWarnings(True)


def train(cfg: DictConfig, plan: Plan, records: Path,
          kept_metrics: Optional[List[Dict[str, str]]] = None) -> Dict[str, Any]:
    """Build, fit, and record the final metrics (rank 0 writes results.yaml). `cfg` and `plan` are
    the run's as the command's preflight checked and saved them in `records`; `kept_metrics`, the
    rows a restarted run keeps (resume_after_restart)."""
    import torch

    from pytorch_lightning.utilities.model_helpers import is_overridden

    from runner.rank.build import build
    from runner.rank.measure import LastValidation

    log_to_job_log(records, cfg.verbose)  # once torch and Lightning, which set up their own logging, are imported
    run_dir = Path(cfg.paths.output_dir)
    built = build(cfg, plan, run_dir)
    trainer = built.trainer
    if kept_metrics:
        keep_metrics(trainer, kept_metrics)
    if cfg.test:
        for hook, owner in (("test_dataloader", built.datamodule), ("test_step", built.model)):
            require(is_overridden(hook, owner), "test", True, f"{type(owner).__name__} has no {hook}")
    # Checkpoints are read as data only (weights_only): a crafted pickle never runs code in a rank.
    if cfg.evaluate:  # the weights of ckpt_path, no training
        trainer.validate(built.model, datamodule=built.datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
    else:
        trainer.fit(built.model, datamodule=built.datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
        save_last_checkpoint(trainer)
    results = {name: float(value) for name, value in trainer.callback_metrics.items()}
    validated = next((callback.step for callback in trainer.callbacks if isinstance(callback, LastValidation)), None)
    if validated is not None and any(name.startswith("val_") for name in results):
        results["val_step"] = validated
    if cfg.test:  # the weights fit ended with, or ckpt_path's
        trainer.test(built.model, datamodule=built.datamodule, ckpt_path=cfg.ckpt_path if cfg.evaluate else None,
                     weights_only=True)
        results.update((name, float(value)) for name, value in trainer.callback_metrics.items())
    results["global_step"] = trainer.global_step
    if built.meter is not None and built.meter.summary:
        results.update(built.meter.summary, wall_s=time.time() - started_at())
    if trainer.is_global_zero:
        write_yaml(run_dir / RESULTS_YAML, results)
    if torch.distributed.is_initialized():
        # Left to interpreter exit, the process group's communication threads can be torn down
        # while still joinable, which aborts the rank ("terminate called without an active
        # exception") after a successful run.
        torch.distributed.destroy_process_group()
    return results


def save_last_checkpoint(trainer: Any) -> None:
    """Lightning checkpoints when validation or an epoch ends, so a run stopped by max_steps
    between the two leaves last.ckpt behind its last step: save where fit ended as last.ckpt,
    so that resuming continues from there."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.save_last and callback.dirpath:
        last = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
        trainer.save_checkpoint(str(last), weights_only=False)  # all of it: optimizer, loops, scaler
        trainer.strategy.checkpoint_io.teardown()  # written in the background: on the disk before the run ends


def train_from(records: Path) -> Dict[str, Any]:
    """Train from the config.yaml and plan.yaml the command saved in `records` (a fresh run
    directory: a finished run is replayed into a new one with `lightfleet replay`). The command
    checked both; only whether the run already finished is the rank's to see."""
    cfg = OmegaConf.load(records / CONFIG_YAML)
    require(not (Path(cfg.paths.output_dir) / RESULTS_YAML).exists(), "run directory", str(records),
            f"has finished; `lightfleet replay {records}` runs it again in a new directory")
    restart = int(os.environ.get(RESTART_COUNT, "0"))
    kept = resume_after_restart(cfg, records, restart) if restart else None
    return train(cfg, read_plan(records), records, kept)


def resume_after_restart(cfg: DictConfig, records: Path, restart: int) -> List[Dict[str, str]]:
    """Ranks torch's elastic agent started again after one died (trainer.max_restarts) go on as
    `lightfleet resume` would: from the newest checkpoints/last.ckpt, else from the run's own start
    (its ckpt_path, if any). Rank 0 records the restart in restarts.yaml. Returns the metrics rows
    logged before the checkpoint's step, which the CSV logger, made again, would otherwise delete
    (the rows after it are logged again: none twice)."""
    last = Path(cfg.paths.output_dir) / LAST_CHECKPOINT
    step = 0
    if last.exists():
        cfg.ckpt_path, step = str(last), checkpoint_contents(last).step
    if os.environ.get("RANK", "0") != "0":
        return []
    restarts = read_yaml(records / RESTARTS_YAML) or []
    restarts.append({"restart": restart, "from_step": step, "checkpoint": cfg.ckpt_path})
    write_yaml(records / RESTARTS_YAML, restarts)
    metrics = Path(cfg.paths.output_dir) / METRICS_CSV
    if not metrics.is_file():
        return []
    with metrics.open(newline="") as lines:
        return [row for row in csv.DictReader(lines) if row.get("step") and int(row["step"]) < step]


def keep_metrics(trainer: Any, rows: List[Dict[str, str]]) -> None:
    """Log `rows` (resume_after_restart's) again through the run's CSV logger, before the new ones."""
    from pytorch_lightning.loggers import CSVLogger

    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            for row in rows:
                values = {name: int(value) if value.isdigit() else float(value)
                          for name, value in row.items() if value and name != "step"}
                logger.experiment.log_metrics(values, int(row["step"]))


def report_failure(records: Path, error: Exception) -> int:
    """A rank's failure in the user's code: the traceback to a file of the run's logs, one line to
    stderr (the command repeats it); the exit status."""
    if isinstance(error, CheckpointNotWritten):  # a full disk: the line says it all, and no file would fit
        print(f"lightfleet: {error}", file=sys.stderr, flush=True)
        return 1
    rank = os.environ.get("RANK", "0")
    path = records / rank_traceback(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(error)))
    print(f"lightfleet: {error_line(error)}; traceback in {path}", file=sys.stderr, flush=True)
    return 1


def main(records: Path) -> None:
    """One rank of a run, started by runner/command/launch.py: forked from the command
    (forked_rank, below) or as `python -m runner.train RUN_DIR` (runner/train.py). Returns once
    everything is written; stopped or failed, it leaves with its exit status."""
    from runner.rank.divergence import Diverged
    from runner.rank.preemption import Preempted

    with exit_on_user_error():
        try:
            train_from(records)
        except (ConfigError, Refusal):
            raise
        except Preempted as stopped:  # the checkpoint is written: leave as below, 143 or (Ctrl-C) 130
            leave(stopped.code)
        except Diverged as stopped:  # every rank at the same step, with the same line
            # Each rank records it (the same file, replaced whole) before leaving: the command says
            # it once from there, whichever rank the elastic agent saw leave first.
            record_failure(records, DIVERGED_EXIT, str(stopped), status=DIVERGED)
            leave(DIVERGED_EXIT)
        except Exception as failure:  # noqa: BLE001 (whatever the user's code raises)
            sys.exit(report_failure(records, failure))


def leave(code: int) -> None:
    """Leave at once with `code`, what was printed flushed: the run has recorded how it ended."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def forked_rank(records: str) -> None:
    """A rank forked from the command by torch's elastic agent: it starts as a copy of the command,
    with torch, Lightning and the user's modules imported, and first leaves the command's signal
    handlers, console and log handlers behind, as a fresh process would not have them.
    Multiprocessing ends the process without interpreter teardown once this returns."""
    import torch

    tie_to_command()
    start_clean()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # the command kept to one (runner/command/launch.py)
    main(Path(records))
