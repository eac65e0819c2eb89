"""`lightfleet import-fleet FILE.prototxt [-o FILE.yaml]` and `lightfleet export-fleet RUN_DIR [-o FILE]`:
Fleet strategy files (protobuf text format, as Paddle's `DistributedStrategy.save_to_prototxt`
writes them) in and out of lightfleet (runner/fleet/import_fleet.py, export_fleet.py; the
message: message.py; which lightfleet key each field is: mapping.py). docs/fleet.md has the
whole table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, List, NamedTuple, Sequence, Tuple

from runner.core.errors import ConfigError, exit_on_user_error
from runner.core.paths import user_path
from runner.fleet.export_fleet import export_fleet
from runner.fleet.import_fleet import import_fleet
from runner.records.files import CONFIG_YAML, FLEET_PROTOTXT


class Command(NamedTuple):
    run: Callable[[Path, Path], Tuple[List[str], str]]  # (source, output) -> (lines for stderr, what it wrote)
    default_output: Callable[[Path], Path]  # of the source
    description: str
    source: str  # the argument's name
    source_help: str
    output_help: str


COMMANDS = {
    "import-fleet": Command(import_fleet, lambda source: Path(f"{source.stem}.yaml"),
                            "Write a lightfleet experiment from a Fleet strategy file.", "FILE",
                            "a Fleet strategy file in protobuf text format (as save_to_prototxt writes it)",
                            "the experiment to write (default: ./<FILE's stem>.yaml)"),
    "export-fleet": Command(export_fleet, lambda run_dir: run_dir / FLEET_PROTOTXT,
                            "Write a run's strategies as a Fleet strategy file.", "RUN_DIR",
                            f"a run directory (one holding {CONFIG_YAML})",
                            f"the Fleet strategy file to write (default: RUN_DIR/{FLEET_PROTOTXT})"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit status 2, as every lightfleet error
        raise ConfigError(self.prog, None, message)


def main(args: Sequence[str]) -> int:
    """`lightfleet import-fleet ...` or `lightfleet export-fleet ...`: args[0] names the command."""
    with exit_on_user_error():
        command = COMMANDS[args[0]]
        parser = _Parser(prog=f"lightfleet {args[0]}", description=command.description)
        parser.add_argument("source", metavar=command.source, help=command.source_help)
        parser.add_argument("-o", "--output", help=command.output_help)
        parsed = parser.parse_args(args[1:])
        source = user_path(parsed.source)
        output = user_path(parsed.output) if parsed.output else command.default_output(source)
        if output.exists():
            raise ConfigError(str(output), None, "exists; lightfleet never overwrites a file (choose another -o)")
        notes, wrote = command.run(source, output)
    for line in notes:
        print(f"lightfleet: {line}", file=sys.stderr)
    print(wrote)
    return 0
