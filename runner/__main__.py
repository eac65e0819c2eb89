"""`python -m runner`: the lightfleet command."""
import sys

from runner.command.cli import main

sys.exit(main())
