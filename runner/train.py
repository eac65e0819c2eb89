"""`python -m runner.train RUN_DIR`: one rank of a run, from the config and plan the command saved
in RUN_DIR (runner/rank/train.py; runner/command/launch.py starts every rank this way)."""
import sys
from pathlib import Path

from runner.core.paths import user_code_last
from runner.rank.parent import tie_to_command

if __name__ == "__main__":
    tie_to_command()  # first, before torch is imported: a command killed now takes its ranks with it
    user_code_last()
    from runner.rank.train import main

    main(Path(sys.argv[1]))
