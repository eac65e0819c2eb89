"""Tensor parallelism (Fleet `strategy.sharding.mp_degree`) with torch's `parallelize_module`.

The model says how it splits: a method `tensor_parallel_plan() -> {module name or glob: style}`
(torch's ColwiseParallel / RowwiseParallel, as torchtitan's parallelize_llama uses them). Names
resolve as `parallelize_module` resolves them, one fnmatch glob per dotted part, but an entry
that matches nothing is refused here where torch would only warn and skip it.

Parallelized modules hold their parameters as DTensors over the tensor-parallel mesh; with the
default styles their outputs are plain local tensors (a colwise output holds this rank's slice
of the features, a rowwise output is all-reduced to the full tensor), so the layers between
them, the loss and the replicated parameters (embeddings, norms, head) run unchanged. Every
rank of the mesh must be fed the same batch.
"""
from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from plugins.transforms import ModelContext
from runner.core.errors import ConfigError

KEY = "strategy.sharding.mp_degree"


def parallelize(module: nn.Module, context: ModelContext) -> list[str]:
    """The plan's tensor_parallel phase: `apply_tensor_parallel` over the strategy's "tp" mesh dim."""
    if context.strategy is None:  # the model alone, checked in the command (runner/rank/build.py): no mesh
        return []
    return apply_tensor_parallel(module, context.strategy.device_mesh["tp"])


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Split `model` in place over the 1-D `mesh` (a 3-D mesh's "tp" sub-mesh, or a plain one)
    by its `tensor_parallel_plan()`. Returns the sorted qualified names of the parallelized modules.

    Raises ConfigError when the model has no plan, when a plan entry matches no module, or when
    a split feature dimension or an attention's heads do not divide by the mesh size.
    """
    degree = mesh.size()
    plan_fn = getattr(model, "tensor_parallel_plan", None)
    if not callable(plan_fn):
        raise ConfigError(KEY, degree, f"tensor parallelism needs the model to say how it splits: "
                                       f"{type(model).__name__} has no tensor_parallel_plan() method "
                                       f"(module name or glob -> ColwiseParallel/RowwiseParallel)")
    styles = {name: style for entry, style in plan_fn().items() for name in _resolve(model, entry)}
    for name, style in styles.items():
        _check_divisible(model, name, style, degree)
    for name, style in styles.items():
        parallelize_module(model.get_submodule(name), mesh, style)
    return sorted(styles)


def _resolve(model: nn.Module, entry: str) -> list[str]:
    """Qualified names `entry` matches, part by part as parallelize_module matches them."""
    patterns = entry.split(".")
    names = [name for name, _ in model.named_modules()
             if len(name.split(".")) == len(patterns) and all(map(fnmatch, name.split("."), patterns))]
    if not names:
        raise ConfigError(KEY, None, f"{type(model).__name__}.tensor_parallel_plan() entry {entry!r} matches no module")
    return names


def _check_divisible(model: nn.Module, name: str, style: ParallelStyle, degree: int) -> None:
    # torch would shard an uneven dimension unevenly, and an attention that views its q/k/v in
    # heads of `head_dim` features (the parent's attribute) fails on a slice of partial heads.
    module = model.get_submodule(name)
    if not isinstance(module, (nn.Linear, nn.Embedding)) or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        size, what = (module.out_features, "output features") if colwise else (module.in_features, "input features")
    else:
        size, what = (module.embedding_dim, "embedding features") if colwise else (module.num_embeddings, "rows")
    if size % degree:
        raise ConfigError(KEY, degree, f"{name} ({type(style).__name__}) splits {size} {what}, "
                                       f"not divisible by {degree} tensor-parallel ranks")
    parent_name = name.rpartition(".")[0]
    head_dim = getattr(model.get_submodule(parent_name), "head_dim", None)
    if colwise and isinstance(module, nn.Linear) and isinstance(head_dim, int) and (size // head_dim) % degree:
        raise ConfigError(KEY, degree, f"{parent_name} has {size // head_dim} attention heads "
                                       f"({size} features / head_dim {head_dim}), not divisible by "
                                       f"{degree} tensor-parallel ranks")
