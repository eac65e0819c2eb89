"""Fleet's DistributedStrategy message: its fields with Fleet's numbers and types (MESSAGES), built
into protobuf message classes in Python (no protoc step); a field's value as YAML holds it.
"""
from __future__ import annotations

import functools
import struct
from typing import Any, Dict, List, Tuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor

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
