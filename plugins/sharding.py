"""Sharding (Fleet `strategy.sharding`): ZeRO with PyTorch's own machinery, on the layout's mesh
(runner/core/world.py): stage 1 is DDP with torch's `ZeroRedundancyOptimizer` over the dp_shard
group (`build_zero_stage1`); stages 2 and 3 are FSDP2 `fully_shard`, applied by the plan's
sharding transform (`shard_parameters`) on Lightning's `ModelParallelStrategy` (`build_fsdp`).
runner/strategies/sharding.py decides what each stage means. Stage 2/3 checkpoints are
distributed-checkpoint directories; `python -m plugins.sharding export CKPT OUT` turns one (or
a stage 1 file) into one ordinary checkpoint file. Details: docs/strategies.md#sharding.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Generator, List, Optional, Tuple

import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.strategies import Strategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from plugins import traffic
from plugins.ddp import FleetDDPStrategy, process_group_timeout
from plugins.directory_checkpoint import WholeCheckpointStrategy
from plugins.fast_path import constructor_defaults
from plugins.layerwise import NO_WEIGHT_DECAY
from plugins.modules import float_buffer_modules, repeated_block_list
from plugins.rehearsal import real_tensors
from plugins.transforms import ModelContext
from runner.core.world import Layout


def layout_mesh(device_type: str, layout: Layout, dims: Tuple[str, ...]) -> DeviceMesh:
    """The processes' device mesh over `dims` of the layout (the plan checked the degrees' product);
    the other dims must have size 1. Fewer dims, fewer process groups to create. Made on real
    tensors in a rehearsal: the mesh's creation runs a data-dependent op that fake ones cannot."""
    sizes = layout.to_dict()
    left_out = {dim: size for dim, size in sizes.items() if dim not in dims and size > 1}
    if left_out:
        raise ValueError(f"a mesh over {dims} cannot lay out {left_out}")
    with real_tensors():
        return init_device_mesh(device_type, tuple(sizes[dim] for dim in dims), mesh_dim_names=dims)


# --------------------------------------------------------------------------- stage 1


class FleetZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer that keeps per-parameter group lists (`no_weight_decay`, one
    flag per parameter) aligned with the parameters each rank's local optimizer gets: torch
    copies every other group key whole into each rank's share and syncs it at every step; and
    counts the parameter broadcasts of its step (plugins/traffic.py)."""

    @override
    def _broadcast_params_from_rank(self, rank: int) -> List[Any]:
        # torch offers no public hook into the optimizer's broadcasts: this method of its makes
        # them, one per parameter of `rank`'s share (parameters_as_bucket_view is left off).
        if traffic.counting():
            for group in self._partition_parameters()[rank]:
                for param in group["params"]:
                    traffic.count("broadcast", param, self.process_group)
        return super()._broadcast_params_from_rank(rank)

    @override
    def _partition_param_group(self, param_group: Dict[str, Any], params_per_rank: List[List[torch.Tensor]]) -> None:
        super()._partition_param_group(param_group, params_per_rank)
        flags = param_group.get(NO_WEIGHT_DECAY)
        if flags is None:
            return
        flag_of = {id(param): flag for param, flag in zip(param_group["params"], flags)}
        for rank, params in enumerate(params_per_rank):
            self._partition_parameters_cache[rank][-1][NO_WEIGHT_DECAY] = [flag_of[id(p)] for p in params]

    @staticmethod
    @override
    def _sync_param_groups(src_param_groups: List[Dict[Any, Any]], dst_param_groups: List[Dict[Any, Any]]) -> None:
        if len(src_param_groups) != len(dst_param_groups):
            raise AssertionError("Mismatch between number of source and destination parameter groups")
        for src, dst in zip(src_param_groups, dst_param_groups):
            dst.update({key: value for key, value in src.items() if key not in ("params", NO_WEIGHT_DECAY)})


def shard_optimizer_states(optimizer: Optimizer, group: Any) -> FleetZeroRedundancyOptimizer:
    """`optimizer`'s class over its param groups (every key kept), its state sharded over `group`.

    The class's constructor gets the defaults it accepts; the groups carry the rest.
    """
    return FleetZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=type(optimizer),
                                        process_group=group, **constructor_defaults(optimizer))


def shard_strategy_optimizers(strategy: Strategy, group: Any) -> None:
    """Replace the optimizers Lightning set up on `strategy` by `shard_optimizer_states` over
    `group`, re-pointing their LR schedulers (which step the optimizer they hold)."""
    sharded = {id(optimizer): shard_optimizer_states(optimizer, group) for optimizer in strategy.optimizers}
    strategy.optimizers = [sharded[id(optimizer)] for optimizer in strategy.optimizers]
    for config in strategy.lr_scheduler_configs:
        config.scheduler.optimizer = sharded[id(config.scheduler.optimizer)]


class ZeroStage1Strategy(FleetDDPStrategy):
    """DDP whose optimizers are `FleetZeroRedundancyOptimizer`s over the layout's dp_shard group.

    Gradients are views into DDP's buckets, so a rank holds one copy of them. Lightning's
    `optimizer_state` consolidates ZeroRedundancyOptimizer on rank 0 for checkpoints, and
    `load_state_dict` hands each rank its share back.
    """

    def __init__(self, layout: Layout, **kwargs: Any) -> None:
        super().__init__(gradient_as_bucket_view=True, **kwargs)
        self.layout = layout
        self.device_mesh: Optional[DeviceMesh] = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.device_mesh = layout_mesh(self.root_device.type, self.layout, ("dp_replicate", "dp_shard"))

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        shard_strategy_optimizers(self, self.device_mesh["dp_shard"].get_group())


def build_zero_stage1(layout: Dict[str, int], timeout_s: Optional[float] = None) -> ZeroStage1Strategy:
    return ZeroStage1Strategy(Layout(**layout), **process_group_timeout(timeout_s))


# --------------------------------------------------------------------------- stages 2 and 3


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def shard_units(root: nn.Module, segment_bytes: float) -> List[List[str]]:
    """Qualified names of the modules to shard together: consecutive modules (in registration
    order) grouped until a unit holds about `segment_bytes` of parameters. A module larger
    than that is split into its children, and so are the model's repeated block list and the
    modules holding it: its blocks are what the model's forward calls (a model may call its
    blocks in a loop without calling the list or a wrapper around it: FSDP gathers a unit's
    parameters when the forward of one of its modules runs). Parameters left outside every unit
    go to the root. A module holding a parameter an earlier unit holds (a head tied to the token
    embedding) joins that unit: FSDP2 shards a parameter in one unit only, and refuses at the
    first forward a tied one that two units hold."""
    found = repeated_block_list(root)
    blocks = found[0] if found else None
    atoms: List[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            size, path = param_bytes(child), f"{prefix}{name}"
            if size == 0:
                continue
            holds_blocks = blocks is not None and (blocks == path or blocks.startswith(path + "."))
            if (size > segment_bytes or holds_blocks) and any(param_bytes(c) for c in child.children()):
                walk(child, f"{path}.")
            else:
                atoms.append(path)

    walk(root, "")
    units: List[List[str]] = []
    unit_of: Dict[int, List[str]] = {}  # a parameter's id -> the unit holding it
    size = segment_bytes
    for name in atoms:
        params = list(root.get_submodule(name).parameters())
        tied = next((unit_of[id(p)] for p in params if id(p) in unit_of), None)
        if tied is not None:
            tied.append(name)
            continue
        if size >= segment_bytes:
            units.append([])
            size = 0
        units[-1].append(name)
        unit_of.update((id(p), units[-1]) for p in params)
        size += param_bytes(root.get_submodule(name))
    return units


def apply_fsdp(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, segment_bytes: float,
               param_dtype: Optional[torch.dtype] = None, offload: bool = False) -> List[List[str]]:
    """FSDP2 over `mesh` (1-D: sharded; 2-D: replicated x sharded, HSDP): `fully_shard` on each
    of `shard_units(module, segment_bytes)`, then on `module`. `reshard_after_forward` frees each
    unit's gathered parameters after its forward (ZeRO stage 3) instead of keeping them until its
    backward (stage 2). With `param_dtype`, parameters are gathered in it and gradients reduced in
    float32; the `float_buffer_modules` are units of their own, computing in float32. `offload`
    keeps the shards (parameters, gradients, optimizer states) in host memory. Returns the units."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # Pinned host memory speeds up copies to an accelerator; without one there is nothing to pin.
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if offload else OffloadPolicy()
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                   offload_policy=offload_policy)
    # FSDP casts parameters, not buffers: batch norm would get half weights beside float32
    # running statistics, which its kernels refuse. Such a module is sharded alone and computes
    # in float32 (as FSDP1 kept batch norm, and as FSDP2's authors advise), handing its output on
    # in `param_dtype`, as batch norm under autocast does.
    kept = [name for name in float_buffer_modules(module) if name] if param_dtype is not None else []
    float32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=param_dtype)
    for name in kept:
        fully_shard(module.get_submodule(name), **{**options, "mp_policy": float32})
    units = [rest for names in shard_units(module, segment_bytes) if (rest := [n for n in names if n not in kept])]
    for names in units:
        fully_shard([module.get_submodule(name) for name in names], **options)
    fully_shard(module, **options)
    traffic.count_fsdp(module, mesh.get_group(0) if mesh.ndim == 2 else None)  # HSDP: dim 0 replicates
    return [[name] for name in kept] + units


def shard_parameters(module: nn.Module, context: ModelContext, reshard_after_forward: bool,
                     segment_broadcast_MB: float, optimize_offload: bool) -> List[str]:
    """The plan's sharding phase: `apply_fsdp` over the data-parallel dims of the strategy's mesh,
    gathering in the amp dtype under Lightning's `MixedPrecision`. Returns the units, as names
    joined by "+"."""
    strategy = context.strategy
    if strategy is None:  # the model alone, checked in the command (runner/rank/build.py): no mesh to shard over
        return []
    dims = ("dp_replicate", "dp_shard") if strategy.layout.dp_replicate > 1 else ("dp_shard",)
    precision = strategy.precision_plugin
    param_dtype = None
    if isinstance(precision, MixedPrecision):
        param_dtype = torch.bfloat16 if precision.precision == "bf16-mixed" else torch.float16
    # On tensor-parallel parameters FSDP2 joins the meshes, which fake tensors cannot (a rehearsal's
    # parameters stay fake: what fully_shard makes of them is made from them).
    with real_tensors():
        units = apply_fsdp(module, strategy.device_mesh[dims], reshard_after_forward, segment_broadcast_MB * 2 ** 20,
                           param_dtype, optimize_offload)
    return ["+".join(names) for names in units]


class FSDP2Strategy(WholeCheckpointStrategy):
    """ModelParallelStrategy on the layout's mesh, for ZeRO stages 2 and 3: the model's
    configure_model shards it (`shard_parameters`, after tensor parallelism and recompute); its
    checkpoint directories are written whole (plugins/directory_checkpoint.py)."""

    def __init__(self, layout: Layout, **kwargs: Any) -> None:
        super().__init__(data_parallel_size=layout.data_parallel_size, tensor_parallel_size=layout.tp, **kwargs)
        self.layout = layout

    @override
    def setup_environment(self) -> None:
        # The base class's process group; its own 2-D mesh has other dim names than ours.
        self._setup_distributed()
        self._device_mesh = layout_mesh(self.root_device.type, self.layout, ("dp_replicate", "dp_shard", "tp"))
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        # The ranks of one tensor-parallel group read the same batches.
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.layout.data_parallel_rank(self.global_rank)}

    @override
    def model_to_device(self) -> None:
        # fully_shard placed every parameter: on the mesh's device, or in host memory when offloading.
        pass

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Accumulation micro-steps keep unsharded gradients and reduce-scatter once, at the last.
        self.lightning_module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.lightning_module.set_requires_gradient_sync(True)


def build_fsdp(layout: Dict[str, int], timeout_s: Optional[float] = None) -> FSDP2Strategy:
    return FSDP2Strategy(Layout(**layout), **process_group_timeout(timeout_s))


# --------------------------------------------------------------------------- export


def export(checkpoint: Path, out: Path) -> None:
    """Write `checkpoint` (a stage 2/3 distributed-checkpoint directory, or a stage 1 file) as
    one file in Lightning's layout: "state_dict" holds the full model state under the plain
    module's keys, "optimizer_states" the full optimizer states (keyed by parameter name for
    a directory), and the rest is what Lightning saved alongside. No process group needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not checkpoint.is_dir():
        torch.save(torch.load(checkpoint, map_location="cpu", weights_only=True), out)  # data only, never code
        return
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, map_location="cpu", weights_only=True)
    meta = checkpoint / "meta.pt"  # ModelParallelStrategy's file for everything but weights and optimizers
    full = torch.load(meta, map_location="cpu", weights_only=True) if meta.is_file() else {}
    full["state_dict"] = state.pop("state_dict")
    optimizers = sorted((key for key in state if key.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    full["optimizer_states"] = [state.pop(key) for key in optimizers]
    torch.save(full, out)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins.sharding", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="consolidate a checkpoint into one file")
    exporting.add_argument("checkpoint", type=Path, help="a stage 2/3 checkpoint directory or a stage 1 file")
    exporting.add_argument("out", type=Path, help="the file to write")
    args = parser.parse_args(argv)
    export(args.checkpoint, args.out)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
