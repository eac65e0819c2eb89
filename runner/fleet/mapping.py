"""Which lightfleet key each field of Fleet's DistributedStrategy sets, or why none (docs/fleet.md has
the whole table). A Fleet switch that is on selects the lightfleet strategy of that name; a field
of `<strategy>_configs` sets the knob of that name (RENAMED lists the exceptions); a
collective-training field sets the `collective.*` knob of its path (collective_fields); `a_sync`
with `a_sync_configs.k_steps` set parameter_server.* (Fleet's parameter-server modes). Every other
field has its reason in NOT_MAPPED.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Optional, Tuple

from google.protobuf.descriptor import FieldDescriptor

from runner import strategies
from runner.config.collective import CollectiveConfig, collective_knobs
from runner.fleet.message import MESSAGES, strategy_class


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
QUANTIZATION = "quantization-aware training (QAT) is not a lightfleet strategy"
AUTO_PARALLEL_TUNING = "Paddle auto-parallel's tuning; lightfleet's is strategy=[auto]"
SEGMENTS = "lightfleet groups sharded units by segment_broadcast_MB only"
# Why a Fleet field has no lightfleet meaning. A sub-message's entry covers all its fields.
NOT_MAPPED = {
    "mode": "lightfleet always trains collectively (Fleet's COLLECTIVE mode)",
    "elastic": "elastic training is not supported",
    **{f"a_sync_configs.{spec[0]}": SERVER_RUNTIME for spec in MESSAGES["AsyncConfig"] if spec[0] != "k_steps"},
    **{name: PARAMETER_SERVER for name in ("adam_d2sum", "heter_ccl_mode", "is_fl_ps_mode", "with_coordinator",
                                          "trainer_desc_configs", "downpour_table_param", "fs_client_param")},
    "fuse_grad_size_in_num": ALLREDUCE, "last_comm_group_size_MB": ALLREDUCE, "calc_comm_same_stream": ALLREDUCE,
    "without_graph_optimization": STATIC_GRAPH, "fuse_grad_merge": STATIC_GRAPH,
    **{f"build_strategy.{name}": STATIC_GRAPH for name in (
        "enable_sequential_execution", "fuse_broadcast_ops", "enable_backward_optimizer_op_deps",
        "cache_runtime_context", "fuse_bn_add_act_ops", "enable_addto", "fix_op_run_order",
        "allow_cuda_graph_capture", "reduce_strategy", "debug_graphviz_path", "fused_attention",
        "fused_feedforward", "fuse_dot_product_attention", "fuse_resunit")},
    "execution_strategy.use_thread_barrier": "static-graph executor setting; PyTorch runs eagerly",
    "tensor_parallel": TENSOR_PARALLEL, "tensor_parallel_configs": TENSOR_PARALLEL,
    "hybrid_configs": "dygraph hybrid-parallel degrees: set strategy.sharding's degree, dp_degree, mp_degree "
                      "and pp_degree by hand",
    "asp": "automatic sparsity (ASP) is not a lightfleet strategy",
    "qat": QUANTIZATION, "qat_configs": QUANTIZATION,
    "split_data": "auto-parallel's data split; lightfleet always splits the data over the data-parallel ranks",
    "recompute_configs.enable_tuning": AUTO_PARALLEL_TUNING, "sharding_configs.enable_tuning": AUTO_PARALLEL_TUNING,
    "recompute_configs.refined_ops_patterns": "refined recompute of Paddle's hybrid parallel (ops kept out of "
                                              "recompute); lightfleet recomputes whole modules",
    "sharding_configs.use_calc_stream": "stream choice of the static-graph sharding pass; FSDP schedules its own",
    "pipeline_configs.enable_partial_send_recv": "sends tensor-parallel slices between stages (Paddle's hybrid "
                                                 "parallel); torch.distributed.pipelining sends whole tensors",
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


def fleet_field(message: Any, strategy: str, knob: str) -> Optional[Tuple[FieldDescriptor, Callable[[Any], Any]]]:
    """The field of `<strategy>_configs` that holds `knob`, with knob value -> Fleet value."""
    config = message.DESCRIPTOR.fields_by_name.get(f"{strategy}_configs")
    if config is None:
        return None
    name, to_fleet, _ = RENAMED.get((strategy, knob), (knob, same, same))
    field = config.message_type.fields_by_name.get(name)
    return (field, to_fleet) if field is not None else None

