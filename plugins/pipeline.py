"""Pipeline parallelism (Fleet `strategy.pipeline`) on `torch.distributed.pipelining` schedules.

`split_stages`, the plan's pipeline phase, traces the model into stages (plugins/pipeline_split.py)
and keeps this rank's; `PipelineStrategy` runs a schedule over them each step, replicated over
the layout's dp_shard replicas (DDP around each stage, optionally ZeRO-1 optimizer states), and
checkpoints each rank's part (plugins/pipeline_checkpoint.py). The model's training_step and
validation_step are bypassed: the last stage's `loss(outputs, targets)` is logged as train_loss
and val_loss. How it works, in detail: docs/strategies.md#pipeline.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies.strategy import _optimizers_to_device
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)
from typing_extensions import override

from plugins import pipeline_checkpoint, traffic
from plugins.ddp import process_group_timeout
from plugins.directory_checkpoint import WholeCheckpointStrategy
from plugins.pipeline_split import in_eval_mode, keep_only_stages, stage_ranks, stage_split_points, traced_stages
from plugins.rehearsal import data_parallel, real_tensors
from plugins.sharding import layout_mesh, shard_strategy_optimizers
from plugins.transforms import ModelContext
from runner.core.errors import ConfigError
from runner.strategies.pipeline import NO_CLIPPING, ZBV_ON_GLOO
from runner.core.world import Layout

KEY = "strategy.pipeline"
SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZBVZeroBubble": ScheduleZBVZeroBubble}
SINGLE_STAGE = ("1F1B", "GPipe")  # schedules placing one stage per rank; the others take a rank's list


def build_pipeline(schedule_mode: str, micro_batch_size: int, accumulate_steps: int, vpp_degree: int,
                   layout: Dict[str, int], shard_optimizer_states: bool,
                   timeout_s: Optional[float] = None) -> "PipelineStrategy":
    return PipelineStrategy(schedule_mode, micro_batch_size, accumulate_steps, vpp_degree, Layout(**layout),
                            shard_optimizer_states, **process_group_timeout(timeout_s))


def split_stages(module: nn.Module, context: ModelContext, split_points: list[str], num_stages: int) -> list[str]:
    """The plan's pipeline phase: trace `module` into stages where `split_points` begin (balanced
    over its repeated blocks when empty) and keep this rank's; later transforms change those
    stages. Returns the names where stages begin. `num_stages`, the plan's count, serves the
    command's check of the model alone; a rank counts its stages from its process group."""
    strategy = context.strategy
    if strategy is None:  # the model alone, checked in the command (runner/rank/build.py): no stage is built
        stage_split_points(module, split_points, num_stages)
        require_loss(module)
        return []
    if not isinstance(strategy, PipelineStrategy):
        raise ConfigError(KEY, None, f"the pipeline split needs the pipeline's Lightning strategy, not "
                                     f"{type(strategy).__name__}")
    names = strategy.split(module, split_points)
    context.parts = [stage.submod for stage in strategy.stages]  # forward only, the eval stages stay as traced
    return names


def require_loss(model: nn.Module) -> None:
    if not callable(getattr(model, "loss", None)):
        raise ConfigError("model", type(model).__name__,
                          "has no loss(outputs, targets) method, which the last pipeline stage calls per micro-batch")


class PipelineStrategy(WholeCheckpointStrategy):
    """One pipeline rank per process running `schedule_mode` over `accumulate_steps` micro-batches
    of `micro_batch_size` samples per optimizer step, `vpp_degree` stages per rank, on `layout`'s
    pp groups; the dp_shard replicas read different batches, and with `shard_optimizer_states`
    (ZeRO stage 1) each replica's optimizer steps only its share of the parameters.

    ModelParallelStrategy brings the process group, the launcher and the distributed checkpoint
    (written whole: plugins/directory_checkpoint.py).
    """

    def __init__(self, schedule_mode: str, micro_batch_size: int, accumulate_steps: int, vpp_degree: int,
                 layout: Layout, shard_optimizer_states: bool, **kwargs: Any) -> None:
        super().__init__(data_parallel_size=layout.dp_shard, **kwargs)
        self.schedule_mode = schedule_mode
        self.micro_batch_size = micro_batch_size
        self.accumulate_steps = accumulate_steps
        self.vpp_degree = vpp_degree
        self.layout = layout
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
        # The base class's process group, with the layout's mesh instead of its own.
        self._setup_distributed()
        self._device_mesh = layout_mesh(self.root_device.type, self.layout, ("dp_shard", "pp"))
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of one pipeline read the same batches, the replicas different ones.
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.layout.data_parallel_rank(self.global_rank)}

    def split(self, model: nn.Module, split_points: list[str]) -> list[str]:
        """Trace `model` (on its device) into this rank's training stages and, in eval mode, its
        validation stages sharing their parameters; drop the parameters other ranks hold."""
        trainer = model.trainer
        self._refuse_unsupported(trainer)
        pipeline_ranks = self.device_mesh["pp"]
        self.stage_ranks = stage_ranks(pipeline_ranks.size(), self.vpp_degree, self.schedule_mode)
        split_points = stage_split_points(model, split_points, len(self.stage_ranks))
        example = self._example_micro_batch(trainer)
        where = dict(stage_ranks=self.stage_ranks, rank=pipeline_ranks.get_local_rank(), device=self.root_device,
                     group=pipeline_ranks.get_group())
        # Under autocast, as in training: the stages' p2p buffers take the traced dtypes.
        with self.precision_plugin.train_step_context():
            self.stages = traced_stages(model, example, split_points, **where)
        with self.precision_plugin.val_step_context(), in_eval_mode(model):
            self.eval_stages = traced_stages(model, example, split_points, **where)
        keep_only_stages(model, [stage.submod for stage in (*self.stages, *self.eval_stages)])
        return split_points

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if not self.stages:
            raise ConfigError(KEY, None, "no stages were built: the model's configure_model must apply "
                                         "plugins.pipeline:split_stages (plugins.transforms)")
        self.model = self.precision_plugin.convert_module(self.model)
        if self.layout.dp_shard > 1:
            for stage in self.stages:
                _replicate(stage, self.device_mesh["dp_shard"].get_group())
        for stage in self.stages:
            traffic.count_stage_p2p(stage)
        self.schedule = self._schedule_over(self.stages)
        self.eval_schedule = self._schedule_over(self.eval_stages)
        self.setup_optimizers(trainer)
        if self.shard_optimizer_states:
            shard_strategy_optimizers(self, self.device_mesh["dp_shard"].get_group())
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)

    def _refuse_unsupported(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            raise ConfigError(KEY, None, f"pipeline stages are built by trainer.fit only (which validates too), "
                                         f"not trainer.{trainer.state.fn}")
        require_loss(self.lightning_module)
        if self.schedule_mode == "ZBVZeroBubble" and dist.get_backend() == "gloo":
            raise ConfigError(f"{KEY}.schedule_mode", self.schedule_mode, ZBV_ON_GLOO)
        if trainer.gradient_clip_val:
            raise ConfigError("trainer.gradient_clip_val", trainer.gradient_clip_val, NO_CLIPPING)

    def _schedule_over(self, stages: list[Any]) -> Any:
        schedule = SCHEDULES[self.schedule_mode]
        try:
            return schedule(stages[0] if self.schedule_mode in SINGLE_STAGE else stages,
                            n_microbatches=self.accumulate_steps, loss_fn=self._micro_batch_loss)
        except ValueError as error:
            raise ConfigError(f"{KEY}.accumulate_steps", self.accumulate_steps, str(error).replace("\n", " ")) from None

    def _example_micro_batch(self, trainer: pl.Trainer) -> torch.Tensor:
        """The first micro-batch of the first training batch: the stages' shapes are static."""
        # Reading ahead must not change the order training then reads the data in; the loader's
        # tensors are real ones in a rehearsal too (its sampler draws a seed).
        with torch.random.fork_rng(devices=[]), real_tensors():
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
        self.lightning_module.log("train_loss", loss, on_step=True)  # not prog_bar: runner/models/__init__.py says why
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The eval-mode stages, forward only; logs `val_loss` in place of the model's validation_step."""
        # DistributedSampler gives each replica ceil(num_val / replicas) samples.
        per_step = self.micro_batch_size * self.accumulate_steps * self.layout.dp_shard
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
        traffic.count("broadcast", loss, pipeline_ranks.get_group())
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
        return pipeline_checkpoint.optimizer_state(self.model, optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # ModelParallelStrategy's own loader expects DTensor parameters.
        return pipeline_checkpoint.load_stages(self.model, self.optimizers, Path(self.broadcast(checkpoint_path)),
                                               weights_only)


def _replicate(stage: Any, group: dist.ProcessGroup) -> None:
    """Wrap the stage's module in DDP over `group`: the stage runs it without gradient sync but
    at its last micro-batch's backward, so gradients are averaged over the replicas once a step."""
    traced = stage.submod
    stage.submod = data_parallel(traced, process_group=group)
    if traffic.counting():
        stage.submod.register_comm_hook(group, traffic.counted_allreduce_hook)
    stage.submod.graph = traced.graph  # which the stage reads for its p2p metadata at the first step


def _inputs_and_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        raise ConfigError("data", type(batch).__name__, "strategy pipeline needs (inputs, targets) batches")
    return batch[0], batch[1]
