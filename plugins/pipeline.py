"""Pipeline parallelism (Fleet `strategy.pipeline`) on `torch.distributed.pipelining` schedules.

Lightning has no pipeline strategy, so `PipelineStrategy` carries one out. The processes form a
("dp", "pp") device mesh: `data_parallel_size` replicas of a pipeline of world_size /
data_parallel_size ranks (Fleet's dp_degree x pp_degree). Each process is one pipeline rank
holding `vpp_degree` stages; the ranks of a pipeline read the same batches, the replicas
different ones. At setup the model is traced by torch's frontend (`pipeline()`, torch.export)
on a micro-batch of the first training batch and split where the stages begin; the traced stage
modules share the model's parameter objects under their original names. The model then keeps
only this rank's parameters and buffers, so the optimizer, `state_dict()` and the distributed
checkpoint (one directory, every rank writing its own keys, by ModelParallelStrategy; what the
replicas hold alike is written once, by torch's planner) hold this rank's stages under the
names of the unsplit model.

With replicas, each stage module runs inside DDP over the dp group: torch's stage runs it
without gradient sync but at its last micro-batch's backward, so gradients are averaged over the
replicas once a step. `shard_optimizer_states` (ZeRO stage 1, Fleet's sharding stage 1 with
pipeline) wraps the optimizers in plugins.sharding's ZeroRedundancyOptimizer over the dp group:
each rank steps and checkpoints the optimizer state of its whole-tensor share of its stages'
parameters, then the updated parameters are broadcast to the other replicas.

A training step runs the schedule on the batch: inputs go to the first stage, targets to the
last, whose loss is the model's `loss(outputs, targets)` per micro-batch; the schedule runs
backward itself, so the gradient is that of the mean micro-batch loss (over all replicas'
micro-batches). The user's `training_step` is bypassed: the mean loss is broadcast from the last
stage and logged as `train_loss` on every rank of the pipeline (each replica logs its own
batch's, as under DDP). Only fitting is supported.

Validation runs inside fitting, forward only. The traced graph bakes in the module modes it was
traced in (batch norm's batch statistics and running-stat updates, dropout), so the model is
traced a second time in eval mode into stages sharing the same parameter and buffer objects; a
validation step runs the same schedule's `eval()` over those stages. The user's
`validation_step` is bypassed too: only `val_loss` is logged, the mean micro-batch loss
broadcast from the last stage, averaged over the replicas (`sync_dist`).

Recomputation (plugins/recompute.py wraps blocks before the strategy sees the model) cannot be
traced through; the wrappers are taken off for tracing and the same wrappers are put around
the traced blocks, which then recompute in backward as before.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from pathlib import Path
from typing import Any, Iterator, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning_fabric.strategies.fsdp import _METADATA_FILENAME
from pytorch_lightning.strategies import ModelParallelStrategy
from pytorch_lightning.strategies.strategy import _optimizers_to_device
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble, SplitPoint, pipeline)
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from plugins.modules import child_name, repeated_block_list
from plugins.sharding import shard_strategy_optimizers
from runner.errors import ConfigError

KEY = "strategy.pipeline"
SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZBVZeroBubble": ScheduleZBVZeroBubble}
# Optimizer state keyed by parameter name, hyper-parameters too: every rank's keys differ, so the
# distributed checkpoint keeps each rank's (a list of parameter groups would collide across ranks).
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
# Schedules placing one stage per rank; the others take the list of a rank's stages.
SINGLE_STAGE = ("1F1B", "GPipe")
MESH_DIMS = ("dp", "pp")  # rank = dp coordinate * pp_size + pp coordinate: a pipeline's ranks are consecutive


def build_pipeline(schedule_mode: str, micro_batch_size: int, accumulate_steps: int, split_points: list[str],
                   vpp_degree: int, data_parallel_size: int = 1,
                   shard_optimizer_states: bool = False) -> "PipelineStrategy":
    return PipelineStrategy(schedule_mode, micro_batch_size, accumulate_steps, split_points, vpp_degree,
                            data_parallel_size, shard_optimizer_states)


def stage_ranks(pipeline_size: int, vpp_degree: int, schedule_mode: str) -> list[int]:
    """The pipeline rank holding each stage: looping over the ranks (rank r holds r, r + P, ...),
    or in a V for ZBV (rank r holds r and 2P - 1 - r, so the last stage is back on rank 0)."""
    if schedule_mode == "ZBVZeroBubble":
        return [*range(pipeline_size), *reversed(range(pipeline_size))]
    return [stage % pipeline_size for stage in range(pipeline_size * vpp_degree)]


def stage_split_points(model: nn.Module, split_points: list[str], num_stages: int) -> list[str]:
    """Names of the modules where stages 1 .. num_stages - 1 begin: `split_points` checked, or
    the model's repeated block list cut into `num_stages` runs of blocks of balanced parameter
    counts (the parameters before the blocks count with the first run, those after with the last)."""
    if split_points:
        names = {name for name, _ in model.named_modules() if name}
        unknown = [name for name in split_points if name not in names]
        if unknown:
            raise ConfigError(f"{KEY}.split_points", unknown, "name no module of the model")
        if len(split_points) != num_stages - 1:
            raise ConfigError(f"{KEY}.split_points", split_points,
                              f"name {len(split_points)} stage beginnings; {num_stages} stages need {num_stages - 1}")
        return list(split_points)
    found = repeated_block_list(model)
    if found is None:
        raise ConfigError(f"{KEY}.split_points", [], "the model has no repeated block list (a ModuleList or "
                                                     "Sequential of >= 2 modules of one class) to split into "
                                                     "stages; name the modules where stages begin")
    prefix, block_list = found
    blocks = list(block_list.children())
    if len(blocks) < num_stages:
        raise ConfigError(f"{KEY}.split_points", [], f"the model's repeated block list {prefix} has {len(blocks)} "
                                                     f"blocks, fewer than the {num_stages} stages; name the modules "
                                                     "where stages begin")
    params = list(model.parameters())
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    first = next((i for i, p in enumerate(params) if id(p) in in_blocks), len(params))
    outside = [(i, p.numel()) for i, p in enumerate(params) if id(p) not in in_blocks]
    weights = [sum(p.numel() for p in block.parameters()) for block in blocks]
    weights[0] += sum(numel for i, numel in outside if i < first)
    weights[-1] += sum(numel for i, numel in outside if i > first)
    return [child_name(prefix, str(index)) for index in balanced_cuts(weights, num_stages)]


def balanced_cuts(weights: list[int], parts: int) -> list[int]:
    """Start indices of parts 1 .. parts - 1 of the split of `weights` into `parts` non-empty
    contiguous runs whose heaviest run is lightest."""
    prefix = [0, *itertools.accumulate(weights)]

    @functools.cache
    def best(start: int, runs: int) -> tuple[int, tuple[int, ...]]:
        if runs == 1:
            return prefix[-1] - prefix[start], ()
        return min((max(prefix[cut] - prefix[start], best(cut, runs - 1)[0]), (cut, *best(cut, runs - 1)[1]))
                   for cut in range(start + 1, len(weights) - runs + 2))

    return list(best(0, parts)[1])


class PipelineStrategy(ModelParallelStrategy):
    """One pipeline rank per process running `schedule_mode` over `accumulate_steps` micro-batches
    of `micro_batch_size` samples per optimizer step; stages begin at `split_points` (balanced
    over the repeated blocks when empty), `vpp_degree` of them per rank. `data_parallel_size`
    replicas of the pipeline read different batches; with `shard_optimizer_states` (ZeRO stage
    1) each replica's optimizer steps only its share of the parameters.

    ModelParallelStrategy brings the process group, the launcher and the distributed checkpoint.
    """

    def __init__(self, schedule_mode: str, micro_batch_size: int, accumulate_steps: int, split_points: list[str],
                 vpp_degree: int, data_parallel_size: int = 1, shard_optimizer_states: bool = False) -> None:
        super().__init__(data_parallel_size=data_parallel_size)
        self.schedule_mode = schedule_mode
        self.micro_batch_size = micro_batch_size
        self.accumulate_steps = accumulate_steps
        self.split_points = list(split_points)
        self.vpp_degree = vpp_degree
        self.data_parallel_size = data_parallel_size
        self.shard_optimizer_states = shard_optimizer_states
        self.schedule: Any = None
        self.stages: list[Any] = []  # this rank's torch PipelineStages, in stage order
        self.eval_schedule: Any = None  # the same schedule over the eval-mode stages
        self.eval_stages: list[Any] = []
        self.stage_ranks: list[int] = []  # the pipeline (pp group) rank holding each stage
        self._micro_batch_losses: list[torch.Tensor] = []
        self._gradients: list[Optional[torch.Tensor]] = []

    @override
    def setup_environment(self) -> None:
        # The base class's process group, with our ("dp", "pp") mesh instead of its own; the
        # schema checked that data_parallel_size divides the world size.
        self._setup_distributed()
        mesh_shape = (self.data_parallel_size, self.world_size // self.data_parallel_size)
        self._device_mesh = init_device_mesh(self.root_device.type, mesh_shape, mesh_dim_names=MESH_DIMS)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one pipeline read the same batches, the replicas different ones.
        return {"num_replicas": self.data_parallel_size, "rank": self.device_mesh["dp"].get_local_rank()}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._refuse_unsupported(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        # Before tracing: moving a buffer replaces it, and the stages must share the model's.
        self.model_to_device()
        self._build_schedule(trainer)
        self.setup_optimizers(trainer)
        if self.shard_optimizer_states:
            shard_strategy_optimizers(self, self.device_mesh["dp"].get_group())
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)

    def _refuse_unsupported(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            raise ConfigError(KEY, None, f"pipeline stages are built by trainer.fit only (which validates too), "
                                         f"not trainer.{trainer.state.fn}")
        if not callable(getattr(self.lightning_module, "loss", None)):
            raise ConfigError("model", type(self.lightning_module).__name__,
                              "has no loss(outputs, targets) method, which the last pipeline stage calls per micro-batch")
        if self.schedule_mode == "ZBVZeroBubble" and dist.get_backend() == "gloo":
            raise ConfigError(f"{KEY}.schedule_mode", self.schedule_mode,
                              "fails on the gloo backend (CPU) in torch 2.13: its first p2p exchange finds a gloo "
                              "pair not connected; use it on CUDA (nccl) or choose 1F1B, GPipe or Interleaved1F1B")
        if trainer.gradient_clip_val:
            raise ConfigError("trainer.gradient_clip_val", trainer.gradient_clip_val,
                              "is not supported with strategy pipeline: each rank would clip its stages by their own norm")

    def _build_schedule(self, trainer: pl.Trainer) -> None:
        model = self.lightning_module
        pipeline_ranks = self.device_mesh["pp"]
        self.stage_ranks = stage_ranks(pipeline_ranks.size(), self.vpp_degree, self.schedule_mode)
        wrappers = _take_off_checkpoint_wrappers(model)
        try:
            split_points = stage_split_points(model, self.split_points, len(self.stage_ranks))
            example = self._example_micro_batch(trainer)
            # Under autocast, as in training: the stages' p2p buffers take the traced dtypes.
            with self.precision_plugin.train_step_context():
                self.stages = self._build_stages(model, example, split_points)
            with self.precision_plugin.val_step_context(), _in_eval_mode(model):
                self.eval_stages = self._build_stages(model, example, split_points)
        finally:
            _put_on_checkpoint_wrappers(model, wrappers)
        for stage in self.stages:  # forward only, the eval stages have nothing to recompute
            _put_on_checkpoint_wrappers(stage.submod, wrappers)
        _keep_only_stages(model, [stage.submod for stage in (*self.stages, *self.eval_stages)])
        if self.data_parallel_size > 1:
            for stage in self.stages:
                _replicate(stage, self.device_mesh["dp"].get_group())
        self.schedule = self._schedule_over(self.stages)
        self.eval_schedule = self._schedule_over(self.eval_stages)

    def _build_stages(self, model: nn.Module, example: torch.Tensor, split_points: list[str]) -> list[Any]:
        """This rank's stages of `model` traced (in its current mode) on `example`."""
        pipe = _trace(model, example, split_points)
        if pipe.num_stages != len(self.stage_ranks):
            raise ConfigError(f"{KEY}.split_points", split_points,
                              f"split the forward into {pipe.num_stages} stages, not {len(self.stage_ranks)} "
                              "(each must be a module the forward calls, once)")
        pipeline_ranks = self.device_mesh["pp"]
        return [pipe.build_stage(index, self.root_device, pipeline_ranks.get_group())
                for index, rank in enumerate(self.stage_ranks) if rank == pipeline_ranks.get_local_rank()]

    def _schedule_over(self, stages: list[Any]) -> Any:
        schedule = SCHEDULES[self.schedule_mode]
        try:
            return schedule(stages[0] if self.schedule_mode in SINGLE_STAGE else stages,
                            n_microbatches=self.accumulate_steps, loss_fn=self._micro_batch_loss)
        except ValueError as error:
            raise ConfigError(f"{KEY}.accumulate_steps", self.accumulate_steps, str(error).replace("\n", " ")) from None

    def _example_micro_batch(self, trainer: pl.Trainer) -> torch.Tensor:
        """The first micro-batch of the first training batch: the stages' shapes are static."""
        # Reading ahead must not change the order training then reads the data in.
        with torch.random.fork_rng(devices=[]):
            inputs, _ = _inputs_and_targets(next(iter(trainer.fit_loop._data_source.dataloader())))
        return inputs[: self.micro_batch_size].to(self.root_device)

    def _micro_batch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.lightning_module.loss(outputs, targets)
        self._micro_batch_losses.append(loss.detach().float())
        scaler = getattr(self.precision_plugin, "scaler", None)
        return loss if scaler is None else scaler.scale(loss)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        inputs, targets = self._check_batch(args[0], "training", "drop a smaller last batch")
        scaler: Optional[torch.amp.GradScaler] = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler.scale(torch.zeros((), device=self.root_device))  # creates the scale on every rank: unscale_ needs it
        # Lightning zeroes the gradients after training_step, before backward: the schedule starts
        # from none, and its gradients are kept aside until backward() puts them back.
        parameters = list(self.lightning_module.parameters())
        for parameter in parameters:
            parameter.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._run(self.schedule.step, inputs, targets)
        self._gradients = [parameter.grad for parameter in parameters]
        self.lightning_module.log("train_loss", loss, prog_bar=True, on_step=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The eval-mode stages, forward only; logs `val_loss` in place of the model's validation_step."""
        # DistributedSampler gives each replica ceil(num_val / replicas) samples.
        per_step = self.micro_batch_size * self.accumulate_steps * self.data_parallel_size
        inputs, targets = self._check_batch(args[0], "validation", f"make the validation set a multiple of {per_step} "
                                                                   "samples (e.g. data.num_val)")
        with self.precision_plugin.val_step_context():
            loss = self._run(self.eval_schedule.eval, inputs, targets)
        # Each rank holds its pipeline's loss, so the mean over all ranks is the replicas' mean.
        self.lightning_module.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def _check_batch(self, batch: Any, kind: str, fix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's (inputs, targets), refused unless it holds the micro-batches the stages were built for."""
        inputs, targets = _inputs_and_targets(batch)
        expected = self.micro_batch_size * self.accumulate_steps
        if inputs.size(0) != expected:
            raise ConfigError(KEY, None, f"a {kind} batch of {inputs.size(0)} samples is not accumulate_steps * "
                                         f"micro_batch_size = {self.accumulate_steps} * {self.micro_batch_size} = "
                                         f"{expected}; set data.batch_size={expected} and {fix}")
        return inputs, targets

    def _run(self, run_schedule: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`run_schedule` (a schedule's step or eval) with the inputs on the first stage and the targets
        on the last; the mean micro-batch loss, broadcast from the last stage over the pipeline."""
        pipeline_ranks = self.device_mesh["pp"]
        pipeline_rank = pipeline_ranks.get_local_rank()
        holds_first, holds_last = self.stage_ranks[0] == pipeline_rank, self.stage_ranks[-1] == pipeline_rank
        self._micro_batch_losses.clear()
        run_schedule(*([inputs] if holds_first else []), target=targets if holds_last else None)
        loss = (torch.stack(self._micro_batch_losses).mean() if holds_last
                else torch.zeros((), device=self.root_device))
        dist.broadcast(loss, group=pipeline_ranks.get_group(), group_src=self.stage_ranks[-1])
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule already ran backward, micro-batch by micro-batch, inside training_step.
        for parameter, gradient in zip(self.lightning_module.parameters(), self._gradients, strict=True):
            parameter.grad = gradient
        return closure_loss

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, _local_optimizer(optimizer), options=BY_NAME)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Each rank reads its stages' parameters and optimizer state from the checkpoint directory
        ModelParallelStrategy saved (its own loader expects DTensor parameters); returns the rest."""
        path = Path(self.broadcast(checkpoint_path))
        optimizers = {f"optimizer_{index}": optimizer for index, optimizer in enumerate(self.optimizers)}
        state = {"state_dict": get_model_state_dict(self.model),
                 **{key: self.optimizer_state(optimizer) for key, optimizer in optimizers.items()}}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["state_dict"])
        for key, optimizer in optimizers.items():
            set_optimizer_state_dict(self.model, _local_optimizer(optimizer), optim_state_dict=state[key],
                                     options=BY_NAME)
            if isinstance(optimizer, ZeroRedundancyOptimizer):  # the restored hyper-parameters, back up
                optimizer._sync_param_groups(optimizer.optim.param_groups, optimizer.param_groups)
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def _replicate(stage: Any, group: dist.ProcessGroup) -> None:
    """Wrap the stage's module in DDP over `group`: the stage runs it without gradient sync but
    at its last micro-batch's backward, so gradients are averaged over the replicas once a step."""
    traced = stage.submod
    stage.submod = DistributedDataParallel(traced, process_group=group)
    stage.submod.graph = traced.graph  # which the stage reads for its p2p metadata at the first step


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer over this rank's share of the parameters: with ZeRO, its state by parameter
    name is disjoint from the other replicas', so every rank saves its own into the checkpoint.
    ZeRO copies its hyper-parameters (changed by LR schedulers) into the share only when it
    steps; here they are copied at once."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    optimizer._sync_param_groups(optimizer.param_groups, optimizer.optim.param_groups)
    return optimizer.optim


def _inputs_and_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        raise ConfigError("data", type(batch).__name__, "strategy pipeline needs (inputs, targets) batches")
    return batch[0], batch[1]


def _trace(model: nn.Module, example: torch.Tensor, split_points: list[str]) -> Any:
    """torch's `pipeline()` on `model`, each stage beginning at one of `split_points`."""
    # pipeline() marks the split modules by replacing their forward; each is put back after.
    forwards = {name: model.get_submodule(name).__dict__.get("forward") for name in split_points}
    try:
        return pipeline(model, mb_args=(example,), split_spec=dict.fromkeys(split_points, SplitPoint.BEGINNING))
    except RuntimeError as error:
        cause = str(error.__cause__ or error).strip().splitlines()[0]
        raise ConfigError("model", type(model).__name__, f"cannot be traced into pipeline stages: {cause}") from None
    finally:
        for name, forward in forwards.items():
            module = model.get_submodule(name)
            module.__dict__.pop("_orig_forward", None)
            module.__dict__.pop("forward", None)
            if forward is not None:
                module.forward = forward


@contextlib.contextmanager
def _in_eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode, each module's own mode restored after."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)


def _take_off_checkpoint_wrappers(model: nn.Module) -> dict[str, CheckpointWrapper]:
    """Replace each recompute wrapper by the module it wraps; returns the wrappers by name."""
    wrappers = {name: module for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)}
    for name, wrapper in wrappers.items():
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, wrapper._checkpoint_wrapped_module)
    return wrappers


def _put_on_checkpoint_wrappers(model: nn.Module, wrappers: dict[str, CheckpointWrapper]) -> None:
    """Wrap the modules of `model` named like `wrappers` (the model, or a traced stage holding
    some of them) as they were wrapped, so they recompute the same way."""
    for name, wrapper in wrappers.items():
        parent, _, child = name.rpartition(".")
        try:
            module = model.get_submodule(name)
        except AttributeError:  # in another stage
            continue
        if module is not wrapper._checkpoint_wrapped_module:
            wrapper = CheckpointWrapper(module, wrapper.checkpoint_impl, checkpoint_fn=wrapper.checkpoint_fn)
        model.get_submodule(parent).register_module(child, wrapper)


def _keep_only_stages(model: nn.Module, stage_modules: list[nn.Module]) -> None:
    """Drop from `model` the parameters and buffers this rank's stages do not hold (other ranks
    hold them), after refusing parameters the tracer copied because several stages use them."""
    own = {id(p) for p in model.parameters()}
    copied = sorted({name for stage in stage_modules for name, p in stage.named_parameters() if id(p) not in own})
    if copied:
        raise ConfigError(f"{KEY}.split_points", None, f"parameters {', '.join(copied)} are used by more than one "
                                                       "stage (tied weights), which pipeline stages cannot share")
    kept = {id(t) for stage in stage_modules for t in itertools.chain(stage.parameters(), stage.buffers())}
    for module in model.modules():
        for registry in (module._parameters, module._buffers):
            for name in [name for name, t in registry.items() if t is not None and id(t) not in kept]:
                del registry[name]
