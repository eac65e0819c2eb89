"""Train one run from its saved config: the same code path for a single process and for every
rank of a multi-process run (`python -m runner.train RUN_DIR`, started by runner/launch.py)."""
from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Dict

from omegaconf import OmegaConf

from runner.config import RunSpec, validate
from runner.errors import exit_on_user_error
from runner.plan import Plan
from runner.records import read_plan, write_yaml


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


def train(spec: RunSpec, plan: Plan) -> Dict[str, Any]:
    """Build, fit, and record the final metrics (rank 0 writes results.yaml)."""
    import torch

    from runner.build import build

    quiet_console(spec.cfg.verbose)

    run_dir = Path(spec.cfg.paths.output_dir)
    built = build(spec, plan, run_dir)
    trainer = built.trainer
    trainer.fit(built.model, datamodule=built.datamodule)
    results = {name: float(value) for name, value in trainer.callback_metrics.items()}
    results["global_step"] = trainer.global_step
    if trainer.is_global_zero:
        write_yaml(run_dir / "results.yaml", results)
    if torch.distributed.is_initialized():
        # Left to interpreter exit, the process group's communication threads can be torn down
        # while still joinable, which aborts the rank ("terminate called without an active
        # exception") after a successful run.
        torch.distributed.destroy_process_group()
    return results


def train_from(records: Path) -> Dict[str, Any]:
    """Train from the config.yaml and plan.yaml the command saved in `records`."""
    return train(validate(OmegaConf.load(records / "config.yaml")), read_plan(records))


if __name__ == "__main__":
    with exit_on_user_error():
        train_from(Path(sys.argv[1]))
