"""`lightfleet export-fleet`: a run's strategies, collective knobs and parameter-server mode as a
Fleet strategy file (protobuf text format), so that importing it gives the same strategy. Knobs
Fleet cannot hold are listed on stderr.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor

from runner import strategies
from runner.config.collective import CollectiveConfig, ParameterServerConfig, collective_knobs
from runner.core.errors import ConfigError
from runner.fleet.mapping import collective_fields, fleet_field
from runner.fleet.message import fleet_default, is_older, strategy_class
from runner.records.files import CONFIG_YAML, holds_run, read_yaml


def read_run_config(run_dir: Path) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Any], Dict[str, Any]]:
    """The selected strategies of the run in `run_dir` with their knobs, its collective.* knobs by
    key and its parameter_server.* knobs (defaults where the run predates them), from its config.yaml."""
    if not holds_run(run_dir):
        raise ConfigError(str(run_dir), None, f"no {CONFIG_YAML}: not a run directory")
    saved = read_yaml(run_dir / CONFIG_YAML) or {}
    node = saved.get("strategy")
    if not isinstance(node, dict):
        raise ConfigError(str(run_dir / CONFIG_YAML), None, "has no strategy mapping")
    collective = collective_knobs(CollectiveConfig())
    collective.update(collective_knobs(saved.get("collective") or {}))
    parameter_server = {**dataclasses.asdict(ParameterServerConfig()), **(saved.get("parameter_server") or {})}
    return {name: knobs for name, knobs in node.items() if knobs is not None}, collective, parameter_server


def export_parameter_server(message: Any, selected: Dict[str, Dict[str, Any]], knobs: Dict[str, Any]) -> None:
    """Set a_sync and a_sync_configs.k_steps for a sync or GEO run; the localsgd that GEO ran as
    is Fleet's GEO itself, so its switch is left off (import brings it back the same)."""
    if knobs["mode"] == "none":
        return
    message.a_sync = knobs["mode"] == "geo"
    message.a_sync_configs.k_steps = knobs["k_steps"]
    if knobs["mode"] == "geo" and selected.get("localsgd") == dataclasses.asdict(
            strategies.schemas()["localsgd"](k_steps=knobs["k_steps"])):
        del selected["localsgd"]


def export_collective(message: Any, knobs: Dict[str, Any]) -> List[str]:
    """Set the collective knobs away from lightfleet's defaults on the message; the lines saying
    why one could not be. One at its default is left out (num_threads 0 then reads as Fleet's 1)."""
    left_out = []
    defaults = collective_knobs(CollectiveConfig())
    for key, value in knobs.items():
        if value == defaults[key]:
            continue
        *parent, name = key.split(".")
        holder = getattr(message, parent[0]) if parent else message
        field = holder.DESCRIPTOR.fields_by_name.get(name) if key in collective_fields() else None
        if field is None or value is None:
            left_out.append(f"collective.{key} = {json.dumps(value)}: Fleet has no field for it")
        elif is_older(key):
            left_out.append(f"collective.{key} = {json.dumps(value)}: a field of older Fleet releases that Paddle "
                            "3.3.1 no longer has (a file setting it would not load there)")
        elif field.type == FieldDescriptor.TYPE_INT32 and value != int(value):
            left_out.append(f"collective.{key} = {json.dumps(value)}: Fleet's field is an integer")
        else:
            setattr(holder, name, int(value) if field.type == FieldDescriptor.TYPE_INT32 else value)
    return left_out


def to_fleet(message: Any, selected: Dict[str, Dict[str, Any]]) -> List[str]:
    """Switch these strategies on in the message and set their knobs; the knobs it cannot hold."""
    left_out = []
    for name, knobs in selected.items():
        setattr(message, name, True)  # every strategy has Fleet's switch of its name (tests/runner/test_fleet.py)
        defaults = dataclasses.asdict(strategies.schemas()[name]())
        for knob, value in knobs.items():
            left_out += export_knob(message, name, knob, value, defaults[knob])
    return left_out


def export_knob(message: Any, strategy: str, knob: str, value: Any, default: Any) -> List[str]:
    """Set `knob` on the message; the lines saying why it could not be."""
    key = f"strategy.{strategy}.{knob}"
    target = fleet_field(message, strategy, knob)
    if target is None:
        return [] if value == default else [f"{key} = {json.dumps(value)}: Fleet has no field for it"]
    field, to_fleet = target
    if value is None:
        return [f"{key} = null: Fleet has no null; Fleet's default {json.dumps(fleet_default(field))} applies"]
    fleet_value = to_fleet(value)
    # Left out only where Fleet and lightfleet agree: both read it back as the same value.
    if value != default or fleet_value != fleet_default(field):
        config = getattr(message, f"{strategy}_configs")
        if field.is_repeated:
            getattr(config, field.name).extend(fleet_value)
        else:
            setattr(config, field.name, fleet_value)
    return []


def export_fleet(run_dir: Path, target: Path) -> Tuple[List[str], str]:
    """Write the strategy of the run in `run_dir` as a Fleet file at `target`. Returns the lines
    for stderr (what Fleet cannot hold) and the line saying what was written."""
    selected, collective, parameter_server = read_run_config(run_dir)
    message = strategy_class()()
    export_parameter_server(message, selected, parameter_server)
    left_out = to_fleet(message, selected)
    left_out += export_collective(message, collective)
    header = f"# Fleet DistributedStrategy written by `lightfleet export-fleet` from the run directory {run_dir}\n"
    target.write_text(header + text_format.MessageToString(message))
    return [f"export-fleet: not exported: {line}" for line in left_out], f"wrote {target}"
