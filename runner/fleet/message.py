"""Fleet's DistributedStrategy message: Paddle 3.3.1's fields with their numbers, types and defaults
(MESSAGES) and the fields of older releases that files may still set (OLDER_FIELDS), built into
protobuf message classes in Python (no protoc step); a field's value as YAML holds it.
"""
from __future__ import annotations

import functools
import struct
from typing import Any, Dict, List, Tuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor

PACKAGE = "paddle.fleet"  # Fleet's package: type names read as in Paddle
ENUMS = {"Mode": (("COLLECTIVE", 1), ("PS", 2), ("PIPELINE", 3), ("HETER", 4)),
         "TableType": (("PS_SPARSE_TABLE", 0), ("PS_DENSE_TABLE", 1))}
# Fleet's DistributedStrategy and every message it holds, as Paddle 3.3.1 defines them in
# paddle/fluid/framework/distributed_strategy.proto (proto2, every field optional): (field, number,
# type[, default]). A type is a scalar of SCALARS, an enum of ENUMS or a message of this table;
# "repeated T" is a list. tests/runner/test_fleet.py holds it against Paddle's own.
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
        ("tensor_parallel", 29, "bool", False), ("without_graph_optimization", 30, "bool", True),
        ("fuse_grad_size_in_num", 31, "int32", 8), ("calc_comm_same_stream", 32, "bool", False),
        ("asp", 33, "bool", False), ("fuse_grad_merge", 34, "bool", False), ("semi_auto", 35, "bool", False),
        ("adam_d2sum", 36, "bool", False), ("auto_search", 37, "bool", False), ("heter_ccl_mode", 38, "bool", False),
        ("is_fl_ps_mode", 39, "bool", False), ("with_coordinator", 40, "bool", False), ("qat", 41, "bool", False),
        ("split_data", 42, "bool", True), ("recompute_configs", 101, "RecomputeConfig"),
        ("amp_configs", 102, "AMPConfig"), ("localsgd_configs", 103, "LocalSGDConfig"),
        ("gradient_merge_configs", 104, "GradientMergeConfig"), ("dgc_configs", 105, "DGCConfig"),
        ("pipeline_configs", 106, "PipelineConfig"), ("a_sync_configs", 107, "AsyncConfig"),
        ("lars_configs", 108, "LarsConfig"), ("lamb_configs", 109, "LambConfig"),
        ("adaptive_localsgd_configs", 110, "AdaptiveLocalSGDConfig"), ("sharding_configs", 111, "ShardingConfig"),
        ("hybrid_configs", 112, "HybridConfig"), ("tensor_parallel_configs", 113, "TensorParallelConfig"),
        ("trainer_desc_configs", 114, "TrainerDescConfig"), ("downpour_table_param", 115, "repeated TableParameter"),
        ("fs_client_param", 116, "FsClientParameter"), ("qat_configs", 117, "QatConfig"),
        ("build_strategy", 201, "BuildStrategy"), ("gradient_scale_configs", 203, "GradientScaleConfig"),
    ],
    "RefinedOpsPattern": [
        ("main_ops", 1, "repeated string"), ("num", 2, "int32", 0), ("pre_ops", 3, "repeated string"),
        ("suf_ops", 4, "repeated string"),
    ],
    "RecomputeConfig": [
        ("checkpoints", 1, "repeated string"), ("enable_offload", 2, "bool", False),
        ("checkpoint_shape", 3, "repeated int32"), ("enable_tuning", 4, "bool", False),
        ("refined_ops_patterns", 5, "repeated RefinedOpsPattern"),
    ],
    "ShardingConfig": [
        ("sharding_segment_strategy", 1, "string", "segment_broadcast_MB"),
        ("segment_broadcast_MB", 2, "float", 32.0), ("segment_anchors", 3, "repeated string"),
        ("sharding_degree", 4, "int32", 8), ("mp_degree", 5, "int32", 1), ("dp_degree", 6, "int32", 1),
        ("hybrid_dp", 7, "bool", False), ("gradient_merge_acc_step", 8, "int32", 1),
        ("optimize_offload", 9, "bool", False), ("pp_allreduce_in_optimize", 10, "bool", False),
        ("pp_degree", 11, "int32", 1), ("optimize_cast", 12, "bool", False),
        ("_dp_as_optimizer_sharding", 13, "bool", False), ("stage", 14, "int32", 1),
        ("enable_tuning", 15, "bool", False), ("use_calc_stream", 16, "bool", False),
    ],
    "MpConfig": [
        ("sync_param", 1, "bool", True), ("sync_grad", 2, "bool", False), ("sync_moment", 3, "bool", False),
        ("sync_mode", 4, "string", "broadcast"), ("mp_async_allreduce", 5, "bool", False),
        ("mp_skip_c_identity", 6, "bool", False), ("mp_fused_linear_param_grad_add", 7, "bool", False),
        ("need_broadcast_data", 8, "bool", True), ("recompute_allgather", 9, "bool", False),
        ("sp_async_reduce_scatter", 10, "bool", False), ("nccl_config", 11, "NCCLConfig"),
    ],
    "PpConfig": [
        ("dp_comm_overlap", 1, "bool", False), ("delay_scale_loss", 2, "bool", False),
        ("enable_timer", 3, "bool", False), ("sharding_comm_overlap", 4, "bool", False),
        ("profiling", 5, "bool", False), ("release_gradients", 6, "bool", False),
        ("overlap_p2p_comm", 7, "bool", False), ("clear_every_step_cache", 8, "bool", False),
        ("use_batch_p2p_comm", 9, "bool", True), ("best_unbalanced_scheduler", 10, "bool", False),
        ("enable_offload_queue", 11, "bool", False), ("enable_dynamic_shape", 12, "bool", False),
        ("use_dualpipev", 13, "bool", False), ("forward_backward_overlap_scheduler", 14, "bool", False),
        ("coll_nccl_config", 15, "NCCLConfig"), ("p2p_nccl_config", 16, "NCCLConfig"),
        ("shared_nccl_config", 17, "NCCLConfig"), ("sync_param", 18, "bool", False),
        ("sync_moment", 19, "bool", False), ("sync_mode", 20, "string", "broadcast"),
    ],
    "DygraphShardingConfig": [
        ("tensor_fusion", 1, "bool", False), ("accumulate_steps", 2, "int32", 1), ("comm_overlap", 3, "bool", False),
        ("split_param", 4, "bool", False), ("fuse_optimizer", 5, "bool", True), ("use_reduce_avg", 6, "bool", True),
        ("comm_buffer_size_MB", 7, "int32", 256), ("release_gradients", 8, "bool", False),
        ("free_grads_in_comm", 9, "bool", False), ("enable_fuse_optimizer_states", 10, "bool", False),
        ("nccl_config", 11, "NCCLConfig"), ("check_nccl_config", 12, "NCCLConfig"),
        ("offload_opt_buffer_size", 13, "int32", -1),
    ],
    "HybridConfig": [
        ("dp_degree", 1, "int32", -1), ("mp_degree", 2, "int32", 1), ("pp_degree", 3, "int32", 1),
        ("sharding_degree", 4, "int32", 1), ("sep_degree", 5, "int32", 1), ("mp_configs", 6, "MpConfig"),
        ("pp_configs", 7, "PpConfig"), ("sharding_configs", 8, "DygraphShardingConfig"),
        ("enable_optimizer_timer", 9, "bool", False), ("split_norm_comm", 10, "bool", False),
        ("ep_degree", 11, "int32", 1), ("moe_sharding_degree", 12, "int32", 1), ("dp_configs", 13, "DpConfig"),
        ("sep_configs", 14, "SepConfig"), ("dp_sep_configs", 15, "DpSepConfig"), ("pp_tp_configs", 16, "PpTpConfig"),
        ("ep_configs", 17, "EpConfig"), ("moe_sharding_configs", 18, "MoeShardingConfig"),
        ("default_comm_group_configs", 19, "DefaultCommGroupConfig"), ("cp_degree", 20, "int32", 1),
        ("cp_sharding_degree", 21, "int32", 1), ("cp_configs", 22, "CpConfig"),
        ("cp_sharding_configs", 23, "CpShardingConfig"), ("dp_cp_configs", 24, "DpCpConfig"),
        ("cp_mp_configs", 25, "CpMpConfig"),
    ],
    "AMPConfig": [
        ("init_loss_scaling", 1, "float", 32768.0), ("incr_every_n_steps", 2, "int32", 1000),
        ("decr_every_n_nan_or_inf", 3, "int32", 2), ("incr_ratio", 4, "float", 2.0), ("decr_ratio", 5, "float", 0.8),
        ("use_dynamic_loss_scaling", 6, "bool", True), ("custom_white_list", 7, "repeated string"),
        ("custom_black_list", 8, "repeated string"), ("custom_black_varnames", 9, "repeated string"),
        ("use_pure_fp16", 10, "bool", False), ("use_fp16_guard", 11, "bool", True),
        ("use_optimizer_fp16", 12, "bool", False), ("use_pure_bf16", 13, "bool", False),
    ],
    "LocalSGDConfig": [
        ("k_steps", 1, "int32", 1), ("begin_step", 2, "int32", 1),
    ],
    "AdaptiveLocalSGDConfig": [
        ("init_k_steps", 1, "int32", 1), ("begin_step", 2, "int32", 1),
    ],
    "GradientMergeConfig": [
        ("k_steps", 1, "int32", 1), ("avg", 2, "bool", True),
    ],
    "DGCConfig": [
        ("rampup_begin_step", 1, "int32", 0), ("rampup_step", 2, "int32", 1), ("sparsity", 3, "repeated float"),
    ],
    "LarsConfig": [
        ("lars_coeff", 1, "float", 0.001), ("lars_weight_decay", 2, "float", 0.0005), ("epsilon", 3, "float", 0.0),
        ("exclude_from_weight_decay", 4, "repeated string"),
    ],
    "LambConfig": [
        ("lamb_weight_decay", 1, "float", 0.01), ("exclude_from_weight_decay", 2, "repeated string"),
    ],
    "BuildStrategy": [
        ("fuse_elewise_add_act_ops", 2, "bool", False), ("fuse_bn_act_ops", 3, "bool", False),
        ("fuse_relu_depthwise_conv", 4, "bool", False), ("fuse_broadcast_ops", 5, "bool", False),
        ("fuse_all_optimizer_ops", 6, "bool", False), ("enable_inplace", 7, "bool", False),
        ("enable_backward_optimizer_op_deps", 8, "bool", True), ("cache_runtime_context", 9, "bool", False),
        ("fuse_bn_add_act_ops", 10, "bool", True), ("enable_auto_fusion", 11, "bool", False),
        ("enable_addto", 12, "bool", False), ("allow_cuda_graph_capture", 14, "bool", False),
        ("reduce_strategy", 15, "int32", 0), ("fuse_gemm_epilogue", 16, "bool", False),
        ("debug_graphviz_path", 17, "string"), ("fused_attention", 18, "bool", False),
        ("fused_feedforward", 19, "bool", False), ("fuse_dot_product_attention", 20, "bool", False),
        ("fuse_resunit", 21, "bool", False),
    ],
    "GradientScaleConfig": [
        ("scale_strategy", 1, "string", "avg"), ("scale_gradient", 2, "bool", False),
    ],
    "AsyncConfig": [
        ("k_steps", 1, "int32", -1), ("max_merge_var_num", 2, "int32", 1), ("send_queue_size", 3, "int32", 16),
        ("independent_recv_thread", 4, "bool", False), ("min_send_grad_num_before_recv", 5, "int32", 1),
        ("thread_pool_size", 6, "int32", 1), ("send_wait_times", 7, "int32", 1),
        ("runtime_split_send_recv", 8, "bool", False), ("launch_barrier", 9, "bool", True),
        ("heter_worker_device_guard", 10, "string", "cpu"), ("lr_decay_steps", 11, "int32", 10),
        ("use_ps_gpu", 12, "int32", 0), ("use_gpu_graph", 13, "int32", 0),
    ],
    "TrainerDescConfig": [
        ("dump_fields_path", 1, "string"), ("dump_fields", 2, "repeated string"),
        ("dump_param", 3, "repeated string"), ("stat_var_names", 4, "repeated string"), ("trainer", 5, "string"),
        ("device_worker", 6, "string"), ("local_sparse", 7, "repeated string"),
        ("remote_sparse", 8, "repeated string"),
    ],
    "PipelineConfig": [
        ("micro_batch_size", 1, "int32", 1), ("accumulate_steps", 2, "int32", 1),
        ("schedule_mode", 3, "string", "1F1B"), ("p2p_cache_shape", 4, "bool", True),
        ("enable_partial_send_recv", 5, "bool", True),
    ],
    "TensorParallelConfig": [
        ("tensor_parallel_degree", 1, "int32", 1), ("tensor_init_seed", 2, "int32", -1),
    ],
    "QatConfig": [
        ("channel_wise_abs_max", 1, "bool", True), ("weight_bits", 2, "int32", 8),
        ("activation_bits", 3, "int32", 8), ("not_quant_pattern", 4, "repeated string"), ("algo", 5, "string"),
    ],
    "TableParameter": [
        ("table_id", 1, "uint64"), ("table_name", 2, "string"), ("table_class", 3, "string"),
        ("shard_num", 4, "uint64", 1000), ("type", 5, "TableType"), ("accessor", 6, "TableAccessorParameter"),
        ("compress_in_save", 7, "bool", False), ("enable_sparse_table_cache", 10, "bool", True),
        ("sparse_table_cache_rate", 11, "double", 0.00055), ("sparse_table_cache_file_num", 12, "uint32", 16),
        ("enable_revert", 13, "bool", False), ("shard_merge_rate", 14, "float", 1.0),
        ("use_gpu_graph", 15, "bool", False),
    ],
    "TableAccessorParameter": [
        ("accessor_class", 1, "string"), ("fea_dim", 4, "uint32", 11), ("embedx_dim", 5, "uint32", 8),
        ("embedx_threshold", 6, "uint32", 10), ("ctr_accessor_param", 7, "CtrAccessorParameter"),
        ("table_accessor_save_param", 8, "repeated TableAccessorSaveParameter"),
        ("embed_sgd_param", 10, "SGDParameter"), ("embedx_sgd_param", 11, "SGDParameter"),
        ("graph_sgd_param", 12, "GraphSGDParameter"),
    ],
    "GraphSGDParameter": [
        ("nodeid_slot", 1, "uint32", 9008), ("feature_learning_rate", 2, "float", 0.05),
    ],
    "SGDParameter": [
        ("name", 1, "string"), ("naive", 2, "SparseNaiveSGDRuleParameter"),
        ("adagrad", 3, "SparseAdagradSGDRuleParameter"), ("adam", 4, "SparseAdamSGDParameter"),
    ],
    "SparseNaiveSGDRuleParameter": [
        ("learning_rate", 1, "double", 0.05), ("initial_range", 2, "double", 0.0001),
        ("weight_bounds", 3, "repeated float"),
    ],
    "SparseAdagradSGDRuleParameter": [
        ("learning_rate", 1, "double", 0.05), ("initial_g2sum", 2, "double", 3.0),
        ("initial_range", 3, "double", 0.0001), ("weight_bounds", 4, "repeated float"),
    ],
    "SparseAdamSGDParameter": [
        ("learning_rate", 1, "double", 0.001), ("initial_range", 2, "double", 0.0001),
        ("beta1_decay_rate", 3, "double", 0.9), ("beta2_decay_rate", 4, "double", 0.999),
        ("ada_epsilon", 5, "double", 1e-08), ("weight_bounds", 6, "repeated float"),
    ],
    "CtrAccessorParameter": [
        ("nonclk_coeff", 1, "float", 0.1), ("click_coeff", 2, "float", 1.0), ("base_threshold", 3, "float", 1.5),
        ("delta_threshold", 4, "float", 0.25), ("delta_keep_days", 5, "float", 16.0),
        ("show_click_decay_rate", 6, "float", 0.98), ("delete_threshold", 7, "float", 0.8),
        ("delete_after_unseen_days", 8, "float", 30.0), ("ssd_unseenday_threshold", 9, "int32", 1),
        ("show_scale", 10, "bool", True), ("zero_init", 11, "bool", True),
        ("load_filter_slots", 12, "repeated float"), ("save_filter_slots", 13, "repeated float"),
    ],
    "TableAccessorSaveParameter": [
        ("param", 1, "uint32"), ("converter", 2, "string"), ("deconverter", 3, "string"),
    ],
    "FsClientParameter": [
        ("uri", 1, "string"), ("user", 2, "string"), ("passwd", 3, "string"), ("hadoop_bin", 4, "string"),
    ],
    "NCCLConfig": [
        ("commName", 1, "string"), ("ll_buffsize", 2, "int32"), ("ll128_buffsize", 3, "int32"),
        ("simple_buffsize", 4, "int32"), ("buffsize_align", 5, "int32"), ("nchannels", 6, "int32"),
        ("algoStr", 7, "string"), ("protoStr", 8, "string"),
    ],
    "DpConfig": [
        ("nccl_config", 1, "NCCLConfig"), ("check_nccl_config", 2, "NCCLConfig"),
    ],
    "SepConfig": [
        ("nccl_config", 1, "NCCLConfig"),
    ],
    "DpSepConfig": [
        ("nccl_config", 1, "NCCLConfig"),
    ],
    "PpTpConfig": [
        ("nccl_config", 1, "NCCLConfig"),
    ],
    "EpConfig": [
        ("nccl_config", 1, "NCCLConfig"), ("grad_nccl_config", 2, "NCCLConfig"),
    ],
    "MoeShardingConfig": [
        ("nccl_config", 1, "NCCLConfig"), ("check_nccl_config", 2, "NCCLConfig"),
    ],
    "CpConfig": [
        ("nccl_config", 1, "NCCLConfig"),
    ],
    "CpShardingConfig": [
        ("nccl_config", 1, "NCCLConfig"),
    ],
    "DpCpConfig": [
        ("nccl_config", 1, "NCCLConfig"),
    ],
    "CpMpConfig": [
        ("nccl_config", 1, "NCCLConfig"),
    ],
    "DefaultCommGroupConfig": [
        ("nccl_config", 1, "NCCLConfig"),
    ],
}

# Fields of older Fleet releases that Paddle 3.x removed, kept so that their files still import;
# export-fleet never writes them (Paddle 3.3.1 refuses a file that sets one). ExecutionStrategy
# is the message of the removed execution_strategy field.
OLDER_FIELDS: Dict[str, List[Tuple[Any, ...]]] = {
    "DistributedStrategy": [("execution_strategy", 202, "ExecutionStrategy")],
    "BuildStrategy": [("enable_sequential_execution", 1, "bool", False), ("fix_op_run_order", 13, "bool", False)],
    "ExecutionStrategy": [("num_threads", 1, "int32", 1), ("num_iteration_per_drop_scope", 2, "int32", 10),
                          ("num_iteration_per_run", 3, "int32", 1), ("use_thread_barrier", 4, "bool", False)],
}
FieldProto = descriptor_pb2.FieldDescriptorProto
SCALARS = {"bool": FieldProto.TYPE_BOOL, "int32": FieldProto.TYPE_INT32, "uint32": FieldProto.TYPE_UINT32,
           "uint64": FieldProto.TYPE_UINT64, "float": FieldProto.TYPE_FLOAT, "double": FieldProto.TYPE_DOUBLE,
           "string": FieldProto.TYPE_STRING}


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """MESSAGES, OLDER_FIELDS and ENUMS as a .proto file would declare them."""
    proto = descriptor_pb2.FileDescriptorProto(name="lightfleet/fleet_strategy.proto", package=PACKAGE,
                                               syntax="proto2")
    for name, values in ENUMS.items():
        enum = proto.enum_type.add(name=name)
        for value, number in values:
            enum.value.add(name=value, number=number)
    for name in {**MESSAGES, **OLDER_FIELDS}:
        message = proto.message_type.add(name=name)
        for spec in MESSAGES.get(name, []) + OLDER_FIELDS.get(name, []):
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
    if field.type == FieldDescriptor.TYPE_MESSAGE:  # the fields it sets, e.g. hybrid_configs.mp_configs
        return {sub.name: plain(sub, sub_value) for sub, sub_value in value.ListFields()}
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return shortest_float32(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    return value


def is_older(path: str) -> bool:
    """Whether the field at `path` (build_strategy.fix_op_run_order) is one of OLDER_FIELDS:
    absent from Paddle 3.3.1's message, itself or the message holding it."""
    message = "DistributedStrategy"
    for name in path.split("."):
        spec = next((spec for spec in MESSAGES.get(message, []) if spec[0] == name), None)
        if spec is None:
            return True
        message = spec[2].rpartition(" ")[2]
    return False


def fleet_default(field: FieldDescriptor) -> Any:
    return [] if field.is_repeated else plain(field, field.default_value)
