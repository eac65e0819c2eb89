"""`python -m runner`: the lightfleet command."""
import sys

from runner.cli import main

sys.exit(main())
