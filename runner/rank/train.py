"""Train one run from its saved config: the same code path for a single process and for every
rank of a multi-process run (`python -m runner.rank.train RUN_DIR`, started by runner/command/launch.py)."""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict

from omegaconf import DictConfig, OmegaConf

from runner.core.errors import ConfigError, Refusal, error_line, exit_on_user_error, require
from runner.core.plan import Plan
from runner.core.clock import started_at
from runner.records.files import CONFIG_YAML, RESULTS_YAML, rank_traceback
from runner.records.run_dir import read_plan, write_yaml


# Lightning's informational loggers: device and distributed-setup lines, tips.
LIGHTNING_INFO_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero",
                          "lightning_fabric.utilities.distributed", "pytorch_lightning.accelerators.cuda")


def quiet_console(verbose: bool) -> None:
    """Keep the console to the plan, the progress bar and the summary unless `verbose`."""
    if verbose:
        return
    for name in LIGHTNING_INFO_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # Lightning 2.6 builds torch pytree specs the way torch 2.13 deprecates: nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # torchdata 0.11's StatefulDataLoader calls a torch function torch 2.13 deprecates, at every epoch.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def train(cfg: DictConfig, plan: Plan) -> Dict[str, Any]:
    """Build, fit, and record the final metrics (rank 0 writes results.yaml). `cfg` and `plan` are
    the run's as the command's preflight checked and saved them."""
    import torch

    from pytorch_lightning.utilities.model_helpers import is_overridden

    from runner.rank.build import build

    quiet_console(cfg.verbose)

    run_dir = Path(cfg.paths.output_dir)
    built = build(cfg, plan, run_dir)
    trainer = built.trainer
    if cfg.test:
        for hook, owner in (("test_dataloader", built.datamodule), ("test_step", built.model)):
            require(is_overridden(hook, owner), "test", True, f"{type(owner).__name__} has no {hook}")
    if cfg.evaluate:  # the weights of ckpt_path, no training
        trainer.validate(built.model, datamodule=built.datamodule, ckpt_path=cfg.ckpt_path)
    else:
        trainer.fit(built.model, datamodule=built.datamodule, ckpt_path=cfg.ckpt_path)
        save_last_checkpoint(trainer)
    results = {name: float(value) for name, value in trainer.callback_metrics.items()}
    if cfg.test:  # the weights fit ended with, or ckpt_path's
        trainer.test(built.model, datamodule=built.datamodule, ckpt_path=cfg.ckpt_path if cfg.evaluate else None)
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


def train_from(records: Path) -> Dict[str, Any]:
    """Train from the config.yaml and plan.yaml the command saved in `records` (a fresh run
    directory: a finished run is replayed into a new one with `lightfleet replay`). The command
    checked both; only whether the run already finished is the rank's to see."""
    cfg = OmegaConf.load(records / CONFIG_YAML)
    require(not (Path(cfg.paths.output_dir) / RESULTS_YAML).exists(), "run directory", str(records),
            f"has finished; `lightfleet replay {records}` runs it again in a new directory")
    return train(cfg, read_plan(records))


def report_failure(records: Path, error: Exception) -> int:
    """A rank's failure in the user's code: the traceback to a file of the run's logs, one line to
    stderr (the command repeats it); the exit status."""
    rank = os.environ.get("RANK", "0")
    path = records / rank_traceback(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(error)))
    print(f"lightfleet: {error_line(error)}; traceback in {path}", file=sys.stderr, flush=True)
    return 1


def main(records: Path) -> None:
    """One rank of a run (`python -m runner.train RUN_DIR`, started by runner/command/launch.py)."""
    from runner.rank.preemption import PREEMPTED, Preempted

    with exit_on_user_error():
        try:
            train_from(records)
        except (ConfigError, Refusal):
            raise
        except Preempted:  # the checkpoint is written: leave as below, with the preemption's status
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(PREEMPTED)
        except Exception as failure:  # noqa: BLE001 (whatever the user's code raises)
            sys.exit(report_failure(records, failure))
    # Everything is written (results, checkpoints, loggers finalised). Interpreter teardown would
    # now destroy torch's C++ communication objects in no set order, and one whose thread is still
    # joinable aborts the rank ("terminate called without an active exception", seen after
    # finished FSDP2 and pipeline runs): leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
