"""Sharding (Fleet `strategy.sharding`): ZeRO stages 1-3 with PyTorch's own machinery.

The processes form a device mesh with dims ("dp_replicate", "dp_shard", "tp") of sizes
(dp_degree, degree, mp_degree); data is split over the first two.

- stage 1 (optimizer states sharded): DDP, with the model's optimizer wrapped in torch's
  `ZeroRedundancyOptimizer` over the dp_shard group. ZeRO gives each rank whole tensors, so
  layer-wise trust ratios (LARS, LAMB) see full-tensor norms.
- stages 2 and 3 (gradients too, and at 3 the parameters outside forward/backward): FSDP2
  `fully_shard` on Lightning's `ModelParallelStrategy`, applied here at setup (the user's
  module needs no `configure_model`) to units of consecutive modules of about
  `segment_broadcast_MB` of parameters, then to the root. Stage 2 keeps the parameters a unit
  gathered in forward until its backward (`reshard_after_forward=False`), stage 3 frees them
  after forward. dp_degree > 1 is HSDP; mp_degree > 1 applies tensor parallelism first;
  `optimize_offload` keeps sharded parameters, gradients and optimizer states in host memory.

Stage 2/3 checkpoints are distributed-checkpoint directories; `python -m plugins.sharding
export CKPT OUT` turns one (or a stage 1 file) into a single ordinary checkpoint file.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Generator, List, Optional

import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.strategies import ModelParallelStrategy, Strategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from plugins.ddp import FleetDDPStrategy
from plugins.layerwise import NO_WEIGHT_DECAY

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def sharding_mesh(device: torch.device, dp_degree: int, degree: int, mp_degree: int) -> DeviceMesh:
    # The plan checked that the degrees multiply to the world size before any process started.
    return init_device_mesh(device.type, (dp_degree, degree, mp_degree), mesh_dim_names=MESH_DIMS)


def data_parallel_rank(mesh: DeviceMesh) -> Dict[str, int]:
    """DistributedSampler arguments: the ranks of one tensor-parallel group read the same data."""
    replicate, shard = mesh["dp_replicate"], mesh["dp_shard"]
    return {"num_replicas": replicate.size() * shard.size(),
            "rank": replicate.get_local_rank() * shard.size() + shard.get_local_rank()}


# --------------------------------------------------------------------------- stage 1


class FleetZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer that keeps per-parameter group lists (`no_weight_decay`, one
    flag per parameter) aligned with the parameters each rank's local optimizer gets: torch
    copies every other group key whole into each rank's share and syncs it at every step."""

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
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return FleetZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=type(optimizer),
                                        process_group=group, **defaults)


def shard_strategy_optimizers(strategy: Strategy, group: Any) -> None:
    """Replace the optimizers Lightning set up on `strategy` by `shard_optimizer_states` over
    `group`, re-pointing their LR schedulers (which step the optimizer they hold)."""
    sharded = {id(optimizer): shard_optimizer_states(optimizer, group) for optimizer in strategy.optimizers}
    strategy.optimizers = [sharded[id(optimizer)] for optimizer in strategy.optimizers]
    for config in strategy.lr_scheduler_configs:
        config.scheduler.optimizer = sharded[id(config.scheduler.optimizer)]


class ZeroStage1Strategy(FleetDDPStrategy):
    """DDP whose optimizers are
    `FleetZeroRedundancyOptimizer`s over the dp_shard group of the mesh.

    Gradients are views into DDP's buckets, so a rank holds one copy of them. Lightning's
    `optimizer_state` consolidates ZeroRedundancyOptimizer on rank 0 for checkpoints, and
    `load_state_dict` hands each rank its share back.
    """

    def __init__(self, dp_degree: int, degree: int) -> None:
        super().__init__(gradient_as_bucket_view=True)
        self.dp_degree, self.degree = dp_degree, degree
        self.device_mesh: Optional[DeviceMesh] = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.device_mesh = sharding_mesh(self.root_device, self.dp_degree, self.degree, 1)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        shard_strategy_optimizers(self, self.device_mesh["dp_shard"].get_group())


# --------------------------------------------------------------------------- stages 2 and 3


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def shard_units(root: nn.Module, segment_bytes: float) -> List[List[str]]:
    """Qualified names of the modules to shard together: consecutive modules (in registration
    order) grouped until a unit holds about `segment_bytes` of parameters. A module larger
    than that is split into its children; parameters left outside every unit go to the root."""
    atoms: List[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            size = param_bytes(child)
            if size == 0:
                continue
            if size > segment_bytes and any(param_bytes(c) for c in child.children()):
                walk(child, f"{prefix}{name}.")
            else:
                atoms.append(f"{prefix}{name}")

    walk(root, "")
    units: List[List[str]] = []
    size = segment_bytes
    for name in atoms:
        if size >= segment_bytes:
            units.append([])
            size = 0
        units[-1].append(name)
        size += param_bytes(root.get_submodule(name))
    return units


def apply_fsdp(module: nn.Module, mesh: DeviceMesh, stage: int, segment_bytes: float,
               param_dtype: Optional[torch.dtype] = None, offload: bool = False) -> List[List[str]]:
    """FSDP2 over `mesh` (1-D: sharded; 2-D: replicated x sharded, HSDP) for ZeRO `stage` 2 or 3:
    `fully_shard` on each of `shard_units(module, segment_bytes)`, then on `module`. With
    `param_dtype`, parameters are gathered in it and gradients reduced in float32; `offload`
    keeps the shards (parameters, gradients, optimizer states) in host memory. Returns the units."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # Pinned host memory speeds up copies to an accelerator; without one there is nothing to pin.
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if offload else OffloadPolicy()
    options = dict(mesh=mesh, reshard_after_forward=stage == 3, mp_policy=mp_policy, offload_policy=offload_policy)
    units = shard_units(module, segment_bytes)
    for names in units:
        fully_shard([module.get_submodule(name) for name in names], **options)
    fully_shard(module, **options)
    return units


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy that applies FSDP2 itself: ZeRO stage 2 or 3 (see the module doc).

    Under Lightning's `MixedPrecision` (lightfleet's amp) parameters are gathered in its dtype
    and gradients reduced in float32 (`MixedPrecisionPolicy`); the float32 parameters stay the
    sharded master copy. `units` holds the module names of each FSDP unit after setup.
    """

    def __init__(self, stage: int, degree: int, dp_degree: int, mp_degree: int, optimize_offload: bool,
                 segment_broadcast_MB: float) -> None:
        super().__init__(data_parallel_size=dp_degree * degree, tensor_parallel_size=mp_degree)
        self.stage, self.degree, self.dp_degree, self.mp_degree = stage, degree, dp_degree, mp_degree
        self.optimize_offload = optimize_offload
        self.segment_bytes = segment_broadcast_MB * 2 ** 20
        self.units: List[List[str]] = []
        self.tensor_parallel: List[str] = []

    @override
    def setup_environment(self) -> None:
        # The base class's process group; its own 2-D mesh has other dim names than ours.
        self._setup_distributed()
        self._device_mesh = sharding_mesh(self.root_device, self.dp_degree, self.degree, self.mp_degree)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return data_parallel_rank(self.device_mesh)

    @override
    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, with the parallelization it expects from configure_model.
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.shard(self.lightning_module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def shard(self, module: nn.Module) -> None:
        if self.mp_degree > 1:
            from plugins.tensor_parallel import apply_tensor_parallel

            self.tensor_parallel = apply_tensor_parallel(module, self.device_mesh["tp"])
        dims = ("dp_replicate", "dp_shard") if self.dp_degree > 1 else ("dp_shard",)
        precision = self.precision_plugin
        param_dtype = None
        if isinstance(precision, MixedPrecision):
            param_dtype = torch.bfloat16 if precision.precision == "bf16-mixed" else torch.float16
        self.units = apply_fsdp(module, self.device_mesh[dims], self.stage, self.segment_bytes, param_dtype,
                                self.optimize_offload)
        rank_zero_info(f"lightfleet: sharding stage {self.stage} units: "
                       + "; ".join("+".join(names) for names in self.units))

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Accumulation micro-steps keep unsharded gradients and reduce-scatter once, at the last.
        self.lightning_module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.lightning_module.set_requires_gradient_sync(True)


def build_sharding(stage: int, degree: int, dp_degree: int, mp_degree: int, optimize_offload: bool,
                   segment_broadcast_MB: float) -> Strategy:
    """The Lightning strategy for ZeRO `stage` (1, 2 or 3) on a (dp_degree, degree, mp_degree)
    mesh. The schema has refused tensor parallelism and offload at stage 1."""
    if stage == 1:
        return ZeroStage1Strategy(dp_degree, degree)
    return FSDP2Strategy(stage, degree, dp_degree, mp_degree, optimize_offload, segment_broadcast_MB)


# --------------------------------------------------------------------------- export


def export(checkpoint: Path, out: Path) -> None:
    """Write `checkpoint` (a stage 2/3 distributed-checkpoint directory, or a stage 1 file) as
    one file in Lightning's layout: "state_dict" holds the full model state under the plain
    module's keys, "optimizer_states" the full optimizer states (keyed by parameter name for
    a directory), and the rest is what Lightning saved alongside. No process group needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not checkpoint.is_dir():
        torch.save(torch.load(checkpoint, map_location="cpu", weights_only=False), out)
        return
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, map_location="cpu", weights_only=False)
    meta = checkpoint / "meta.pt"  # ModelParallelStrategy's file for everything but weights and optimizers
    full = torch.load(meta, map_location="cpu", weights_only=False) if meta.is_file() else {}
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
