"""Train one run from its saved config: the same code path for a single process and for every
rank of a multi-process run (`python -m runner.train RUN_DIR`, started by runner/launch.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

from omegaconf import OmegaConf

from runner.config import RunSpec, validate
from runner.plan import Plan, make_plan
from runner.records import write_yaml


def train(spec: RunSpec, plan: Plan) -> Dict[str, Any]:
    """Build, fit, and record the final metrics (rank 0 writes build.yaml and results.yaml)."""
    import torch

    from runner.build import build

    run_dir = Path(spec.cfg.paths.output_dir)
    built = build(spec, plan, run_dir)
    trainer = built.trainer
    if trainer.is_global_zero:
        write_yaml(run_dir / "build.yaml", built.resolved)
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
    """Train from the config.yaml in `records` (every rank derives the same plan from it)."""
    spec = validate(OmegaConf.load(records / "config.yaml"))
    return train(spec, make_plan(spec.strategies, spec.trainer, spec.batch_size))


if __name__ == "__main__":
    from runner.cli import exit_on_user_error

    with exit_on_user_error():
        train_from(Path(sys.argv[1]))
