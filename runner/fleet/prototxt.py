"""`lightfleet import-fleet FILE.prototxt [-o FILE.yaml]` and `lightfleet export-fleet RUN_DIR [-o FILE]`:
Fleet strategy files (protobuf text format, as Paddle's `DistributedStrategy.save_to_prototxt`
writes them) in and out of lightfleet.

The message definition is ours: MESSAGES names Fleet's fields with Fleet's numbers and types, and
is built into message classes in Python (no protoc step). A Fleet switch that is on selects the
lightfleet strategy of that name; a field of `<strategy>_configs` sets the knob of that name
(RENAMED lists the exceptions); a collective-training field sets the `collective.*` knob of its
path (collective_fields); `a_sync` with `a_sync_configs.k_steps` set parameter_server.* (Fleet's
parameter-server modes). Every other field the file sets is listed with why it has no lightfleet
meaning (NOT_MAPPED), and written into the experiment as a comment: nothing is dropped silently.
Export writes the knobs back, so importing an export gives the same strategy.
docs/fleet.md has the whole table.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf.descriptor import FieldDescriptor

from runner import strategies
from runner.config.schema import CollectiveConfig, ParameterServerConfig, collective_knobs
from runner.config.compat import EXPERIMENTS_DIR, check, load_table
from runner.core.errors import ConfigError, Refusal, exit_on_user_error

PACKAGE = "paddle.fleet"  # Fleet's package: type names read as in Paddle
ENUMS = {"Mode": (("COLLECTIVE", 1), ("PS", 2), ("PIPELINE", 3), ("HETER", 4))}
# Fleet's DistributedStrategy and the messages it holds, after Paddle's
# paddle/fluid/framework/distributed_strategy.proto (proto2, every field optional): (field, number,
# type[, default]). A type is bool, int32, float, string, an enum of ENUMS or a message of this
# table; "repeated T" is a list. AMPConfig.use_pure_bf16 comes from later Paddle releases.
MESSAGES: Dict[str, List[Tuple[Any, ...]]] = {
    "DistributedStrategy": [
        ("mode", 1, "Mode", "COLLECTIVE"), ("amp", 2, "bool", False), ("recompute", 3, "bool", False),
        ("localsgd", 4, "bool", False), ("dgc", 5, "bool", False), ("gradient_merge", 6, "bool", False),
        ("lars", 7, "bool", False), ("lamb", 8, "bool", False), ("pipeline", 9, "bool", False),
        ("elastic", 10, "bool", False), ("auto", 11, "bool", False), ("a_sync", 12, "bool", True),
        ("sync_nccl_allreduce", 13, "bool", True), ("nccl_comm_num", 14, "int32", 1),
        ("use_hierarchical_allreduce", 15, "bool", False), ("hierarchical_allreduce_inter_nranks", 16, "int32", 1),
        ("sync_batch_norm", 17, "bool", False), ("fuse_all_reduce_ops", 18, "bool", True),
        ("fuse_grad_size_in_MB", 19, "int32", 32), ("fuse_grad_size_in_TFLOPS", 20, "float", 50.0),
        ("cudnn_exhaustive_search", 21, "bool", False), ("conv_workspace_size_limit", 22, "int32", 512),
        ("cudnn_batchnorm_spatial_persistent", 23, "bool", False), ("adaptive_localsgd", 24, "bool", False),
        ("fp16_allreduce", 25, "bool", False), ("sharding", 26, "bool", False),
        ("last_comm_group_size_MB", 27, "float", 1.0), ("find_unused_parameters", 28, "bool", False),
        ("tensor_parallel", 29, "bool", False), ("without_graph_optimization", 30, "bool", False),
        ("fuse_grad_size_in_num", 31, "int32", 8), ("calc_comm_same_stream", 32, "bool", False),
        ("asp", 33, "bool", False), ("fuse_grad_merge", 34, "bool", False), ("semi_auto", 35, "bool", False),
        ("adam_d2sum", 36, "bool", True), ("auto_search", 37, "bool", False), ("heter_ccl_mode", 38, "bool", False),
        ("recompute_configs", 101, "RecomputeConfig"), ("amp_configs", 102, "AMPConfig"),
        ("localsgd_configs", 103, "LocalSGDConfig"), ("gradient_merge_configs", 104, "GradientMergeConfig"),
        ("dgc_configs", 105, "DGCConfig"), ("pipeline_configs", 106, "PipelineConfig"),
        ("a_sync_configs", 107, "AsyncConfig"), ("lars_configs", 108, "LarsConfig"),
        ("lamb_configs", 109, "LambConfig"), ("adaptive_localsgd_configs", 110, "AdaptiveLocalSGDConfig"),
        ("sharding_configs", 111, "ShardingConfig"), ("hybrid_configs", 112, "HybridConfig"),
        ("tensor_parallel_configs", 113, "TensorParallelConfig"), ("build_strategy", 201, "BuildStrategy"),
        ("execution_strategy", 202, "ExecutionStrategy"), ("gradient_scale_configs", 203, "GradientScaleConfig"),
    ],
    "RecomputeConfig": [("checkpoints", 1, "repeated string"), ("enable_offload", 2, "bool", False),
                        ("checkpoint_shape", 3, "repeated int32")],
    "AMPConfig": [
        ("init_loss_scaling", 1, "float", 32768.0), ("incr_every_n_steps", 2, "int32", 1000),
        ("decr_every_n_nan_or_inf", 3, "int32", 2), ("incr_ratio", 4, "float", 2.0), ("decr_ratio", 5, "float", 0.8),
        ("use_dynamic_loss_scaling", 6, "bool", True), ("custom_white_list", 7, "repeated string"),
        ("custom_black_list", 8, "repeated string"), ("custom_black_varnames", 9, "repeated string"),
        ("use_pure_fp16", 10, "bool", False), ("use_fp16_guard", 11, "bool", True),
        ("use_optimizer_fp16", 12, "bool", False), ("use_pure_bf16", 13, "bool", False),
    ],
    "ShardingConfig": [
        ("sharding_segment_strategy", 1, "string", "segment_broadcast_MB"), ("segment_broadcast_MB", 2, "float", 32.0),
        ("segment_anchors", 3, "repeated string"), ("sharding_degree", 4, "int32", 8), ("mp_degree", 5, "int32", 1),
        ("dp_degree", 6, "int32", 1), ("hybrid_dp", 7, "bool", False), ("gradient_merge_acc_step", 8, "int32", 1),
        ("optimize_offload", 9, "bool", False), ("pp_allreduce_in_optimize", 10, "bool", False),
        ("pp_degree", 11, "int32", 1), ("optimize_cast", 12, "bool", False),
        ("_dp_as_optimizer_sharding", 13, "bool", False), ("stage", 14, "int32", 1),
    ],
    "HybridConfig": [("dp_degree", 1, "int32", -1), ("mp_degree", 2, "int32", 1), ("pp_degree", 3, "int32", 1),
                     ("sharding_degree", 4, "int32", 1)],
    "LocalSGDConfig": [("k_steps", 1, "int32", 1), ("begin_step", 2, "int32", 1)],
    "AdaptiveLocalSGDConfig": [("init_k_steps", 1, "int32", 1), ("begin_step", 2, "int32", 1)],
    "GradientMergeConfig": [("k_steps", 1, "int32", 1), ("avg", 2, "bool", True)],
    "DGCConfig": [("rampup_begin_step", 1, "int32", 0), ("rampup_step", 2, "int32", 1),
                  ("sparsity", 3, "repeated float")],
    "LarsConfig": [("lars_coeff", 1, "float", 0.001), ("lars_weight_decay", 2, "float", 0.0005),
                   ("epsilon", 3, "float", 0.0), ("exclude_from_weight_decay", 4, "repeated string")],
    "LambConfig": [("lamb_weight_decay", 1, "float", 0.01), ("exclude_from_weight_decay", 2, "repeated string")],
    "BuildStrategy": [
        ("enable_sequential_execution", 1, "bool", False), ("fuse_elewise_add_act_ops", 2, "bool", False),
        ("fuse_bn_act_ops", 3, "bool", False), ("fuse_relu_depthwise_conv", 4, "bool", False),
        ("fuse_broadcast_ops", 5, "bool", False), ("fuse_all_optimizer_ops", 6, "bool", False),
        ("enable_inplace", 7, "bool", False), ("enable_backward_optimizer_op_deps", 8, "bool", True),
        ("cache_runtime_context", 9, "bool", False), ("fuse_bn_add_act_ops", 10, "bool", True),
        ("enable_auto_fusion", 11, "bool", False), ("enable_addto", 12, "bool", False),
        ("fix_op_run_order", 13, "bool", False), ("allow_cuda_graph_capture", 14, "bool", False),
        ("reduce_strategy", 15, "int32", 0),
    ],
    "ExecutionStrategy": [("num_threads", 1, "int32", 1), ("num_iteration_per_drop_scope", 2, "int32", 10),
                          ("num_iteration_per_run", 3, "int32", 1), ("use_thread_barrier", 4, "bool", False)],
    "GradientScaleConfig": [("scale_strategy", 1, "string", "avg"), ("scale_gradient", 2, "bool", False)],
    "AsyncConfig": [
        ("k_steps", 1, "int32", -1), ("max_merge_var_num", 2, "int32", 1), ("send_queue_size", 3, "int32", 16),
        ("independent_recv_thread", 4, "bool", False), ("min_send_grad_num_before_recv", 5, "int32", 1),
        ("thread_pool_size", 6, "int32", 1), ("send_wait_times", 7, "int32", 1),
        ("runtime_split_send_recv", 8, "bool", False), ("launch_barrier", 9, "bool", True),
        ("heter_worker_device_guard", 10, "string", "cpu"), ("lr_decay_steps", 11, "int32", 10),
        ("use_ps_gpu", 12, "int32", 0),
    ],
    "PipelineConfig": [("micro_batch_size", 1, "int32", 1), ("accumulate_steps", 2, "int32", 1),
                       ("schedule_mode", 3, "string", "1F1B"), ("p2p_cache_shape", 4, "bool", True)],
    "TensorParallelConfig": [("tensor_parallel_degree", 1, "int32", 1), ("tensor_init_seed", 2, "int32", -1)],
}
FieldProto = descriptor_pb2.FieldDescriptorProto
SCALARS = {"bool": FieldProto.TYPE_BOOL, "int32": FieldProto.TYPE_INT32, "float": FieldProto.TYPE_FLOAT,
           "string": FieldProto.TYPE_STRING}


def same(value: Any) -> Any:
    return value


# Fleet's GPipe schedule is "F-then-B" ("FThenB" in later releases); other names are shared.
SCHEDULES_TO_FLEET = {"GPipe": "F-then-B"}
SCHEDULES_FROM_FLEET = {"F-then-B": "GPipe", "FThenB": "GPipe"}
# Knobs Fleet names or spells otherwise: (strategy, knob) -> (field of <strategy>_configs, knob value
# -> Fleet value, Fleet value -> knob value). Every other knob maps to the field of its own name.
# Fleet's pure bf16 casts the parameters; lightfleet's bfloat16 is autocast over float32 parameters.
RENAMED: Dict[Tuple[str, str], Tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    ("amp", "dtype"): ("use_pure_bf16", lambda dtype: dtype == "bfloat16",
                       lambda bf16: "bfloat16" if bf16 else "float16"),
    ("sharding", "degree"): ("sharding_degree", same, same),
    ("pipeline", "schedule_mode"): ("schedule_mode", lambda mode: SCHEDULES_TO_FLEET.get(mode, mode),
                                    lambda mode: SCHEDULES_FROM_FLEET.get(mode, mode)),
}

PARAMETER_SERVER = "parameter-server training; lightfleet trains collectively"
SERVER_RUNTIME = "parameter-server runtime setting (servers, queues, threads); lightfleet runs no servers"
# Fleet's parameter-server mode is a_sync with a_sync_configs.k_steps: below 0 (the default, -1)
# none (collective training); 0 sync (a_sync false) or async (a_sync true); above 0 GEO (a_sync true).
PARAMETER_SERVER_FIELDS = ("a_sync", "a_sync_configs.k_steps")
STATIC_GRAPH = "static-graph (program) setting; PyTorch runs eagerly"
ALLREDUCE = "collective knob without a PyTorch counterpart: DDP buckets and schedules the gradient allreduces itself"
TENSOR_PARALLEL = "tensor parallelism is strategy.sharding.mp_degree in lightfleet (stages 2 and 3); set it by hand"
SEGMENTS = "lightfleet groups sharded units by segment_broadcast_MB only"
# Why a Fleet field has no lightfleet meaning. A sub-message's entry covers all its fields.
NOT_MAPPED = {
    "mode": "lightfleet always trains collectively (Fleet's COLLECTIVE mode)",
    "elastic": "elastic training is not supported",
    **{f"a_sync_configs.{spec[0]}": SERVER_RUNTIME for spec in MESSAGES["AsyncConfig"] if spec[0] != "k_steps"},
    "adam_d2sum": PARAMETER_SERVER,
    "heter_ccl_mode": PARAMETER_SERVER,
    "fuse_grad_size_in_num": ALLREDUCE, "last_comm_group_size_MB": ALLREDUCE, "calc_comm_same_stream": ALLREDUCE,
    "without_graph_optimization": STATIC_GRAPH, "fuse_grad_merge": STATIC_GRAPH,
    **{f"build_strategy.{name}": STATIC_GRAPH for name in (
        "enable_sequential_execution", "fuse_broadcast_ops", "enable_backward_optimizer_op_deps",
        "cache_runtime_context", "fuse_bn_add_act_ops", "enable_addto", "fix_op_run_order",
        "allow_cuda_graph_capture", "reduce_strategy")},
    "execution_strategy.use_thread_barrier": "static-graph executor setting; PyTorch runs eagerly",
    "tensor_parallel": TENSOR_PARALLEL, "tensor_parallel_configs": TENSOR_PARALLEL,
    "hybrid_configs": "dygraph hybrid-parallel degrees: set strategy.sharding's degree, dp_degree, mp_degree "
                      "and pp_degree by hand",
    "asp": "automatic sparsity (ASP) is not a lightfleet strategy",
    "semi_auto": "semi-automatic parallelism is not a lightfleet strategy",
    "auto_search": "Fleet's auto search; lightfleet's is strategy=[auto] with strategy.auto.mode=search",
    "gradient_scale_configs": "lightfleet averages gradients over the data-parallel replicas (DDP)",
    "amp_configs.custom_black_varnames": "names static-graph variables; lightfleet's custom_black_list names modules",
    "amp_configs.use_pure_fp16": "lightfleet's amp is autocast (Fleet's O1): parameters stay float32 "
                                 "(float16 is strategy.amp.dtype's default)",
    "amp_configs.use_fp16_guard": STATIC_GRAPH,
    "amp_configs.use_optimizer_fp16": "lightfleet keeps optimizer states in float32",
    "sharding_configs.sharding_segment_strategy": SEGMENTS, "sharding_configs.segment_anchors": SEGMENTS,
    "sharding_configs.hybrid_dp": "implied by strategy.sharding.dp_degree > 1",
    "sharding_configs.pp_allreduce_in_optimize": STATIC_GRAPH, "sharding_configs.optimize_cast": STATIC_GRAPH,
    "sharding_configs._dp_as_optimizer_sharding": "stage 1 over every rank is strategy.sharding's default "
                                                  "(degree: null)",
    "pipeline_configs.p2p_cache_shape": "torch.distributed.pipelining exchanges the shapes itself",
}


@dataclasses.dataclass
class Imported:
    """What a Fleet file says in lightfleet's terms."""

    strategies: Dict[str, Dict[str, Any]]  # selected strategy -> the knobs the file sets
    not_mapped: List[str]  # "field = value: why", one per field the file sets without a lightfleet meaning
    collective: Dict[str, Any] = dataclasses.field(default_factory=dict)  # collective.* key -> value
    parameter_server: Dict[str, Any] = dataclasses.field(default_factory=dict)  # parameter_server.* knobs


@functools.lru_cache(maxsize=None)
def collective_fields() -> Tuple[str, ...]:
    """The Fleet fields (paths: build_strategy.fuse_bn_act_ops) that are the collective.* knob of
    the same path; lightfleet's other collective knobs have no Fleet field."""
    return tuple(key for key in collective_knobs(CollectiveConfig()) if has_fleet_field(key))


def has_fleet_field(path: str) -> bool:
    message = strategy_class().DESCRIPTOR
    *holders, name = path.split(".")
    for holder in holders:
        message = message.fields_by_name[holder].message_type
    return name in message.fields_by_name


# ---- the message definition --------------------------------------------------------------------------

def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """MESSAGES and ENUMS as a .proto file would declare them."""
    proto = descriptor_pb2.FileDescriptorProto(name="lightfleet/fleet_strategy.proto", package=PACKAGE,
                                               syntax="proto2")
    for name, values in ENUMS.items():
        enum = proto.enum_type.add(name=name)
        for value, number in values:
            enum.value.add(name=value, number=number)
    for name, fields in MESSAGES.items():
        message = proto.message_type.add(name=name)
        for spec in fields:
            add_field(message, *spec)
    return proto


def add_field(message: descriptor_pb2.DescriptorProto, name: str, number: int, kind: str, default: Any = None) -> None:
    repeated, _, kind = kind.rpartition(" ")
    label = FieldProto.LABEL_REPEATED if repeated else FieldProto.LABEL_OPTIONAL
    field = message.field.add(name=name, number=number, label=label)
    if kind in SCALARS:
        field.type = SCALARS[kind]
    else:
        field.type = FieldProto.TYPE_ENUM if kind in ENUMS else FieldProto.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{kind}"
    if default is not None:  # proto2 writes defaults as text: true, 0.0005, COLLECTIVE
        field.default_value = str(default).lower() if isinstance(default, bool) else str(default)


@functools.lru_cache(maxsize=None)
def strategy_class() -> type:
    """The message class of Fleet's DistributedStrategy, in a pool of its own (an installed Paddle
    may hold its own definition under the same names in the default pool)."""
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(file_descriptor().SerializeToString())
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.DistributedStrategy"))


def shortest_float32(value: float) -> float:
    """The shortest decimal that is the same 32-bit float: Fleet's floats are float32, so 0.999
    reads back as 0.99900001 and would not compare equal to the knob it came from."""
    single = struct.unpack("f", struct.pack("f", value))[0]
    for digits in range(1, 10):
        candidate = float(f"{single:.{digits}g}")
        if struct.unpack("f", struct.pack("f", candidate))[0] == single:
            return candidate
    return single


def plain(field: FieldDescriptor, value: Any) -> Any:
    """A field's value as YAML holds it: lists, shortest floats, enum names."""
    if field.is_repeated:
        return [plain_one(field, item) for item in value]
    return plain_one(field, value)


def plain_one(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return shortest_float32(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    return value


def fleet_default(field: FieldDescriptor) -> Any:
    return [] if field.is_repeated else plain(field, field.default_value)


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


def configured_strategy(config_field: str) -> Optional[str]:
    """The lightfleet strategy a `<strategy>_configs` field configures, if any."""
    name = config_field[:-len("_configs")] if config_field.endswith("_configs") else None
    return name if name in strategies.names() else None


def knob_of(strategy: str, fleet_field: str) -> Optional[Tuple[str, Callable[[Any], Any]]]:
    """(knob, Fleet value -> knob value) that a field of `<strategy>_configs` sets, if any."""
    for (name, knob), (field, _, from_fleet) in RENAMED.items():
        if name == strategy and field == fleet_field:
            return knob, from_fleet
    knobs = {field.name for field in dataclasses.fields(strategies.schemas()[strategy])}
    return (fleet_field, same) if fleet_field in knobs else None


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
        if field.message_type is None:
            imported.not_mapped.append(unmapped(field.name, field, value, NOT_MAPPED[field.name]))
            continue
        for sub_field, sub_value in value.ListFields():
            take_config_field(imported, field.name, sub_field, sub_value)
    return imported


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


def import_fleet(source: Path, output: Optional[str]) -> int:
    experiment = Path(output) if output else Path(f"{source.stem}.yaml")
    refuse_existing(experiment)
    message, unknown = read_fleet(source)
    if unknown:
        say(f"import-fleet: warning: unknown Fleet fields skipped: {', '.join(unknown)}")
    imported = translate(message)
    for line in imported.not_mapped:
        say(f"import-fleet: not mapped: {line}")
    found = problems(imported.strategies, imported.parameter_server)
    for problem in found:
        say(problem)
    experiment.parent.mkdir(parents=True, exist_ok=True)
    experiment.write_text(experiment_text(imported, source, experiment, found))
    marked = " (marked: it needs a choice)" if found else ""
    print(f"wrote {experiment}{marked}; run: {run_command(experiment)}")
    return 0


# ---- export ----------------------------------------------------------------------------------------------

def read_run_config(run_dir: Path) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Any], Dict[str, Any]]:
    """The selected strategies of the run in `run_dir` with their knobs, its collective.* knobs by
    key and its parameter_server.* knobs (defaults where the run predates them), from its config.yaml."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ConfigError(str(run_dir), None, "no config.yaml: not a run directory")
    saved = yaml.safe_load(config.read_text()) or {}
    node = saved.get("strategy")
    if not isinstance(node, dict):
        raise ConfigError(str(config), None, "has no strategy mapping")
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


def fleet_field(message: Any, strategy: str, knob: str) -> Optional[Tuple[FieldDescriptor, Callable[[Any], Any]]]:
    """The field of `<strategy>_configs` that holds `knob`, with knob value -> Fleet value."""
    config = message.DESCRIPTOR.fields_by_name.get(f"{strategy}_configs")
    if config is None:
        return None
    name, to_fleet, _ = RENAMED.get((strategy, knob), (knob, same, same))
    field = config.message_type.fields_by_name.get(name)
    return (field, to_fleet) if field is not None else None


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


def export_fleet(run_dir: Path, output: Optional[str]) -> int:
    target = Path(output) if output else run_dir / "fleet_strategy.prototxt"
    refuse_existing(target)
    selected, collective, parameter_server = read_run_config(run_dir)
    message = strategy_class()()
    export_parameter_server(message, selected, parameter_server)
    left_out = to_fleet(message, selected)
    left_out += export_collective(message, collective)
    for line in left_out:
        say(f"export-fleet: not exported: {line}")
    header = f"# Fleet DistributedStrategy written by `lightfleet export-fleet` from the run directory {run_dir}\n"
    target.write_text(header + text_format.MessageToString(message))
    print(f"wrote {target}")
    return 0


# ---- the commands ----------------------------------------------------------------------------------------

def say(line: str) -> None:
    print(f"lightfleet: {line}", file=sys.stderr)


def refuse_existing(path: Path) -> None:
    if path.exists():
        raise ConfigError(str(path), None, "exists; lightfleet never overwrites a file (choose another -o)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit status 2, as every lightfleet error
        raise ConfigError(self.prog, None, message)


# command -> (what carries it out, what it does, its argument, the argument's help, -o's help)
COMMANDS = {
    "import-fleet": (import_fleet, "Write a lightfleet experiment from a Fleet strategy file.", "FILE",
                     "a Fleet strategy file in protobuf text format (as save_to_prototxt writes it)",
                     "the experiment to write (default: ./<FILE's stem>.yaml)"),
    "export-fleet": (export_fleet, "Write a run's strategies as a Fleet strategy file.", "RUN_DIR",
                     "a run directory (one holding config.yaml)",
                     "the Fleet strategy file to write (default: RUN_DIR/fleet_strategy.prototxt)"),
}


def main(args: Sequence[str]) -> int:
    """`lightfleet import-fleet ...` or `lightfleet export-fleet ...`: args[0] names the command."""
    with exit_on_user_error():
        command, description, source, source_help, output_help = COMMANDS[args[0]]
        parser = _Parser(prog=f"lightfleet {args[0]}", description=description)
        parser.add_argument("source", metavar=source, help=source_help)
        parser.add_argument("-o", "--output", help=output_help)
        parsed = parser.parse_args(args[1:])
        return command(Path(parsed.source), parsed.output)
