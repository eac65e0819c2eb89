"""`python -m runner.train RUN_DIR`: one rank of a run started as a fresh process, from the config
and plan the command saved in RUN_DIR (runner/rank/train.py). runner/command/launch.py starts ranks
this way where CUDA is, or where LIGHTFLEET_FRESH_RANKS is set; elsewhere it forks them."""
import logging
import os
import sys
from pathlib import Path

from runner.core import collector
from runner.core.paths import user_code_last
from runner.rank.parent import tie_to_command

if __name__ == "__main__":
    tie_to_command()  # first, before torch is imported: a command killed now takes its ranks with it
    user_code_last()
    with collector.paused():  # the bulk of a rank's start-up, as the command's (runner/core/collector.py)
        import pytorch_lightning  # noqa: F401
        from runner.rank.train import main
        collector.settle()
    main(Path(sys.argv[1]))
    # Everything is written (results, checkpoints, loggers finalised). Interpreter teardown would
    # now destroy torch's C++ communication objects in no set order, and one whose thread is still
    # joinable aborts the rank ("terminate called without an active exception", seen after
    # finished FSDP2 and pipeline runs): leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
