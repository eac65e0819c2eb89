"""pipeline: the model cut into stages over processes (Fleet `strategy.pipeline`); carried out by
plugins/pipeline.py."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, List, Optional

from runner.core.contribution import Component, Contribution, Facts, Memory, RunShape, Strategy
from runner.core.errors import require
from runner.core.world import Layout, devices_for

KEY = "strategy.pipeline."
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble")
# Refused in the command (PipelineConfig.check_backend) and, for a strategy built by hand, in the rank.
ZBV_ON_GLOO = ("fails on the gloo backend (CPU) in torch 2.13 and 2.14: its first p2p exchange finds a gloo pair not "
               "connected; use it on CUDA (nccl) or choose 1F1B, GPipe or Interleaved1F1B")
NO_CLIPPING = "is not supported with strategy pipeline: each rank would clip its stages by their own norm"
# Stages each process holds, by schedule: interleaved schedules loop over several.
STAGES_PER_PROCESS = {"1F1B": (1, 1), "GPipe": (1, 1), "Interleaved1F1B": (2, None), "ZBVZeroBubble": (2, 2)}  # (min, max)


@dataclass
class PipelineConfig(Strategy):
    """Pipeline parallelism (Fleet: `paddle.distributed.Strategy().pipeline`): the model is cut
    into stages held by different processes, and each batch flows through them in
    micro-batches on a torch.distributed.pipelining schedule. The last stage computes the loss
    with the model's `loss(outputs, targets)`; the model's `training_step` and `validation_step`
    are not called (train_loss and val_loss are logged)."""

    name: ClassVar[str] = "pipeline"

    schedule_mode: str = "1F1B"
    """1F1B (one forward one backward: at most `stages` micro-batches of activations alive),
    GPipe (all forwards, then all backwards), Interleaved1F1B (vpp_degree stages per process,
    smaller bubble) or ZBVZeroBubble (2 stages per process in a V, weight gradients deferred to
    fill the bubble)."""
    micro_batch_size: Optional[int] = None
    """Samples per micro-batch (None: the data's batch_size / accumulate_steps)."""
    accumulate_steps: int = 4
    """Micro-batches per optimizer step (Fleet's default is 1, which leaves nothing to overlap);
    micro_batch_size x accumulate_steps must equal the data's batch_size."""
    split_points: List[str] = field(default_factory=list)
    """Qualified module names where a new stage begins (like Fleet's device_guard). Empty: the
    model's repeated block list is cut into stages of about equal parameter count."""
    vpp_degree: int = 1
    """Stages per process: 1 for 1F1B and GPipe, >= 2 for Interleaved1F1B, 2 for ZBVZeroBubble."""

    def __post_init__(self) -> None:
        require(self.schedule_mode in SCHEDULES, KEY + "schedule_mode", self.schedule_mode,
                f"allowed: {', '.join(SCHEDULES)}", SCHEDULES)
        require(self.micro_batch_size is None or self.micro_batch_size >= 1, KEY + "micro_batch_size",
                self.micro_batch_size, "must be >= 1 (or null: batch_size / accumulate_steps)")
        require(self.accumulate_steps >= 1, KEY + "accumulate_steps", self.accumulate_steps, "must be >= 1")
        low, high = STAGES_PER_PROCESS[self.schedule_mode]
        require(low <= self.vpp_degree and (high is None or self.vpp_degree <= high), KEY + "vpp_degree",
                self.vpp_degree, f"schedule_mode={self.schedule_mode} needs {low if low == high else f'>= {low}'}")

    def applies(self, facts: Facts) -> Optional[str]:
        if facts.world_size < 2:
            return "one process: nothing to split the model over"
        if facts.blocks < facts.world_size or not facts.has_loss:
            return f"the model needs a repeated block list of >= {facts.world_size} blocks and a loss(outputs, targets)"
        if (facts.batch_size or 0) % max(self.accumulate_steps, facts.world_size):
            return f"data.batch_size={facts.batch_size} does not split into {self.accumulate_steps} micro-batches"
        return None

    def memory(self, memory: Memory, facts: Facts) -> Memory:
        """Each process holds its stage (1/world of the model); 1F1B keeps at most `world`
        micro-batches of activations alive, GPipe all of them."""
        stages = facts.world_size
        alive = min(stages, self.accumulate_steps) if self.schedule_mode == "1F1B" else self.accumulate_steps
        return replace(memory, parameters=memory.parameters / stages, gradients=memory.gradients / stages,
                       optimizer_states=memory.optimizer_states / stages, stage_share=memory.stage_share / stages,
                       micro_batch_fraction=memory.micro_batch_fraction / self.accumulate_steps,
                       micro_batches_alive=alive)

    def speed(self, facts: Facts) -> float:
        # The bubble: (stages - 1) of (micro-batches + stages - 1) slots idle, on each of `stages`
        # processes that hold 1/stages of the work: relative to data parallelism over the same processes.
        return self.accumulate_steps / (self.accumulate_steps + facts.world_size - 1)

    def micro_batch(self, batch_size: Optional[int]) -> int:
        """micro_batch_size, resolved from the data's batch size and checked against it."""
        if batch_size is None:
            require(self.micro_batch_size is not None, KEY + "micro_batch_size", None,
                    "required: the data config has no batch_size to derive it from")
            return self.micro_batch_size
        if self.micro_batch_size is None:
            require(batch_size % self.accumulate_steps == 0, KEY + "accumulate_steps", self.accumulate_steps,
                    f"must divide data.batch_size={batch_size} into equal micro-batches")
            return batch_size // self.accumulate_steps
        product = self.micro_batch_size * self.accumulate_steps
        require(product == batch_size, KEY + "micro_batch_size", self.micro_batch_size,
                f"micro_batch_size x accumulate_steps = {self.micro_batch_size} x {self.accumulate_steps} = "
                f"{product}, but data.batch_size={batch_size}")
        return self.micro_batch_size

    def check_micro_batches(self, processes: int) -> None:
        """The micro-batch counts torch's schedules can order for a pipeline of this many processes."""
        stages = processes * self.vpp_degree
        needed = {"1F1B": processes, "ZBVZeroBubble": stages}.get(self.schedule_mode, 1)
        require(self.accumulate_steps >= needed, KEY + "accumulate_steps", self.accumulate_steps,
                f"schedule_mode={self.schedule_mode} needs >= {needed} micro-batches for {stages} stages "
                f"on {processes} processes")
        rounds = max(1, self.accumulate_steps // processes)
        require(self.schedule_mode != "Interleaved1F1B" or self.accumulate_steps % rounds == 0,
                KEY + "accumulate_steps", self.accumulate_steps,
                f"Interleaved1F1B runs rounds of {processes} micro-batches: use a multiple of {processes} "
                f"or fewer than {2 * processes}")

    def check_backend(self, run: RunShape) -> None:
        """What torch's pipelining cannot run on this machine or with these trainer arguments."""
        require(self.schedule_mode != "ZBVZeroBubble" or run.device_type == "cuda", KEY + "schedule_mode",
                self.schedule_mode, ZBV_ON_GLOO)
        clip = getattr(run.trainer, "gradient_clip_val", None)
        require(not clip, "trainer.gradient_clip_val", clip, NO_CLIPPING)

    def contribute(self, run: RunShape) -> Contribution:
        # Alone, the pipeline spans every process; sharding may arrange replicas of it.
        processes = run.layout or Layout(pp=run.world.known_size("pipeline"))
        require(processes.pp >= 2, "trainer.devices", processes.pp,
                f"pipeline needs >= 2 processes (one per stage): set {devices_for(2, run.world.num_nodes)}")
        self.check_micro_batches(processes.pp)
        self.check_backend(run)
        micro_batch_size = self.micro_batch(run.batch_size)
        kwargs = {"schedule_mode": self.schedule_mode, "micro_batch_size": micro_batch_size,
                  "accumulate_steps": self.accumulate_steps, "vpp_degree": self.vpp_degree,
                  "layout": processes.to_dict(), "shard_optimizer_states": processes.dp_shard > 1}
        samples = micro_batch_size * self.accumulate_steps
        return Contribution(
            lightning_strategy=Component("plugins.pipeline:build_pipeline", kwargs),
            model_transforms=[("pipeline", Component("plugins.pipeline:split_stages",
                                                     {"split_points": list(self.split_points),
                                                      "num_stages": processes.pp * self.vpp_degree}))],
            # accumulate_steps micro-batches already make one optimizer step.
            trainer_args={"accumulate_grad_batches": 1},
            notes=["pipeline: the model's training_step and validation_step are bypassed; each rank builds the "
                   "whole model, keeps its stages, and logs the loss of the last stage as train_loss, and its "
                   "eval-mode loss as val_loss (no other validation metric)",
                   f"pipeline: every training and validation batch must hold micro_batch_size x accumulate_steps "
                   f"= {samples} samples (drop a smaller last training batch; the validation set must divide into "
                   f"them); checkpoints are directories holding each stage's part"])
