"""`lightfleet import-fleet`: a Fleet strategy file (protobuf text format, as Paddle's
`DistributedStrategy.save_to_prototxt` writes it) as a lightfleet experiment. Each field the file
sets becomes the lightfleet key it maps to (runner/fleet/mapping.py); every other one is listed
with why it has no lightfleet meaning, on stderr and as a comment of the experiment: nothing is
dropped silently. A knob of a selected strategy that the file leaves out takes Fleet's default
where it differs from lightfleet's (the file means Fleet's), said likewise.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import yaml
from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor

from runner import strategies
from runner.config.collective import ParameterServerConfig
from runner.config.compat import check, load_table
from runner.core.paths import EXPERIMENTS_DIR
from runner.core.errors import ConfigError, Refusal
from runner.fleet.mapping import (NOT_MAPPED, PARAMETER_SERVER_FIELDS, collective_fields, configured_strategy,
                                  fleet_field, knob_of)
from runner.fleet.message import fleet_default, plain, strategy_class


@dataclasses.dataclass
class Imported:
    """What a Fleet file says in lightfleet's terms."""

    strategies: Dict[str, Dict[str, Any]]  # selected strategy -> the knobs the file sets
    not_mapped: List[str]  # "field = value: why", one per field the file sets without a lightfleet meaning
    collective: Dict[str, Any] = dataclasses.field(default_factory=dict)  # collective.* key -> value
    parameter_server: Dict[str, Any] = dataclasses.field(default_factory=dict)  # parameter_server.* knobs
    fleet_defaults: List[str] = dataclasses.field(default_factory=list)  # "key = value (lightfleet's default: ...)"


# ---- reading a Fleet file ------------------------------------------------------------------------------

class _SkipRecorder(text_format._Parser):  # pylint: disable=protected-access
    """text_format's parser with allow_unknown_field=True (what text_format.Parse builds), noting
    the unknown fields it skips: protobuf skips them without a word. Fields inside a skipped
    message are part of it, not noted again."""

    def __init__(self) -> None:
        super().__init__(allow_unknown_field=True)
        self.skipped: List[Tuple[str, str]] = []  # (full name of the message holding it, field name)
        self.depth = 0

    def _SkipFieldContents(self, tokenizer, field_name, immediate_message_type):  # noqa: N802 (protobuf's name)
        if self.depth == 0:
            self.skipped.append((immediate_message_type, field_name))
        self.depth += 1
        try:
            super()._SkipFieldContents(tokenizer, field_name, immediate_message_type)
        finally:
            self.depth -= 1


def read_fleet(path: Path) -> Tuple[Any, List[str]]:
    """The DistributedStrategy in text format at `path`, and the unknown fields it skipped."""
    if not path.is_file():
        raise ConfigError(str(path), None, "no such file (a Fleet strategy file, as save_to_prototxt writes it)")
    parser = _SkipRecorder()
    try:
        message = parser.ParseLines(path.read_text().splitlines(), strategy_class()())
    except (text_format.ParseError, UnicodeDecodeError) as error:
        reason = str(error).strip().splitlines()[0]
        raise ConfigError(str(path), None, f"not a Fleet strategy in protobuf text format: {reason}") from None
    return message, [field_path(holder, name) for holder, name in parser.skipped]


def field_path(message_type: str, name: str) -> str:
    """`name` of the message of full name `message_type`, as a path from DistributedStrategy."""
    holders = {field.message_type.full_name: field.name
               for field in strategy_class().DESCRIPTOR.fields if field.message_type is not None}
    return f"{holders[message_type]}.{name}" if message_type in holders else name


def translate(message: Any) -> Imported:
    """The selected strategies with the knobs the file sets, and every other field it sets, with why."""
    switches = [name for name in strategies.names() if getattr(message, name)]
    imported = Imported({name: {} for name in switches}, [])
    take_parameter_server(imported, message)
    for field, value in message.ListFields():  # the fields the file sets
        if field.name in strategies.names() or field.name in PARAMETER_SERVER_FIELDS:
            continue
        if field.name in collective_fields():
            imported.collective[field.name] = plain(field, value)
            continue
        if field.message_type is None or field.is_repeated:  # a scalar, or a list of tables (downpour_table_param)
            imported.not_mapped.append(unmapped(field.name, field, value, NOT_MAPPED[field.name]))
            continue
        for sub_field, sub_value in value.ListFields():
            take_config_field(imported, field.name, sub_field, sub_value)
    for name in imported.strategies:
        take_fleet_defaults(imported, message, name)
    return imported


def take_fleet_defaults(imported: Imported, message: Any, strategy: str) -> None:
    """The knobs of `strategy` that the file leaves out, at Fleet's default where lightfleet's differs
    (e.g. amp's decr_ratio 0.8, not 0.5)."""
    knobs = imported.strategies[strategy]
    for knob, default in dataclasses.asdict(strategies.schemas()[strategy]()).items():
        target = fleet_field(message, strategy, knob)
        if knob in knobs or target is None:
            continue
        _, from_fleet = knob_of(strategy, target[0].name)
        value = from_fleet(fleet_default(target[0]))
        if value != default:
            knobs[knob] = value
            imported.fleet_defaults.append(f"strategy.{strategy}.{knob} = {json.dumps(value)} "
                                           f"(lightfleet's default: {json.dumps(default)})")


def take_parameter_server(imported: Imported, message: Any) -> None:
    """parameter_server.* from a_sync and a_sync_configs.k_steps, read as Fleet reads them (an
    async mode is taken as it is, and refused by the check of the imported experiment)."""
    k_steps = message.a_sync_configs.k_steps
    if k_steps < 0:
        why = "selects no parameter-server mode while a_sync_configs.k_steps < 0 (Fleet then trains collectively)"
        imported.not_mapped += [unmapped(path, field, value, why) for path, field, value in parameter_server_set(message)]
        return
    if message.HasField("a_sync") or message.a_sync_configs.HasField("k_steps"):
        mode = ("geo" if k_steps else "async") if message.a_sync else "sync"
        imported.parameter_server = {"mode": mode, **({"k_steps": k_steps} if k_steps else {})}


def parameter_server_set(message: Any) -> List[Tuple[str, FieldDescriptor, Any]]:
    """(path, field, value) of a_sync and a_sync_configs.k_steps, where the file sets them."""
    found = []
    for holder, prefix in ((message, ""), (message.a_sync_configs, "a_sync_configs.")):
        for field, value in holder.ListFields():
            if prefix + field.name in PARAMETER_SERVER_FIELDS:
                found.append((prefix + field.name, field, value))
    return found


def take_config_field(imported: Imported, config: str, field: FieldDescriptor, value: Any) -> None:
    path = f"{config}.{field.name}"
    strategy = configured_strategy(config)
    knob = knob_of(strategy, field.name) if strategy else None
    if path in PARAMETER_SERVER_FIELDS:
        return  # take_parameter_server's
    if path in collective_fields():
        imported.collective[path] = plain(field, value)
    elif knob is None:
        imported.not_mapped.append(unmapped(path, field, value, NOT_MAPPED.get(path, NOT_MAPPED.get(config))))
    elif strategy not in imported.strategies:
        imported.not_mapped.append(unmapped(path, field, value, f"{strategy} is off in this file ({strategy}: false)"))
    else:
        name, from_fleet = knob
        imported.strategies[strategy][name] = from_fleet(plain(field, value))


def unmapped(path: str, field: FieldDescriptor, value: Any, why: str) -> str:
    return f"{path} = {json.dumps(plain(field, value))}: {why}"


def problems(selected: Dict[str, Dict[str, Any]], parameter_server: Dict[str, Any]) -> List[str]:
    """Why these strategies and this parameter-server mode would not run as they are: the table's
    refusal (GEO runs as localsgd), out-of-range knobs, an async mode."""
    found = []
    try:
        mode = ParameterServerConfig(**parameter_server).mode
    except ConfigError as error:
        found.append(f"error: {error}")
        mode = None
    try:
        check(list(selected) + (["localsgd"] if mode == "geo" and "localsgd" not in selected else []), load_table())
    except Refusal as refusal:
        found.append(f"refused: {refusal}")
    for name, knobs in selected.items():
        try:
            strategies.schemas()[name](**knobs)
        except ConfigError as error:
            found.append(f"error: {error}")
    return found


# ---- writing the experiment ------------------------------------------------------------------------------

def run_command(experiment: Path) -> str:
    """How to run the experiment at `experiment` (Hydra finds experiments in an `experiment/` folder)."""
    name = experiment.stem
    if experiment.resolve().parent == EXPERIMENTS_DIR:
        return f"lightfleet experiment={name}"
    if experiment.parent.name == "experiment":
        return f"lightfleet --config-dir {experiment.parent.parent} experiment={name}"
    return f"move it to DIR/experiment/{experiment.name}, then: lightfleet --config-dir DIR experiment={name}"


def experiment_text(imported: Imported, source: Path, experiment: Path, found: List[str]) -> str:
    # Hydra reads `# @package` only above every other comment, so the mark of a choice to make follows it.
    lines = ["# @package _global_"]
    lines += [f"# NEEDS A CHOICE before it runs: {problem}" for problem in found]
    lines += [f"# Imported from the Fleet strategy file {source} by `lightfleet import-fleet`.",
              f"# Run: {run_command(experiment)}"]
    if imported.fleet_defaults:
        lines.append("# Fleet's defaults, for what the file leaves out where lightfleet's differ:")
        lines += [f"#   {line}" for line in imported.fleet_defaults]
    if imported.not_mapped:
        lines.append("# Fields of the Fleet file without a lightfleet meaning (docs/fleet.md):")
        lines += [f"#   {line}" for line in imported.not_mapped]
    body: Dict[str, Any] = {"defaults": [{"override /strategy": list(imported.strategies)}], "name": experiment.stem}
    knobs = {name: values for name, values in imported.strategies.items() if values}
    if knobs:
        body["strategy"] = knobs
    if imported.collective:
        body["collective"] = nested(imported.collective)
    if imported.parameter_server:
        body["parameter_server"] = imported.parameter_server
    return "\n".join(lines) + "\n" + yaml.safe_dump(body, sort_keys=False, default_flow_style=None)


def nested(knobs: Dict[str, Any]) -> Dict[str, Any]:
    """{"a.b": 1} as {"a": {"b": 1}}."""
    out: Dict[str, Any] = {}
    for key, value in knobs.items():
        *parents, leaf = key.split(".")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return out


def import_fleet(source: Path, experiment: Path) -> Tuple[List[str], str]:
    """Write the lightfleet experiment of the Fleet file `source` at `experiment`. Returns the lines
    for stderr (unknown fields skipped, fields without a lightfleet meaning, why the experiment
    would not run as it is) and the line saying what was written."""
    message, unknown = read_fleet(source)
    imported = translate(message)
    found = problems(imported.strategies, imported.parameter_server)
    experiment.parent.mkdir(parents=True, exist_ok=True)
    experiment.write_text(experiment_text(imported, source, experiment, found))
    notes = [f"import-fleet: warning: unknown Fleet fields skipped: {', '.join(unknown)}"] if unknown else []
    notes += [f"import-fleet: Fleet's default: {line}" for line in imported.fleet_defaults]
    notes += [f"import-fleet: not mapped: {line}" for line in imported.not_mapped]
    # The file is written either way: these say why it would not run as it is, not that the import failed.
    notes += [f"import-fleet: written, but it will not run as it is: {problem}" for problem in found]
    marked = " (marked: it needs a choice)" if found else ""
    return notes, f"wrote {experiment}{marked}; run: {run_command(experiment)}"
