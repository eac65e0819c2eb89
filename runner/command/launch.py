"""Start the processes of one run.

Lightning's own `ddp` launcher re-runs `sys.argv` for every rank, which under Hydra (and above
all under `-m` sweeps) makes each rank compose its own config and output directory (Lightning
#11300). lightfleet owns the launch instead: the run directory and its config.yaml exist before
any rank starts, and every rank is started with torch's elastic launcher, reads that one config
and logs into that one directory. Lightning then sees an externally launched job (TorchElastic
environment) and starts nothing.

On CPUs the ranks are forked from the command, which has imported torch, Lightning and the user's
modules for its checks: a rank starts in a fraction of a second instead of importing them again
(some 8 s of CPU each). CUDA cannot be used in a process forked from one that touched it, so where
a CUDA device is visible (or LIGHTFLEET_FRESH_RANKS is set, for user code that cannot be forked)
each rank is a fresh `python -m runner.train RUN_DIR`. A forked rank inherits the command's
threads' state too: GNU OpenMP's worker threads do not survive a fork, and a rank using more than
one thread then waits for them forever, so a command that forks keeps torch to one thread
(keep_forkable) from before its checks compute anything.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

from omegaconf import OmegaConf

from runner.command.console import progress_in_place, to_log_files
from runner.core import collector
from runner.core.errors import ConfigError, exit_on_user_error
from runner.core.paths import python_module, user_code_last
from runner.config.schema import TrainerConfig
from runner.rank.parent import COMMAND_PID, handling_stop_signals
from runner.records.files import (CONFIG_YAML, LOGS_DIR, PROGRESS_EVERY_ENV, PROGRESS_LINE, PROGRESS_LINE_ENV,
                                  progress_every_s)
from runner.records.run_dir import read_plan
from runner.core.world import World, launched_externally


class LogFilesOnly(logging.Handler):
    """Records into the job's log file, not onto the console."""

    def emit(self, record: logging.LogRecord) -> None:
        to_log_files(record)


def processes_per_node(world: World) -> int:
    if world.devices in ("auto", -1):  # Lightning's "all devices": every GPU, or one CPU process
        import torch

        return max(torch.cuda.device_count(), 1)
    return world.devices


FRESH_RANKS = "LIGHTFLEET_FRESH_RANKS"  # set (to anything): ranks start as fresh processes, never forked


def forks_ranks(world: World) -> bool:
    """Whether this command forks the ranks of a run laid out as `world` (the module's docstring)."""
    if launched_externally() or (processes_per_node(world) == 1 and world.num_nodes == 1) or FRESH_RANKS in os.environ:
        return False
    import torch

    return not torch.cuda.is_available()


def keep_forkable(world: World) -> None:
    """Before the command's checks run torch: one thread, if it will fork its ranks."""
    if forks_ranks(world):
        import torch

        torch.set_num_threads(1)


def check_devices(trainer: TrainerConfig, world: World) -> None:
    """Refuse devices this machine cannot give, before any process starts: more GPUs than its
    CUDA sees, GPU ids it lacks, device ids without CUDA (a launcher or scheduler that places the
    job itself is trusted)."""
    if launched_externally():
        return
    import torch

    gpus = torch.cuda.device_count()
    has = f"this machine has {gpus} CUDA device(s)" if gpus else "this machine has no CUDA device"
    accelerator, devices = trainer.accelerator, trainer.devices
    if accelerator in ("gpu", "cuda") and not gpus:
        raise ConfigError("trainer.accelerator", accelerator, f"{has}; use cpu or auto")
    on_gpus = accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus)
    if isinstance(devices, list) and not on_gpus:
        raise ConfigError("trainer.devices", devices, f"device ids name GPUs; on {accelerator} give a count "
                          f"(trainer.devices={len(devices)})")
    if on_gpus and isinstance(devices, list) and not all(isinstance(i, int) and 0 <= i < gpus for i in devices):
        raise ConfigError("trainer.devices", devices, f"{has}; ids go from 0 to {gpus - 1}")
    if on_gpus and isinstance(world.devices, int) and world.devices > gpus:
        raise ConfigError("trainer.devices", world.devices, f"{has}; set trainer.devices={gpus} or fewer per node")


@contextmanager
def stopping_at_once() -> Iterator[None]:
    """A preemption signal or Ctrl-C stops the run at once, as Preempted without a step, until
    training takes them over (runner/rank/preemption.py: a checkpoint at an agreed step) or torch's
    elastic agent does (it passes them on to the ranks); the handlers before are restored after."""
    from runner.rank.preemption import Preempted

    def stop(signum: int, _frame: object) -> None:
        raise Preempted(signum)

    with handling_stop_signals(stop):
        yield


def run(records: Path, world: World) -> None:
    """Train from the config in `records`: in this process, or in one process per device."""
    collector.settle()  # what start-up made, frozen: the ranks and the exit skip it (runner/core/collector.py)
    with stopping_at_once():
        nproc = processes_per_node(world)
        if launched_externally() or (nproc == 1 and world.num_nodes == 1):
            from runner.rank.train import train_from

            with nullcontext() if launched_externally() else relayed_progress(records):
                train_from(records)
        else:
            launch_ranks(records, world, nproc)


@contextmanager
def relayed_progress(records: Path) -> Iterator[None]:
    """Rank 0's progress bar written into a file and drawn by this process (runner/command/console.py):
    redrawn in place on a terminal, a line at most every 30 s in a log file, where tqdm's own
    redraws would add a line per step."""
    os.environ[PROGRESS_LINE_ENV] = str(records / PROGRESS_LINE)
    os.environ[PROGRESS_EVERY_ENV] = str(progress_every_s(sys.stdout))  # the bar's line is due as this console shows it
    try:
        with progress_in_place(records / PROGRESS_LINE):
            yield
    finally:
        del os.environ[PROGRESS_LINE_ENV], os.environ[PROGRESS_EVERY_ENV]  # this run's bar only, not a later job's


def launch_ranks(records: Path, world: World, nproc: int) -> None:
    """One rank per device of this node under torch's elastic agent, which runs in this process:
    forked (runner/rank/train.py forked_rank) or `python -m runner.train RUN_DIR`. When a rank dies
    the agent stops the others and, up to trainer.max_restarts times, starts them all again (they
    resume from the newest checkpoint: runner/rank/train.py)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent's own warnings about stopping ranks ("Received 2 death signal", torch.multiprocessing's
    # "Terminating process ... via signal SIGTERM") repeat what the CLI's summary line says. Each of
    # its modules' loggers sets its own level: quiet them all on the console, into the job's log.
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            agent = logging.getLogger(name)
            agent.handlers, agent.propagate = [LogFilesOnly()], False

    if world.num_nodes > 1:  # every node runs the same command; NODE_RANK orders them
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        # The run id prefixes every rendezvous key, so all nodes must derive the same one.
        rendezvous = dict(rdzv_backend="static", rdzv_endpoint=endpoint, run_id=f"lightfleet-{endpoint}",
                          rdzv_configs={"rank": int(os.environ["NODE_RANK"])})
    else:  # torchrun --standalone: a local store on a free port
        rendezvous = dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=uuid.uuid4().hex)
    # As torchrun does: ranks sharing a node split its cores instead of each grabbing all of them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # SLURM's warning before the time limit preempts as SIGTERM does: the agent passes SIGTERM on to
    # the ranks (and waits 30 s for them); SIGUSR1 would end this process at once.
    signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    restarts = OmegaConf.load(records / CONFIG_YAML).trainer.max_restarts
    # The rendezvous store the agent shares with the ranks keeps one round's keys into the next
    # (torch 2.14): restarted ranks would read the dead ones' addresses and fail to connect. Without
    # sharing, each round's rank 0 serves a store of its own.
    sharing = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if restarts else {}
    config = LaunchConfig(
        min_nodes=world.num_nodes, max_nodes=world.num_nodes, nproc_per_node=nproc,
        max_restarts=restarts, monitor_interval=0.1, log_line_prefix_template="[rank${rank}]:",
        start_method="fork",  # for forked_rank; a command line starts fresh processes whatever it says
        # Every rank's stdout/stderr lands in the run directory; the console shows rank 0 only.
        logs_specs=DefaultLogsSpecs(log_dir=str(records / LOGS_DIR), redirects=Std.ALL, tee=Std.ALL,
                                    local_ranks_filter={0}),
        **rendezvous,
    )
    os.environ[COMMAND_PID] = str(os.getpid())  # the ranks' tie to this process (runner/rank/parent.py)
    os.environ.update(sharing)
    try:
        with relayed_progress(records):
            if forks_ranks(world):
                from runner.rank.train import forked_rank

                elastic_launch(config, forked_rank)(str(records))
            else:
                python, *arguments = python_module("runner.train")
                elastic_launch(config, python)(*arguments, str(records))
    finally:
        for name in (COMMAND_PID, *sharing):  # for this run's ranks only: not for a later job run here
            del os.environ[name]


if __name__ == "__main__":  # `python -m runner.command.launch RUN_DIR`: a run already recorded (auto's trials)
    user_code_last()
    with exit_on_user_error():
        run(Path(sys.argv[1]), World(**read_plan(Path(sys.argv[1])).world))
