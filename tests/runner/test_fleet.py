"""`lightfleet import-fleet` and `export-fleet`: Fleet strategy files in and out, the round trip,
every Fleet field accounted for, and the one-line errors. No training except the one end-to-end
test through the real command."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
import yaml
from google.protobuf.descriptor import FieldDescriptor
from omegaconf import OmegaConf
from tests.helpers.paddle_reference import run_paddle

from runner import strategies
from runner.core.paths import EXPERIMENTS_DIR
from runner.config.compose import compose_config
from runner.command import preflight
from runner.config.checks import validate
from runner.core.errors import Refusal
from runner.fleet.cli import main
from runner.fleet.import_fleet import read_fleet, run_command, translate
from runner.fleet.mapping import (NOT_MAPPED, PARAMETER_SERVER_FIELDS, RENAMED, collective_fields, configured_strategy,
                                  fleet_field, knob_of)
from runner.fleet.message import OLDER_FIELDS, fleet_default, plain, shortest_float32, strategy_class
from runner.strategies.amp import AmpConfig

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# The collective-training guide's ResNet-50 strategy, in the field order save_to_prototxt writes.
# lightfleet's amp lists name module classes (Fleet's name operators), hence LayerNorm.
RESNET50 = """\
amp: true
sync_nccl_allreduce: true
nccl_comm_num: 2
fuse_all_reduce_ops: true
fuse_grad_size_in_MB: 32
amp_configs {
  init_loss_scaling: 32768.0
  use_dynamic_loss_scaling: true
  custom_black_list: "LayerNorm"
}
build_strategy {
  fuse_elewise_add_act_ops: true
  fuse_bn_act_ops: true
  fuse_relu_depthwise_conv: true
  fuse_broadcast_ops: true
  fuse_all_optimizer_ops: true
  enable_inplace: true
  enable_auto_fusion: true
}
execution_strategy {
  num_threads: 1
  num_iteration_per_drop_scope: 100
}
"""
RESNET50_NOT_MAPPED = ["build_strategy.fuse_broadcast_ops = true"]
RESNET50_COLLECTIVE = {  # the rest of its collective fields, as collective.* knobs
    "sync_nccl_allreduce": True, "nccl_comm_num": 2, "fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": 32,
    "build_strategy": {"fuse_elewise_add_act_ops": True, "fuse_bn_act_ops": True, "fuse_relu_depthwise_conv": True,
                       "fuse_all_optimizer_ops": True, "enable_inplace": True, "enable_auto_fusion": True},
    "execution_strategy": {"num_threads": 1, "num_iteration_per_drop_scope": 100},
}
NOT_MAPPED_LINE = "lightfleet: import-fleet: not mapped: "

ROUND_TRIPS = {
    "amp": ["strategy=[amp]"],
    "amp_recompute_gradient_merge": [
        "strategy=[amp,recompute,gradient_merge]", "strategy.amp.dtype=bfloat16", "strategy.amp.decr_ratio=0.8",
        "strategy.amp.incr_every_n_steps=500", "strategy.amp.custom_white_list=[Linear]",
        "strategy.recompute.checkpoints=[blocks.0,blocks.2]", "strategy.recompute.enable_offload=true",
        "strategy.gradient_merge.k_steps=4", "strategy.gradient_merge.avg=false"],
    "sharding_stage2": ["strategy=[sharding]", "strategy.sharding.stage=2", "strategy.sharding.degree=2",
                        "strategy.sharding.segment_broadcast_MB=0.1"],
    "dgc_recompute": ["strategy=[dgc,recompute]", "strategy.dgc.rampup_begin_step=10", "strategy.dgc.rampup_step=20",
                      "strategy.dgc.sparsity=[0.75,0.9375,0.984375,0.996,0.999]"],
    "lamb": ["strategy=[lamb]", "strategy.lamb.lamb_weight_decay=0.02",
             "strategy.lamb.exclude_from_weight_decay=[bias,norm]"],
    # accumulate_steps at lightfleet's default, 4, where Fleet's is 1 (micro_batch_size: Fleet has no null).
    "pipeline_defaults": ["strategy=[pipeline]", "strategy.pipeline.micro_batch_size=16"],
    "pipeline_gpipe": ["strategy=[pipeline]", "strategy.pipeline.schedule_mode=GPipe",
                       "strategy.pipeline.accumulate_steps=8", "strategy.pipeline.micro_batch_size=4"],
    "sync": ["parameter_server.mode=sync"],
    "geo": ["parameter_server.mode=geo", "parameter_server.k_steps=4"],
    "geo_localsgd_begin_step": ["parameter_server.mode=geo", "parameter_server.k_steps=4", "strategy=[localsgd]",
                                "strategy.localsgd.k_steps=4", "strategy.localsgd.begin_step=3"],
}


def import_text(tmp_path: Path, text: str, name: str = "imported") -> Path:
    """Import `text` as a Fleet file into tmp_path/cfg/experiment/NAME.yaml."""
    source = tmp_path / f"{name}.prototxt"
    source.write_text(text)
    experiment = tmp_path / "cfg" / "experiment" / f"{name}.yaml"
    assert main(["import-fleet", str(source), "-o", str(experiment)]) == 0
    return experiment


def imported_spec(experiment: Path):
    """The checked experiment, composed as `lightfleet --config-dir` would."""
    return validate(compose_config([f"experiment={experiment.stem}"], config_dir=str(experiment.parent.parent)))


def imported_strategies(experiment: Path) -> Dict[str, object]:
    return imported_spec(experiment).strategies


def saved_run(tmp_path: Path, overrides: List[str]) -> Path:
    """A run directory holding the config.yaml of these overrides, as a run saves it: every
    strategy named, null unless selected."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    OmegaConf.save(compose_config(overrides), run_dir / "config.yaml")
    return run_dir


def not_mapped(stderr: str) -> List[str]:
    return [line[len(NOT_MAPPED_LINE):] for line in stderr.splitlines() if line.startswith(NOT_MAPPED_LINE)]


@pytest.mark.parametrize("overrides", ROUND_TRIPS.values(), ids=list(ROUND_TRIPS))
def test_import_of_an_export_gives_the_same_strategy(tmp_path, capsys, overrides):
    run_dir = saved_run(tmp_path, overrides)
    assert main(["export-fleet", str(run_dir)]) == 0
    experiment = tmp_path / "cfg" / "experiment" / "back.yaml"
    assert main(["import-fleet", str(run_dir / "fleet_strategy.prototxt"), "-o", str(experiment)]) == 0
    assert capsys.readouterr().err == ""  # every knob exported, every field mapped back
    expected, imported = validate(compose_config(overrides)), imported_spec(experiment)
    assert list(imported.strategies.items()) == list(expected.strategies.items())
    assert imported.cfg.parameter_server == expected.cfg.parameter_server


@pytest.mark.parametrize("overrides", ROUND_TRIPS.values(), ids=list(ROUND_TRIPS))
def test_fleet_reads_every_exported_knob_as_the_run_set_it(tmp_path, capsys, overrides):
    """What Fleet itself reads from the file: a field left out reads as Fleet's default, so a knob
    whose lightfleet default differs from Fleet's must be written (import brings back lightfleet's
    defaults for absent fields, which the round trip above cannot tell apart)."""
    main(["export-fleet", str(saved_run(tmp_path, overrides)), "-o", str(tmp_path / "out.prototxt")])
    message, skipped = read_fleet(tmp_path / "out.prototxt")
    assert not skipped
    for name, knobs in validate(compose_config(overrides)).strategies.items():
        if not getattr(message, name):  # geo's localsgd: written as Fleet's a_sync_configs.k_steps
            continue
        for knob, value in dataclasses.asdict(knobs).items():
            target = fleet_field(message, name, knob)
            if target is None or value is None:  # no such field, or no value to write: export says so
                continue
            field, to_fleet = target
            read = plain(field, getattr(getattr(message, f"{name}_configs"), field.name))
            expected = to_fleet(value)
            assert read == (plain(field, expected) if field.type != field.TYPE_ENUM else expected), (name, knob)


def test_collective_knobs_export_and_import_back(tmp_path, capsys):
    # execution_strategy is a field of older releases: Paddle 3.3.1 would refuse a file setting it.
    overrides = ["collective.fuse_grad_size_in_MB=16", "collective.sync_batch_norm=true",
                 "collective.build_strategy.fuse_bn_act_ops=true", "collective.build_strategy.fuse_gemm_epilogue=true",
                 "collective.gpu_memory_fraction=0.5", "collective.execution_strategy.num_threads=2"]
    main(["export-fleet", str(saved_run(tmp_path, overrides)), "-o", str(tmp_path / "out.prototxt")])
    assert capsys.readouterr().err.splitlines() == [
        "lightfleet: export-fleet: not exported: collective.gpu_memory_fraction = 0.5: Fleet has no field for it",
        "lightfleet: export-fleet: not exported: collective.execution_strategy.num_threads = 2: a field of older "
        "Fleet releases that Paddle 3.3.1 no longer has (a file setting it would not load there)"]
    assert (tmp_path / "out.prototxt").read_text().splitlines()[1:] == [
        "sync_batch_norm: true", "fuse_grad_size_in_MB: 16", "build_strategy {", "  fuse_bn_act_ops: true",
        "  fuse_gemm_epilogue: true", "}"]
    experiment = tmp_path / "cfg" / "experiment" / "back.yaml"
    main(["import-fleet", str(tmp_path / "out.prototxt"), "-o", str(experiment)])
    cfg = compose_config([f"experiment={experiment.stem}"], config_dir=str(tmp_path / "cfg"))
    expected = compose_config(overrides[:-2])
    assert OmegaConf.to_container(cfg.collective) == OmegaConf.to_container(expected.collective)


def test_export_writes_fleet_names_and_values(tmp_path, capsys):
    run_dir = saved_run(tmp_path, ROUND_TRIPS["pipeline_gpipe"])
    main(["export-fleet", str(run_dir), "-o", str(tmp_path / "out.prototxt")])
    lines = (tmp_path / "out.prototxt").read_text().splitlines()
    assert lines[0].startswith("# Fleet DistributedStrategy written by `lightfleet export-fleet`")
    assert lines[1:] == ["pipeline: true", "pipeline_configs {", "  micro_batch_size: 4", "  accumulate_steps: 8",
                         '  schedule_mode: "F-then-B"', "}"]
    assert capsys.readouterr().out == f"wrote {tmp_path / 'out.prototxt'}\n"


def test_knobs_fleet_cannot_hold_are_listed_on_export(tmp_path, capsys):
    main(["export-fleet", str(saved_run(tmp_path, ["strategy=[fp16_allreduce,sharding]",
                                                   "strategy.fp16_allreduce.dtype=bfloat16"]))])
    assert capsys.readouterr().err.splitlines() == [
        'lightfleet: export-fleet: not exported: strategy.fp16_allreduce.dtype = "bfloat16": Fleet has no field for it',
        "lightfleet: export-fleet: not exported: strategy.sharding.degree = null: Fleet has no null; "
        "Fleet's default 8 applies"]


def test_resnet50_strategy_imports_as_amp_with_its_knobs(tmp_path, capsys):
    experiment = import_text(tmp_path, RESNET50, "fleet_resnet")
    err = capsys.readouterr().err
    listed = not_mapped(err)
    assert [line.split(": ")[0] for line in listed] == RESNET50_NOT_MAPPED  # each once, in the file's order
    assert all(len(line.split(": ", 1)[1]) > 10 for line in listed)  # each with its reason
    assert imported_strategies(experiment) == {
        "amp": AmpConfig(init_loss_scaling=32768.0, use_dynamic_loss_scaling=True, custom_black_list=["LayerNorm"],
                         decr_ratio=0.8)}  # Fleet's default, which the file leaves out
    head = experiment.read_text().splitlines()
    assert head[:3] == ["# @package _global_",
                        f"# Imported from the Fleet strategy file {tmp_path / 'fleet_resnet.prototxt'} by "
                        "`lightfleet import-fleet`.",
                        f"# Run: lightfleet --config-dir {tmp_path / 'cfg'} experiment=fleet_resnet"]
    assert "#   build_strategy.fuse_broadcast_ops = true: static-graph (program) setting; PyTorch runs eagerly" in head
    assert yaml.safe_load(experiment.read_text())["collective"] == RESNET50_COLLECTIVE


@pytest.mark.slow
def test_import_train_and_export_through_the_command(lightfleet, tmp_path):
    (tmp_path / "resnet50.prototxt").write_text(RESNET50)
    done = lightfleet("import-fleet", "resnet50.prototxt", "-o", "cfg/experiment/fleet_resnet.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("run: lightfleet --config-dir cfg experiment=fleet_resnet")
    done = lightfleet("--config-dir", "cfg", "experiment=fleet_resnet", "trainer.max_steps=3",
                      "trainer.enable_progress_bar=false", "paths.output_dir=run")
    assert done.returncode == 0, done.stderr
    done = lightfleet("export-fleet", "run")
    assert done.returncode == 0, done.stderr
    exported = (tmp_path / "run" / "fleet_strategy.prototxt").read_text().splitlines()
    assert "amp: true" in exported and '  custom_black_list: "LayerNorm"' in exported


@pytest.mark.parametrize("text, problem", [
    ("lars: true\nlamb: true\nlars_configs {\n  lars_coeff: 0.002\n}\n",
     "refused: lamb+lars is not an allowed combination (lamb+lars: both replace the optimizer); "
     "closest allowed: amp+lamb, amp+lars, fp16_allreduce+lamb"),
    ("amp: true\namp_configs {\n  decr_ratio: 1.5\n}\n", "error: strategy.amp.decr_ratio=1.5: must be in (0, 1)"),
], ids=["forbidden_combination", "out_of_range_knob"])
def test_a_strategy_that_would_not_run_is_written_marked(tmp_path, capsys, text, problem):
    experiment = import_text(tmp_path, text)
    out, err = capsys.readouterr()
    assert f"lightfleet: import-fleet: written, but it will not run as it is: {problem}" in err.splitlines()
    assert not [line for line in err.splitlines() if line.startswith("lightfleet: refused")]
    assert "(marked: it needs a choice)" in out
    lines = experiment.read_text().splitlines()
    assert lines[:2] == ["# @package _global_", f"# NEEDS A CHOICE before it runs: {problem}"]


def test_the_marked_forbidden_combination_composes_and_is_refused_when_run(tmp_path, capsys):
    experiment = import_text(tmp_path, "lars: true\nlamb: true\nlars_configs {\n  lars_coeff: 0.002\n}\n")
    cfg = compose_config([f"experiment={experiment.stem}"], config_dir=str(tmp_path / "cfg"))
    spec = validate(cfg)
    assert list(spec.strategies) == ["lamb", "lars"] and spec.strategies["lars"].lars_coeff == 0.002
    with pytest.raises(Refusal, match="lamb\\+lars is not an allowed combination"):
        preflight.table(preflight.Flight(cfg, spec))


def test_unknown_fields_are_warned_and_the_rest_imported(tmp_path, capsys):
    text = ("amp: true\nfuture_switch: true\namp_configs {\n  use_promote: true\n  init_loss_scaling: 1024\n}\n"
            "future_configs {\n  depth {\n    inner: 1\n  }\n}\n")
    experiment = import_text(tmp_path, text)
    assert capsys.readouterr().err.splitlines() == [
        "lightfleet: import-fleet: warning: unknown Fleet fields skipped: future_switch, amp_configs.use_promote, "
        "future_configs",
        "lightfleet: import-fleet: Fleet's default: strategy.amp.decr_ratio = 0.8 (lightfleet's default: 0.5)"]
    assert imported_strategies(experiment) == {"amp": AmpConfig(init_loss_scaling=1024.0, decr_ratio=0.8)}


@pytest.mark.parametrize("text, parameter_server, strategy_list, listed, problem", [
    ("a_sync: false\na_sync_configs {\n  k_steps: 0\n}\n", {"mode": "sync"}, [], [], None),
    ("a_sync: true\na_sync_configs {\n  k_steps: 8\n  send_queue_size: 4\n}\n", {"mode": "geo", "k_steps": 8},
     ["localsgd"], ["a_sync_configs.send_queue_size = 4"], None),
    ("a_sync: true\n", None, [], ["a_sync = true"], None),
    ("a_sync: true\na_sync_configs {\n  k_steps: 0\n}\n", {"mode": "async"}, None, [],
     "error: parameter_server.mode='async': asynchronous updates need parameter-server processes"),
    ("dgc: true\na_sync: true\na_sync_configs {\n  k_steps: 2\n}\n", {"mode": "geo", "k_steps": 2}, None, [],
     "refused: dgc+localsgd is not an allowed combination"),
], ids=["sync", "geo", "a_sync_without_k_steps", "async", "geo_with_dgc"])
def test_parameter_server_modes_import_as_fleet_reads_them(tmp_path, capsys, text, parameter_server, strategy_list,
                                                          listed, problem):
    """Fleet: k_steps < 0 (its default) trains collectively; 0 is sync or (a_sync) async; > 0 is GEO."""
    experiment = import_text(tmp_path, text)
    err = capsys.readouterr().err
    assert [line.split(": ")[0] for line in not_mapped(err)] == listed
    assert yaml.safe_load(experiment.read_text()).get("parameter_server") == parameter_server
    if problem is None:
        assert list(imported_strategies(experiment)) == strategy_list
    else:
        assert f"# NEEDS A CHOICE before it runs: {problem}" in experiment.read_text()


def test_knobs_of_a_strategy_that_is_off_are_listed_not_applied(tmp_path, capsys):
    experiment = import_text(tmp_path, "amp: false\nrecompute: true\namp_configs {\n  init_loss_scaling: 1024\n}\n")
    assert not_mapped(capsys.readouterr().err) == ["amp_configs.init_loss_scaling = 1024.0: amp is off in this file "
                                                   "(amp: false)"]
    assert list(imported_strategies(experiment)) == ["recompute"]


def test_fleet_names_that_differ_are_translated(tmp_path, capsys):
    text = ('amp: true\nsharding: true\npipeline: true\namp_configs {\n  use_pure_bf16: true\n}\n'
            'sharding_configs {\n  sharding_degree: 2\n  pp_degree: 2\n}\n'
            'pipeline_configs {\n  schedule_mode: "FThenB"\n  accumulate_steps: 2\n}\n')
    found = imported_strategies(import_text(tmp_path, text))
    assert found["amp"].dtype == "bfloat16"
    assert (found["sharding"].degree, found["sharding"].pp_degree) == (2, 2)
    assert found["pipeline"].schedule_mode == "GPipe"


def test_default_output_is_the_file_stem_in_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "strategy.prototxt").write_text("recompute: true\n")
    assert main(["import-fleet", "strategy.prototxt"]) == 0
    assert (tmp_path / "strategy.yaml").is_file()
    assert capsys.readouterr().out == ("wrote strategy.yaml; run: move it to DIR/experiment/strategy.yaml, then: "
                                       "lightfleet --config-dir DIR experiment=strategy\n")
    assert run_command(EXPERIMENTS_DIR / "mine.yaml") == "lightfleet experiment=mine"


def error_of(capsys, *args: str) -> str:
    """The one stderr line of a command that must fail with exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_errors_are_one_line_and_exit_2(tmp_path, capsys):
    missing, bad, taken = tmp_path / "missing.prototxt", tmp_path / "bad.prototxt", tmp_path / "taken.yaml"
    bad.write_text("amp: maybe\n")
    taken.write_text("")
    (tmp_path / "ok.prototxt").write_text("amp: true\n")
    assert error_of(capsys, "import-fleet", str(missing)).startswith(f"lightfleet: error: {missing}: no such file")
    assert error_of(capsys, "import-fleet", str(bad)).startswith(
        f"lightfleet: error: {bad}: not a Fleet strategy in protobuf text format: 1:")
    assert error_of(capsys, "import-fleet", str(tmp_path / "ok.prototxt"), "-o", str(taken)) == (
        f"lightfleet: error: {taken}: exists; lightfleet never overwrites a file (choose another -o)")
    assert error_of(capsys, "import-fleet") == (
        "lightfleet: error: lightfleet import-fleet: the following arguments are required: FILE")
    assert error_of(capsys, "export-fleet", str(tmp_path)) == (
        f"lightfleet: error: {tmp_path}: no config.yaml: not a run directory")
    (tmp_path / "config.yaml").write_text("strategy: {amp: null}\n")
    assert error_of(capsys, "export-fleet", str(tmp_path), "-o", str(taken)) == (
        f"lightfleet: error: {taken}: exists; lightfleet never overwrites a file (choose another -o)")


def leaf_fields() -> Iterator[Tuple[str, str, str]]:
    """(path, config message field or "", field name) of every field of our DistributedStrategy."""
    for field in strategy_class().DESCRIPTOR.fields:
        if field.message_type is None:
            yield field.name, "", field.name
        else:
            yield from ((f"{field.name}.{sub.name}", field.name, sub.name) for sub in field.message_type.fields)


def test_every_fleet_field_has_a_lightfleet_key_or_a_reason():
    for path, config, name in leaf_fields():
        strategy = configured_strategy(config) if config else None
        mapped = name in strategies.names() if not config else bool(strategy and knob_of(strategy, name))
        mapped = mapped or path in collective_fields() or path in PARAMETER_SERVER_FIELDS
        reason = NOT_MAPPED.get(path, NOT_MAPPED.get(config))
        assert mapped != bool(reason), f"{path}: mapped={mapped}, reason={reason!r}"
    paths = {path for path, _, _ in leaf_fields()} | {field.name for field in strategy_class().DESCRIPTOR.fields}
    assert set(NOT_MAPPED) <= paths, sorted(set(NOT_MAPPED) - paths)


def test_every_strategy_has_a_fleet_switch_and_renamed_knobs_exist():
    fields = strategy_class().DESCRIPTOR.fields_by_name
    assert set(strategies.names()) <= set(fields)
    for (strategy, knob), (fleet_name, _, _) in RENAMED.items():
        assert knob in strategies.schemas()[strategy].__dataclass_fields__
        assert fleet_name in fields[f"{strategy}_configs"].message_type.fields_by_name


def test_docs_name_every_fleet_field():
    doc = (PROJECT_ROOT / "docs" / "fleet.md").read_text()
    missing = [path for path, config, _ in leaf_fields() if f"`{path}" not in doc and f"`{config}.*`" not in doc]
    assert not missing


def test_the_commands_import_nothing_heavy(tmp_path):
    (tmp_path / "in.prototxt").write_text(RESNET50)
    code = ("import sys\nfrom runner.command.cli import main\n"
            "main(['import-fleet', 'in.prototxt', '-o', 'out/experiment/x.yaml'])\n"
            "print(','.join(m for m in ('torch', 'pytorch_lightning', 'hydra', 'omegaconf') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == ""


def test_floats_come_back_as_written():
    assert [shortest_float32(x) for x in (0.999, 0.0005, 32768.0, 0.1, 1e-8)] == [0.999, 0.0005, 32768.0, 0.1, 1e-8]


# ---------------------------------------------------------------------------------- against Paddle 3.3.1

def our_messages() -> Dict[str, Dict[str, Tuple]]:
    """Every message our DistributedStrategy holds: {message: {field: (number, type, repeated, default)}}."""
    messages: Dict[str, Dict[str, Tuple]] = {}
    pending = [strategy_class().DESCRIPTOR]
    while pending:
        message = pending.pop()
        if message.name not in messages:
            messages[message.name] = {field.name: field_spec(field) for field in message.fields}
            pending += [field.message_type for field in message.fields if field.message_type is not None]
    return messages


def field_spec(field) -> Tuple:
    kind = (field.message_type or field.enum_type or None)
    default = field.default_value if field.has_default_value else None
    if field.type == field.TYPE_FLOAT and default is not None:
        default = shortest_float32(default)
    return field.number, kind.name if kind else field.type, field.is_repeated, default


def test_our_message_is_paddles_with_the_older_fields_kept(tmp_path):
    run_paddle("strategy_file", "describe", str(tmp_path / "paddle.json"))
    with open(tmp_path / "paddle.json") as file:
        paddles = {name: {field[0]: field for field in fields} for name, fields in json.load(file).items()}
    ours = our_messages()
    scalars = {FieldDescriptor.TYPE_BOOL: "bool", FieldDescriptor.TYPE_INT32: "int32",
               FieldDescriptor.TYPE_UINT32: "uint32", FieldDescriptor.TYPE_UINT64: "uint64",
               FieldDescriptor.TYPE_FLOAT: "float", FieldDescriptor.TYPE_DOUBLE: "double",
               FieldDescriptor.TYPE_STRING: "string"}
    kept = {(message, spec[0]) for message, specs in OLDER_FIELDS.items() for spec in specs}
    for message, fields in ours.items():
        for name, (number, kind, repeated, default) in fields.items():
            if (message, name) in kept:
                assert name not in paddles.get(message, {}), f"{message}.{name} is in Paddle 3.3.1"
                continue
            _, p_number, p_kind, p_repeated, p_default = paddles[message][name]
            if isinstance(p_default, float) and kind == FieldDescriptor.TYPE_FLOAT:
                p_default = shortest_float32(p_default)
            assert (number, scalars.get(kind, kind), repeated, default) == (p_number, p_kind, p_repeated, p_default), \
                f"{message}.{name}"
    assert {(message, name) for message, fields in paddles.items() for name in fields} == {
        (message, name) for message, fields in ours.items() for name in fields if (message, name) not in kept}


@pytest.fixture(scope="module")
def paddles_files(tmp_path_factory) -> Path:
    """The files Paddle 3.3.1's save_to_prototxt writes (tests/paddle/strategy_file.py save)."""
    folder = tmp_path_factory.mktemp("paddle_files")
    run_paddle("strategy_file", "save", str(folder))
    return folder


@pytest.mark.slow
def test_every_export_loads_in_paddle_with_the_same_values(tmp_path, capsys):
    exports = []
    cases = {**ROUND_TRIPS, "collective": ["collective.fuse_grad_size_in_MB=16", "collective.nccl_comm_num=2",
                                           "collective.build_strategy.fuse_gemm_epilogue=true",
                                           "collective.execution_strategy.num_threads=2"]}
    for name, overrides in cases.items():
        (tmp_path / name).mkdir()
        run_dir = saved_run(tmp_path / name, overrides)
        exports.append(tmp_path / f"{name}.prototxt")
        assert main(["export-fleet", str(run_dir), "-o", str(exports[-1])]) == 0
    older = tmp_path / "older_release.prototxt"  # what Paddle 3.3.1 refuses, hence never exported
    older.write_text(RESNET50)
    run_paddle("strategy_file", "load", str(tmp_path / "loaded.json"), *map(str, exports + [older]))
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    for path in exports:
        assert "bytes" in loaded[str(path)], (path.name, loaded[str(path)])
        paddles = strategy_class().FromString(bytes.fromhex(loaded[str(path)]["bytes"]))
        assert paddles == read_fleet(path)[0], path.name
    assert "execution_strategy" in loaded[str(older)]["error"]
    assert read_fleet(older)[1] == []  # still imported, every field known


def test_every_field_paddle_writes_is_imported_or_listed_with_its_reason(paddles_files, tmp_path, capsys):
    source = paddles_files / "every_field.prototxt"
    import_text(tmp_path, source.read_text(), "every_field")
    err = capsys.readouterr().err
    assert "unknown Fleet fields skipped" not in err
    message, _ = read_fleet(source)
    imported = translate(message)
    listed = [line.split(" = ")[0] for line in not_mapped(err)]
    assert all(not line.endswith(": None") for line in not_mapped(err))
    # Every switch is on, and a_sync_configs.k_steps >= 0: a_sync and k_steps are the parameter-server mode.
    mapped = list(imported.strategies) + list(imported.collective) + list(PARAMETER_SERVER_FIELDS)
    mapped += [f"{strategy}_configs.{fleet_field(message, strategy, knob)[0].name}"
               for strategy, knobs in imported.strategies.items() for knob in knobs]
    assert sorted(listed + mapped) == sorted(paths_set(message))


def paths_set(message) -> List[str]:
    """The fields `message` sets, as paths: those of a sub-message one level down, a list of
    messages (downpour_table_param) as itself."""
    paths = []
    for field, value in message.ListFields():
        if field.message_type is None or field.is_repeated:
            paths.append(field.name)
        else:
            paths += [f"{field.name}.{sub.name}" for sub, _ in value.ListFields()]
    return paths


GUIDES = {  # the strategies tests/paddle/strategy_file.py sets as Paddle's guides do, as lightfleet imports them
    "resnet50": ({"amp": {"init_loss_scaling": 32768.0, "use_dynamic_loss_scaling": True,
                          "custom_black_list": ["LayerNorm"], "decr_ratio": 0.8}},  # Fleet's default, left out
                 {"nccl_comm_num": 2, "fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": 32}, []),
    "bert_lamb_recompute": ({"lamb": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ["layer_norm", "bias"]},
                             "recompute": {"checkpoints": ["blocks.0", "blocks.1"]}}, {}, []),
    "hybrid": ({}, {}, ["hybrid_configs.dp_degree", "hybrid_configs.mp_degree", "hybrid_configs.pp_degree"]),
    "sharding_gradient_merge": ({"gradient_merge": {"k_steps": 4, "avg": True},
                                 "sharding": {"degree": 2, "stage": 2, "segment_broadcast_MB": 32.0}}, {}, []),
}


@pytest.mark.parametrize("guide", GUIDES)
def test_the_strategies_of_paddles_guides_import_as_set(paddles_files, tmp_path, capsys, guide):
    strategies_set, collective, listed = GUIDES[guide]
    import_text(tmp_path, (paddles_files / f"{guide}.prototxt").read_text(), guide)
    assert [line.split(" = ")[0] for line in not_mapped(capsys.readouterr().err)] == listed
    imported = translate(read_fleet(paddles_files / f"{guide}.prototxt")[0])
    assert (imported.strategies, imported.collective) == (strategies_set, collective)


def test_docs_say_for_every_mapped_field_whether_paddle_checks_it():
    """docs/fleet.md's mapping table: a third column for every row; a "yes" names a test module
    that runs Paddle, a "no" gives a reason."""
    doc = (PROJECT_ROOT / "docs" / "fleet.md").read_text()
    table = doc[doc.index("| Fleet field | lightfleet key | checked against Paddle 3.3.1 |"):].split("\n\n")[0]
    rows = [row.strip("|").split(" | ") for row in table.splitlines()[2:]]
    assert len(rows) == 12 + 38
    for field, _, checked in rows:
        verdict, _, why = checked.partition(": ")
        assert verdict in ("yes", "no", "the overlap refusal only") and why, field
        for module in re.findall(r"tests/\S+\.py", why) if verdict != "no" else []:
            text = (PROJECT_ROOT / module).read_text()
            assert "run_paddle" in text or "steps_equal_paddles" in text, (field, module)


def test_a_knob_the_file_leaves_out_takes_fleets_default(tmp_path):
    """A Fleet user's file means Fleet's defaults: every strategy switched on and nothing else set
    imports with each knob that has a Fleet field at Fleet's default, the rest at lightfleet's."""
    source = tmp_path / "switches.prototxt"
    source.write_text("".join(f"{name}: true\n" for name in strategies.names() if name != "auto"))
    message, _ = read_fleet(source)
    imported = translate(message)
    differing = 0
    for name, knobs in imported.strategies.items():
        for knob, default in dataclasses.asdict(strategies.schemas()[name]()).items():
            target = fleet_field(message, name, knob)
            fleets = knob_of(name, target[0].name)[1](fleet_default(target[0])) if target else default
            assert knobs.get(knob, default) == fleets, (name, knob)
            differing += fleets != default
    assert differing == len(imported.fleet_defaults) >= 4  # amp's decr_ratio, pipeline's batches, sharding's degree
