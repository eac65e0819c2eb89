"""sharding: ZeRO stages 1-3, hybrid and tensor-parallel degrees (Fleet `strategy.sharding`); carried
out by plugins/sharding.py and plugins/tensor_parallel.py. This module owns what `stage` means."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional

from runner.core.contribution import Component, Contribution, Facts, Memory, RunShape, Strategy
from runner.core.errors import require
from runner.core.world import Layout, layout

KEY = "strategy.sharding."


@dataclass
class ShardingConfig(Strategy):
    """ZeRO sharding (Fleet: `strategy.sharding`, `sharding_configs`; Rajbhandari et al. 2020):
    each of `degree` ranks keeps 1/degree of the optimizer states (stage 1), also of the
    gradients (stage 2), and also of the parameters (stage 3). Stage 1 is DDP with torch's
    ZeroRedundancyOptimizer; stages 2 and 3 are FSDP2 (`fully_shard`) on a device mesh.
    dp_degree x degree x mp_degree x pp_degree must equal the number of processes."""

    name: ClassVar[str] = "sharding"

    stage: int = 1
    """1: optimizer states sharded; 2: + gradients (parameters gathered once per step and kept
    until backward ends); 3: + parameters (gathered unit by unit in forward and in backward)."""
    degree: Optional[int] = None
    """Ranks in one sharding group (None: every rank left after dp_degree, mp_degree, pp_degree)."""
    dp_degree: int = 1
    """Replica groups on top of the sharding groups (hybrid sharding on a 2-D device mesh:
    gradients reduced within a group, then averaged across the dp_degree replicas)."""
    mp_degree: int = 1
    """Tensor-parallel degree (stages 2 and 3): the model's `tensor_parallel_plan()` splits its
    layers over this many ranks (the built-in GPT has one)."""
    pp_degree: int = 1
    """Processes of one pipeline, with strategy pipeline (>= 2; stage 1 only: the optimizer
    states of each stage are sharded over the `degree` pipeline replicas). 1 without pipeline."""
    optimize_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer states in host memory; the device
    holds only what computes (FSDP2 CPUOffloadPolicy; stages 2 and 3)."""
    gradient_merge_acc_step: int = 1
    """Micro-batches accumulated per optimizer step; gradients are reduced on the last one only
    (sets trainer.accumulate_grad_batches)."""
    segment_broadcast_MB: float = 32.0
    """Size of a sharded unit (stages 2 and 3): consecutive modules are grouped until about this
    many MB of parameters, which are gathered together."""

    def __post_init__(self) -> None:
        require(self.stage in (1, 2, 3), KEY + "stage", self.stage, "allowed: 1, 2, 3")
        require(self.degree is None or self.degree >= 1, KEY + "degree", self.degree, "must be >= 1 (or null: auto)")
        for name in ("dp_degree", "mp_degree", "pp_degree", "gradient_merge_acc_step"):
            require(getattr(self, name) >= 1, KEY + name, getattr(self, name), "must be >= 1")
        require(self.mp_degree == 1 or self.stage >= 2, KEY + "mp_degree", self.mp_degree,
                "tensor parallelism needs stage 2 or 3 (FSDP2 on a device mesh); stage 1 is DDP")
        require(not self.optimize_offload or self.stage >= 2, KEY + "optimize_offload", self.optimize_offload,
                "offload needs stage 2 or 3 (FSDP2 CPUOffloadPolicy)")
        require(self.segment_broadcast_MB > 0, KEY + "segment_broadcast_MB", self.segment_broadcast_MB, "must be > 0")

    def applies(self, facts: Facts) -> Optional[str]:
        return None if facts.world_size >= 2 else "one process: nothing to shard over"

    def memory(self, memory: Memory, facts: Facts) -> Memory:
        """ZeRO's per-process bytes: each stage divides one more kind by the degree. FSDP2 (stages
        2 and 3) also holds gathered copies: stage 2 the whole model's parameters (in the compute
        dtype) from forward to the end of backward, stage 3 those of the units computing (up to
        the whole model when it is one unit); and the unsharded gradients of the unit being
        reduced, in place of its shard."""
        degree = self.degree or facts.world_size
        shards = {"optimizer_states": memory.optimizer_states / degree}
        if self.stage >= 2:
            unit = min(memory.parameters, self.segment_broadcast_MB * 2**20)  # float32 bytes
            in_compute_dtype = unit * memory.compute_bytes / 4
            shards["gradients"] = (memory.gradients - unit) / degree + in_compute_dtype
            gathered = in_compute_dtype if self.stage == 3 else memory.parameters * memory.compute_bytes / 4
            shards["parameters"] = memory.parameters / degree + gathered
        return replace(memory, **shards, parameters_gathered=self.stage >= 2)

    def speed(self, facts: Facts) -> float:
        return {1: 0.97, 2: 0.93, 3: 0.88}[self.stage]  # more gathers and scatters at each stage

    def variants(self, facts: Facts) -> List[Dict[str, Any]]:
        return [{"stage": stage} for stage in (1, 2, 3)]

    def layout(self, run: RunShape) -> Layout:
        """The processes' layout these degrees make; with strategy pipeline, `degree` replicas of
        a `pp_degree`-process pipeline, whose optimizer states are sharded over the replicas."""
        world_size = run.world.known_size("sharding")
        if "pipeline" in run.selected:
            require(self.stage == 1, KEY + "stage", self.stage,
                    "with pipeline only stage 1: pipeline stages keep their parameters whole, and stages 2 and 3 "
                    "would gather them again for every micro-batch")
            require(self.pp_degree >= 2, KEY + "pp_degree", self.pp_degree,
                    "with pipeline: the processes of one pipeline (>= 2)")
            require(self.dp_degree == 1, KEY + "dp_degree", self.dp_degree,
                    "with pipeline, degree spans all pipeline replicas; replica groups over them are not supported")
            require(self.gradient_merge_acc_step == 1, KEY + "gradient_merge_acc_step", self.gradient_merge_acc_step,
                    "with pipeline, strategy.pipeline.accumulate_steps sets the micro-batches per step")
        else:
            require(self.pp_degree == 1, KEY + "pp_degree", self.pp_degree, "> 1 needs strategy pipeline too")
        return layout(world_size, dp_replicate=self.dp_degree, dp_shard=self.degree, pp=self.pp_degree,
                      tp=self.mp_degree, num_nodes=run.world.num_nodes)

    def contribute(self, run: RunShape) -> Contribution:
        processes = run.layout
        if "pipeline" in run.selected:  # the pipeline's Lightning strategy shards over the layout's replicas
            return Contribution(notes=[
                f"sharding stage 1 with pipeline: {processes.dp_shard} pipeline replica(s) of {processes.pp} "
                f"processes, each stage's optimizer states sharded over its replicas (carried out by the "
                f"pipeline strategy)"])
        mesh = {"layout": processes.to_dict()}
        if self.stage == 1:
            contribution = Contribution(lightning_strategy=Component("plugins.sharding:build_zero_stage1", mesh))
        else:
            shard = Component("plugins.sharding:shard_parameters",
                              {"reshard_after_forward": self.stage == 3, "segment_broadcast_MB": self.segment_broadcast_MB,
                               "optimize_offload": self.optimize_offload})
            contribution = Contribution(lightning_strategy=Component("plugins.sharding:build_fsdp", mesh),
                                        model_transforms=[("sharding", shard)])
            if processes.tp > 1:
                contribution.model_transforms.insert(
                    0, ("tensor_parallel", Component("plugins.tensor_parallel:parallelize", {})))
        if self.gradient_merge_acc_step > 1:
            contribution.trainer_args["accumulate_grad_batches"] = self.gradient_merge_acc_step
        return contribution
