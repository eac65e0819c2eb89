"""The payload bytes of the collectives lightfleet's strategies call, counted in real runs: per
rank, per optimizer step, per (op, process group). `measure.traffic=true` puts `TrafficRecorder`
in the plan; it turns counting on when the run is set up and writes every rank's counts to
`traffic/rank<R>.jsonl` in the run directory when training ends. Off (the default) nothing is
counted: `count` returns at once, and the strategies register torch's own hooks and comms.

Counted where each strategy calls the collective (docs/rehearse.md, "Collective traffic, counted
in real runs", has what each sends as formulas):
- DDP's gradient buckets: its communication hook (plugins/ddp.py; without a hook of the plan,
  torch's `allreduce_hook` counted), fp16_allreduce's compress hooks, dgc's hook, localsgd's
  post-local-SGD hook;
- localsgd and adaptive_localsgd: the parameter averaging, where their callbacks call it;
- sharding stage 1: `FleetZeroRedundancyOptimizer`'s parameter broadcasts (plugins/sharding.py);
- sharding stages 2 and 3: FSDP2's public `set_custom_all_gather` / `set_custom_reduce_scatter`
  and, for hybrid sharding, `set_all_reduce_hook` (`count_fsdp`);
- pipeline: the P2P operations the stages hand the schedule (`count_stage_p2p`), the DDP of its
  replicas, and the loss broadcast over the pipeline.

Payload is what this rank hands the collective: all_reduce and broadcast, the tensor (on every
rank of a broadcast, its source or not); all_gather, this rank's input; reduce_scatter, its whole
input; send, the tensor sent; recv, the buffer received into. Op names are the rehearsal's
(runner/rank/rehearse.py): all_reduce, all_gather, reduce_scatter, broadcast, send, recv,
all_to_all, reduce. lightfleet's own bookkeeping (the preemption vote, metric syncs),
validation, checkpoint saves and tensor parallelism's collectives (DTensor's, inside torch's
parallel styles, which offer no public hook) are not counted.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from typing_extensions import override

from runner.records.files import TRAFFIC_DIR

# (op, process group) -> [calls, bytes]; None while counting is off.
_pending: Optional[Dict[Tuple[str, Any], List[int]]] = None


def counting() -> bool:
    return _pending is not None


def start() -> None:
    global _pending
    _pending = {}


def stop() -> None:
    global _pending
    _pending = None


def count(op: str, payload: Union[torch.Tensor, int], group: Any = None) -> None:
    """One call of collective `op` over `group` (None: the world) handing it `payload` (a tensor, or bytes)."""
    if _pending is None:
        return
    size = payload if isinstance(payload, int) else payload.numel() * payload.element_size()
    entry = _pending.setdefault((op, dist.group.WORLD if group is None else group), [0, 0])
    entry[0] += 1
    entry[1] += size


def take(ranks_per_node: int) -> List[Dict[str, Any]]:
    """The rows counted since the last call, one per (op, group size, nodes the group spans), and
    start again from zero."""
    rows: Dict[Tuple[str, int, int], Dict[str, Any]] = {}
    for (op, group), (calls, size) in (_pending or {}).items():
        ranks = dist.get_process_group_ranks(group)
        nodes = len({rank // ranks_per_node for rank in ranks})
        row = rows.setdefault((op, len(ranks), nodes), {"op": op, "group_size": len(ranks), "nodes": nodes,
                                                        "calls": 0, "bytes": 0})
        row["calls"] += calls
        row["bytes"] += size
    if _pending is not None:
        _pending.clear()
    return sorted(rows.values(), key=lambda row: (row["op"], row["group_size"]))


# --------------------------------------------------------------------------- DDP hooks


def counted_allreduce_hook(process_group, bucket):  # no annotations: DDP checks them, and these would be strings
    """torch's `allreduce_hook` (what DDP does without a hook), counting the bucket it all-reduces."""
    count("all_reduce", bucket.buffer(), process_group)
    return allreduce_hook(process_group, bucket)


def counted_compress_hook(hook: Callable, wire_dtype: torch.dtype) -> Callable:
    """A compress hook of torch's (the bucket cast to `wire_dtype`, all-reduced), counting that
    all-reduce; `hook` itself while counting is off."""
    if not counting():
        return hook

    def counted_hook(process_group, bucket):
        count("all_reduce", bucket.buffer().numel() * wire_dtype.itemsize, process_group)
        return hook(process_group, bucket)

    return counted_hook


# --------------------------------------------------------------------------- FSDP2


class CountedAllGather:
    """FSDP2's all-gather (torch's default: `all_gather_single` into a fresh buffer), counted;
    the interface of `FSDPModule.set_custom_all_gather`."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        count("all_gather", input_tensor, group)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountedReduceScatter(CountedAllGather):
    """FSDP2's gradient reduce-scatter (torch's default: `reduce_scatter_single`), counted; the
    interface of `FSDPModule.set_custom_reduce_scatter`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        count("reduce_scatter", input_tensor, group)
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def count_fsdp(module: nn.Module, replicate_group: Any = None) -> None:
    """Count the collectives of every FSDP2 unit in `module` (while counting is on): all-gathers
    and reduce-scatters through torch's custom-comm interface, and hybrid sharding's all-reduce
    over `replicate_group` through its all-reduce hook, which FSDP calls with the reduced tensor."""
    from torch.distributed.fsdp import FSDPModule  # where sharding needs it, as plugins/sharding.py imports FSDP

    if not counting():
        return
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(CountedAllGather())
            unit.set_custom_reduce_scatter(CountedReduceScatter())
            if replicate_group is not None:
                unit.set_all_reduce_hook(functools.partial(count, "all_reduce", group=replicate_group))


# --------------------------------------------------------------------------- pipeline


def count_stage_p2p(stage: Any) -> None:
    """Count the sends and receives of a `torch.distributed.pipelining` stage (while counting is
    on). The schedules run the P2P operations the stage's public `get_{fwd,bwd}_{send,recv}_ops`
    return: those methods of this stage object are wrapped to count what they return."""
    if not counting():
        return
    for name in ("get_fwd_send_ops", "get_bwd_send_ops", "get_fwd_recv_ops", "get_bwd_recv_ops"):
        setattr(stage, name, functools.partial(_counted_p2p_ops, getattr(stage, name)))


def _counted_p2p_ops(ops_of: Callable[[int], List[dist.P2POp]], chunk: int) -> List[dist.P2POp]:
    ops = ops_of(chunk)
    for op in ops:
        count("send" if op.op is dist.isend else "recv", op.tensor, op.group)
    return ops


# --------------------------------------------------------------------------- the record


class TrafficRecorder(pl.Callback):
    """Counts the run's collectives (from `setup` to `teardown`) and keeps each optimizer step's
    rows; writes them to `traffic/rank<R>.jsonl` when training ends, a line per step:
    `{"step": 3, "collectives": [{"op", "group_size", "nodes", "calls", "bytes"}, ...]}`.
    Lightfleet's callbacks come after the strategies' (runner/core/plan.py), so a step's rows hold
    what their `on_train_batch_end` sent (localsgd's averaging)."""

    def __init__(self) -> None:
        self.steps: List[Dict[str, Any]] = []
        self._steps_seen = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        start()  # before the strategy wraps the model and configure_model shards it

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._steps_seen = trainer.global_step
        take(1)  # what setting up sent (Lightning's and the strategies' first broadcasts) is no step's

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._steps_seen:  # accumulating micro-batches: the step goes on
            return
        self._steps_seen = trainer.global_step
        ranks_per_node = max(1, trainer.world_size // trainer.num_nodes)
        self.steps.append({"step": trainer.global_step, "collectives": take(ranks_per_node)})

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        take(1)  # validation's collectives are no training step's

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = Path(trainer.default_root_dir) / TRAFFIC_DIR / f"rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(step) + "\n" for step in self.steps))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        stop()
