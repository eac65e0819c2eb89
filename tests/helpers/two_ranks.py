"""`python -m tests.helpers.two_ranks NPROC SCRIPT ARG`: `torchrun --standalone --nproc-per-node NPROC
SCRIPT ARG` with the ranks forked from this process instead of started fresh, as the command forks
its ranks on a CPU (runner/command/launch.py). Started through tests/helpers/command_server.py, the
ranks begin with torch and Lightning imported. Each rank runs SCRIPT as `python SCRIPT ARG` would:
`__main__`, its folder first on sys.path, one torch thread (OMP_NUM_THREADS=1)."""
import os
import runpy
import sys
import uuid


def run_script(script: str, argument: str) -> None:
    import torch

    torch.set_num_threads(1)
    sys.argv = [script, argument]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def main(nproc: int, script: str, argument: str) -> None:
    import torch
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # GNU OpenMP's worker threads do not survive a fork: compute nothing here on more than one.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, max_restarts=0, monitor_interval=0.1,
                          start_method="fork", rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                          run_id=uuid.uuid4().hex)
    elastic_launch(config, run_script)(script, argument)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
