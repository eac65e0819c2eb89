"""Start the processes of one run.

Lightning's own `ddp` launcher re-runs `sys.argv` for every rank, which under Hydra (and above
all under `-m` sweeps) makes each rank compose its own config and output directory (Lightning
#11300). lightfleet owns the launch instead: the run directory and its config.yaml exist before
any rank starts, and every rank is started with torch's elastic launcher as
`python -m runner.train RUN_DIR`, reads that one config and logs into that one directory.
Lightning then sees an externally launched job (TorchElastic environment) and starts nothing.
"""
from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Dict

from runner.errors import ConfigError

# Set by torchrun, SLURM's srun or another launcher that already started this rank.
EXTERNAL_LAUNCH_VARS = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")
MULTI_NODE_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def processes_per_node(world: Dict[str, Any]) -> int:
    devices = world["devices"]
    if devices in ("auto", -1):  # Lightning's "all devices": every GPU, or one CPU process
        import torch

        return max(torch.cuda.device_count(), 1)
    return devices


def check_multi_node(world: Dict[str, Any]) -> None:
    """Fail before spawning when a multi-node run lacks its rendezvous address."""
    if world["num_nodes"] > 1 and not launched_externally():
        missing = [var for var in MULTI_NODE_VARS if var not in os.environ]
        if missing:
            raise ConfigError("trainer.num_nodes", world["num_nodes"],
                              f"needs {', '.join(MULTI_NODE_VARS)} set on every node (missing: {', '.join(missing)})")


def launched_externally() -> bool:
    return any(var in os.environ for var in EXTERNAL_LAUNCH_VARS)


def records_subdir(world: Dict[str, Any]) -> str:
    """Where this copy of the command keeps its records inside the run directory.

    One copy runs per node (multi-node) or per rank (under torchrun/SLURM), all with the same
    output directory, often on a shared filesystem: the first copy writes the run directory
    itself, the others `nodes/<NODE_RANK>/` or `ranks/<RANK>/`, so no two write one file.
    """
    if launched_externally():
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        return f"ranks/{rank}" if rank else ""
    if world["num_nodes"] > 1 and int(os.environ["NODE_RANK"]):
        return f"nodes/{os.environ['NODE_RANK']}"
    return ""


def run(records: Path, world: Dict[str, Any]) -> None:
    """Train from the config in `records`: in this process, or in one process per device."""
    nproc = processes_per_node(world)
    if launched_externally() or (nproc == 1 and world["num_nodes"] == 1):
        from runner.train import train_from

        train_from(records)
        return

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    # The agent's own warnings about stopping ranks repeat what the CLI's summary line says.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if world["num_nodes"] > 1:  # every node runs the same command; NODE_RANK orders them
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        # The run id prefixes every rendezvous key, so all nodes must derive the same one.
        rendezvous = dict(rdzv_backend="static", rdzv_endpoint=endpoint, run_id=f"lightfleet-{endpoint}",
                          rdzv_configs={"rank": int(os.environ["NODE_RANK"])})
    else:  # torchrun --standalone: a local store on a free port
        rendezvous = dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=uuid.uuid4().hex)
    # As torchrun does: ranks sharing a node split its cores instead of each grabbing all of them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=world["num_nodes"], max_nodes=world["num_nodes"], nproc_per_node=nproc,
        max_restarts=0, monitor_interval=0.1, log_line_prefix_template="[rank${rank}]:",
        # Every rank's stdout/stderr lands in the run directory; the console shows rank 0 only.
        logs_specs=DefaultLogsSpecs(log_dir=str(records / "logs"), redirects=Std.ALL, tee=Std.ALL,
                                    local_ranks_filter={0}),
        **rendezvous,
    )
    elastic_launch(config, sys.executable)("-m", "runner.train", str(records))
