"""Paddle 3.3.1's own DistributedStrategy, for the tests of Fleet strategy files
(tests/runner/test_fleet_paddle.py):

    python tests/paddle/strategy_file.py describe OUT.json
        every message DistributedStrategy holds: {message: [[field, number, type, repeated,
        default or null], ...]}, type being a scalar's name or the enum's or message's name;
    python tests/paddle/strategy_file.py load OUT.json FILE...
        each FILE read by DistributedStrategy.load_from_prototxt: {FILE: {"bytes": hex of the
        message it holds then, serialized deterministically} or {"error": the first line of why not}};
    python tests/paddle/strategy_file.py save OUT_DIR
        files written by DistributedStrategy.save_to_prototxt: every_field.prototxt (every field of
        every message set away from its default, one entry in each list) and the strategies of
        Paddle's guides, set through the Python API as a user would (a file each).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor


def field_type(field: FieldDescriptor) -> str:
    if field.message_type is not None:
        return field.message_type.name
    if field.enum_type is not None:
        return field.enum_type.name
    names = {FieldDescriptor.TYPE_BOOL: "bool", FieldDescriptor.TYPE_INT32: "int32", FieldDescriptor.TYPE_UINT32: "uint32",
             FieldDescriptor.TYPE_UINT64: "uint64", FieldDescriptor.TYPE_FLOAT: "float",
             FieldDescriptor.TYPE_DOUBLE: "double", FieldDescriptor.TYPE_STRING: "string"}
    return names[field.type]


def describe(out: str) -> None:
    from paddle.distributed.fleet.proto import distributed_strategy_pb2

    messages: dict = {}
    pending = [distributed_strategy_pb2.DistributedStrategy.DESCRIPTOR]
    while pending:
        message = pending.pop()
        if message.name in messages:
            continue
        messages[message.name] = [[field.name, field.number, field_type(field), field.is_repeated,
                                   field.default_value if field.has_default_value else None]
                                  for field in message.fields]
        pending += [field.message_type for field in message.fields if field.message_type is not None]
    Path(out).write_text(json.dumps(messages))


def load(out: str, *files: str) -> None:
    import paddle.distributed.fleet as fleet

    loaded = {}
    for path in files:
        strategy = fleet.DistributedStrategy()
        try:
            strategy.load_from_prototxt(path)
        except Exception as error:  # noqa: BLE001 (Paddle's refusal is what the test reads)
            loaded[path] = {"error": str(error).strip().splitlines()[0]}
        else:
            loaded[path] = {"bytes": strategy.strategy.SerializeToString(deterministic=True).hex()}
    Path(out).write_text(json.dumps(loaded))


def set_every_field(message) -> None:
    """Every field of `message` away from its default: scalars changed, lists of one, sub-messages
    filled the same way (each message type once on a path, so the recursion ends)."""
    for field in message.DESCRIPTOR.fields:
        if field.message_type is not None:
            if field.message_type.name in PATH:
                continue
            PATH.append(field.message_type.name)
            set_every_field(getattr(message, field.name).add() if field.is_repeated else getattr(message, field.name))
            PATH.pop()
            continue
        value = changed(field)
        if field.is_repeated:
            getattr(message, field.name).append(value)
        else:
            setattr(message, field.name, value)


PATH: list = []


def changed(field: FieldDescriptor):
    """A value of `field`'s type that is not its default."""
    default = field.default_value if not field.is_repeated else None
    if field.enum_type is not None:
        return next(value.number for value in field.enum_type.values if value.number != default)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return not default
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"{default or ''}_set"
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return (default or 0.0) + 0.5
    return (default or 0) + 3


def guides_strategies():
    """The strategies of Paddle's guides, as their code sets them."""
    import paddle.distributed.fleet as fleet

    resnet = fleet.DistributedStrategy()  # the collective-training guide's ResNet-50
    resnet.amp = True
    resnet.amp_configs = {"init_loss_scaling": 32768, "use_dynamic_loss_scaling": True,
                          "custom_black_list": ["LayerNorm"]}
    resnet.fuse_all_reduce_ops = True
    resnet.fuse_grad_size_in_MB = 32
    resnet.nccl_comm_num = 2
    bert = fleet.DistributedStrategy()  # large-batch training: lamb with recompute
    bert.lamb = True
    bert.lamb_configs = {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ["layer_norm", "bias"]}
    bert.recompute = True
    bert.recompute_configs = {"checkpoints": ["blocks.0", "blocks.1"]}
    hybrid = fleet.DistributedStrategy()  # dygraph hybrid parallel
    hybrid.hybrid_configs = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 1}
    sharding = fleet.DistributedStrategy()
    sharding.sharding = True
    sharding.sharding_configs = {"sharding_degree": 2, "stage": 2, "segment_broadcast_MB": 32}
    sharding.gradient_merge = True
    sharding.gradient_merge_configs = {"k_steps": 4, "avg": True}
    return {"resnet50": resnet, "bert_lamb_recompute": bert, "hybrid": hybrid, "sharding_gradient_merge": sharding}


def save(out_dir: str) -> None:
    import paddle.distributed.fleet as fleet

    every = fleet.DistributedStrategy()
    set_every_field(every.strategy)
    for name, strategy in {"every_field": every, **guides_strategies()}.items():
        strategy.save_to_prototxt(str(Path(out_dir) / f"{name}.prototxt"))


if __name__ == "__main__":
    {"describe": describe, "load": load, "save": save}[sys.argv[1]](*sys.argv[2:])
