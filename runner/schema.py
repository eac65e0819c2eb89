"""Structured schema of a lightfleet run: every knob, its type, default and meaning.

Plain dataclasses (no torch, no lightning): Hydra composes the YAML in conf/, and
`runner.config.validate` merges it onto these classes, so a typo, a wrong type or an
out-of-range value is refused before anything heavy is imported. Each field is documented
by the string right under it (the source of docs/knobs.md).

A strategy is one dataclass here: Fleet's knob names and defaults, range checks in
`__post_init__`, and `contribute(run)`, which says — as plain data — what the strategy adds to
the plan (see runner/plan.py for the slots).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from runner.errors import ConfigError
from runner.plan import Component, Contribution, RunShape


def require(ok: bool, key: str, value: Any, allowed: str, choices: tuple = ()) -> None:
    if not ok:
        raise ConfigError(key, value, allowed, choices)


# --------------------------------------------------------------------------- strategies


@dataclass
class AmpConfig:
    """Automatic mixed precision (Fleet: `strategy.amp`, `strategy.amp_configs`)."""

    name: ClassVar[str] = "amp"

    dtype: str = "float16"
    """Low-precision type: float16 (with loss scaling) or bfloat16 (no loss scaling needed)."""
    init_loss_scaling: float = 32768.0
    """Initial loss scale (float16 only)."""
    use_dynamic_loss_scaling: bool = True
    """Adapt the scale to overflows (true) or keep init_loss_scaling fixed (false)."""
    incr_every_n_steps: int = 1000
    """Grow the scale after this many consecutive steps without overflow."""
    decr_every_n_nan_or_inf: int = 2
    """Shrink the scale after this many consecutive overflow steps (each one is skipped)."""
    incr_ratio: float = 2.0
    """Factor by which the scale grows (> 1)."""
    decr_ratio: float = 0.5
    """Factor by which the scale shrinks (0 < decr_ratio < 1)."""
    custom_white_list: List[str] = field(default_factory=list)
    """Module class names or module names (globs allowed) forced to run in `dtype`."""
    custom_black_list: List[str] = field(default_factory=list)
    """Module class names or module names (globs allowed) kept in float32."""

    def __post_init__(self) -> None:
        key = "strategy.amp."
        require(self.dtype in ("float16", "bfloat16"), key + "dtype", self.dtype,
                "allowed: float16, bfloat16", ("float16", "bfloat16"))
        require(self.init_loss_scaling > 0, key + "init_loss_scaling", self.init_loss_scaling, "must be > 0")
        require(self.incr_every_n_steps >= 1, key + "incr_every_n_steps", self.incr_every_n_steps, "must be >= 1")
        require(self.decr_every_n_nan_or_inf >= 1, key + "decr_every_n_nan_or_inf",
                self.decr_every_n_nan_or_inf, "must be >= 1")
        require(self.incr_ratio > 1, key + "incr_ratio", self.incr_ratio, "must be > 1")
        require(0 < self.decr_ratio < 1, key + "decr_ratio", self.decr_ratio, "must be in (0, 1)")
        both = set(self.custom_white_list) & set(self.custom_black_list)
        require(not both, key + "custom_white_list", sorted(both), "names also in custom_black_list")

    def contribute(self, run: RunShape) -> Contribution:
        knobs = asdict(self)
        lists = {k: knobs.pop(k) for k in ("custom_white_list", "custom_black_list")}
        contribution = Contribution(precision=Component("plugins.amp:build_precision", knobs))
        if lists["custom_white_list"] or lists["custom_black_list"]:
            contribution.model_transforms.append(
                ("precision", Component("plugins.amp:apply_precision_lists", {"dtype": self.dtype, **lists})))
        if self.dtype == "bfloat16":
            contribution.notes.append("dtype=bfloat16: loss scaling knobs have no effect (bfloat16 needs none)")
        return contribution


@dataclass
class RecomputeConfig:
    """Activation recomputation (Fleet: `strategy.recompute`, `strategy.recompute_configs`)."""

    name: ClassVar[str] = "recompute"

    checkpoints: List[str] = field(default_factory=list)
    """Modules whose activations are recomputed in backward: qualified module names, globs
    (`blocks.*`) or class names. Empty = each block of the model's first repeated block list."""
    enable_offload: bool = False
    """Keep the tensors saved at each checkpoint in host memory (torch `save_on_cpu`)."""
    checkpoint_shape: List[int] = field(default_factory=list)
    """Accepted for Fleet compatibility; PyTorch checkpointing needs no static shapes."""

    def contribute(self, run: RunShape) -> Contribution:
        contribution = Contribution()
        contribution.model_transforms.append(
            ("recompute", Component("plugins.recompute:apply_recompute",
                                    {"checkpoints": list(self.checkpoints), "enable_offload": self.enable_offload})))
        if not self.checkpoints:
            contribution.notes.append(
                "recompute.checkpoints=[]: every block of the model's first repeated block list "
                "(ModuleList/Sequential of same-class modules); the run's build.yaml lists them")
        if self.checkpoint_shape:
            contribution.notes.append(
                "recompute.checkpoint_shape has no effect: PyTorch recomputes with the shapes seen in forward")
        return contribution


@dataclass
class GradientMergeConfig:
    """Gradient accumulation (Fleet: `strategy.gradient_merge`, `strategy.gradient_merge_configs`)."""

    name: ClassVar[str] = "gradient_merge"

    k_steps: int = 1
    """Micro-steps per optimizer update (Lightning `accumulate_grad_batches`)."""
    avg: bool = True
    """Average the k micro-step gradients (true) or sum them (false)."""

    def __post_init__(self) -> None:
        require(self.k_steps >= 1, "strategy.gradient_merge.k_steps", self.k_steps, "must be >= 1")

    def contribute(self, run: RunShape) -> Contribution:
        contribution = Contribution(trainer_args={"accumulate_grad_batches": self.k_steps})
        if not self.avg:
            contribution.callbacks.append(Component("plugins.gradient_merge:GradientSum", {"k_steps": self.k_steps}))
        if self.k_steps == 1:
            contribution.notes.append("gradient_merge.k_steps=1: every micro-step updates (no merging)")
        return contribution


@dataclass
class LarsConfig:
    """Layer-wise adaptive rate scaling (Fleet: `strategy.lars`, `lars_configs`; You et al. 2017).
    Replaces the model's momentum-SGD optimizer, keeping its learning rate, momentum and
    schedulers: local_lr = lr * lars_coeff * ||w|| / (||g|| + lars_weight_decay * ||w|| + epsilon)."""

    name: ClassVar[str] = "lars"

    lars_coeff: float = 0.001
    """Trust coefficient: how far one step may move a tensor relative to its norm."""
    lars_weight_decay: float = 0.0005
    """Weight decay inside the LARS update (replaces the base optimizer's)."""
    epsilon: float = 0.0
    """Added to the denominator of the local learning rate."""
    exclude_from_weight_decay: List[str] = field(default_factory=list)
    """Parameter-name substrings (e.g. bn, bias) whose tensors get no weight decay."""

    def __post_init__(self) -> None:
        require(self.lars_coeff > 0, "strategy.lars.lars_coeff", self.lars_coeff, "must be > 0")
        require(self.lars_weight_decay >= 0, "strategy.lars.lars_weight_decay", self.lars_weight_decay, "must be >= 0")
        require(self.epsilon >= 0, "strategy.lars.epsilon", self.epsilon, "must be >= 0")

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(optimizer=Component("plugins.lars:replace_optimizer", asdict(self)))


@dataclass
class LambConfig:
    """Layer-wise adaptive moments (Fleet: `strategy.lamb`, `lamb_configs`; You et al. 2019).
    Replaces the model's Adam/AdamW optimizer, keeping its learning rate, betas, epsilon and
    schedulers: Adam's update scaled per tensor by the trust ratio ||w|| / ||update||."""

    name: ClassVar[str] = "lamb"

    lamb_weight_decay: float = 0.01
    """Decoupled weight decay inside the LAMB update."""
    exclude_from_weight_decay: List[str] = field(default_factory=list)
    """Parameter-name substrings (e.g. bn, bias, norm) whose tensors get no weight decay."""

    def __post_init__(self) -> None:
        require(self.lamb_weight_decay >= 0, "strategy.lamb.lamb_weight_decay", self.lamb_weight_decay, "must be >= 0")

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(optimizer=Component("plugins.lamb:replace_optimizer", asdict(self)))


@dataclass
class LocalSGDConfig:
    """Local SGD (Fleet: `strategy.localsgd`, `localsgd_configs`; Lin et al. 2018): gradients are
    averaged every step until begin_step, then each process steps alone and the parameters are
    averaged every k_steps (torch post-local-SGD hook + periodic model averager)."""

    name: ClassVar[str] = "localsgd"

    k_steps: int = 1
    """Local steps between two parameter averagings."""
    begin_step: int = 1
    """Step from which local SGD starts (synchronous data parallelism before)."""

    def __post_init__(self) -> None:
        require(self.k_steps >= 1, "strategy.localsgd.k_steps", self.k_steps, "must be >= 1")
        require(self.begin_step >= 1, "strategy.localsgd.begin_step", self.begin_step, "must be >= 1")

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(
            comm_hook=Component("plugins.localsgd:build_hook", {"begin_step": self.begin_step}),
            callbacks=[Component("plugins.localsgd:ModelAveraging", asdict(self))])


@dataclass
class AdaptiveLocalSGDConfig:
    """Adaptive local SGD (Fleet: `strategy.adaptive_localsgd`; Wang & Joshi 2018): local SGD
    whose averaging period follows the loss, k = ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps))
    clipped to [1, 16]; the current k is logged as `localsgd_k`."""

    name: ClassVar[str] = "adaptive_localsgd"

    init_k_steps: int = 1
    """Averaging period at begin_step, the reference the adapted period scales."""
    begin_step: int = 1
    """Step from which local SGD starts (synchronous data parallelism before)."""

    def __post_init__(self) -> None:
        require(self.init_k_steps >= 1, "strategy.adaptive_localsgd.init_k_steps", self.init_k_steps, "must be >= 1")
        require(self.begin_step >= 1, "strategy.adaptive_localsgd.begin_step", self.begin_step, "must be >= 1")

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(
            comm_hook=Component("plugins.localsgd:build_hook", {"begin_step": self.begin_step}),
            callbacks=[Component("plugins.adaptive_localsgd:AdaptiveModelAveraging", asdict(self))])


@dataclass
class DGCConfig:
    """Deep gradient compression (Fleet: `strategy.dgc`, `dgc_configs`; Lin et al. 2017): only the
    largest accumulated gradients travel (values + indices), the rest accumulate locally, with
    momentum correction; replaces the model's momentum SGD by plain SGD (momentum moves into the
    communication hook)."""

    name: ClassVar[str] = "dgc"

    rampup_begin_step: int = 0
    """Step from which gradients are compressed (dense allreduce before)."""
    rampup_step: int = 1
    """Steps over which the sparsity list is walked."""
    sparsity: List[float] = field(default_factory=lambda: [0.999])
    """Fractions of gradient entries NOT sent, in warm-up order; the last one stays."""

    def __post_init__(self) -> None:
        require(self.rampup_begin_step >= 0, "strategy.dgc.rampup_begin_step", self.rampup_begin_step, "must be >= 0")
        require(self.rampup_step >= 1, "strategy.dgc.rampup_step", self.rampup_step, "must be >= 1")
        require(bool(self.sparsity) and all(0 <= s < 1 for s in self.sparsity), "strategy.dgc.sparsity",
                list(self.sparsity), "a non-empty list of values in [0, 1)")

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(optimizer=Component("plugins.dgc:replace_optimizer", {}),
                            comm_hook=Component("plugins.dgc:build_hook", asdict(self)),
                            callbacks=[Component("plugins.dgc:DGCCheckpoint", {})])


@dataclass
class FP16AllreduceConfig:
    """Half-precision gradient communication (Fleet: `strategy.fp16_allreduce`): gradients travel
    in 16 bits and are restored to float32 (torch fp16/bf16 compress hooks)."""

    name: ClassVar[str] = "fp16_allreduce"

    dtype: str = "float16"
    """Wire type of the gradients: float16 or bfloat16 (wider range, less precision)."""

    def __post_init__(self) -> None:
        require(self.dtype in ("float16", "bfloat16"), "strategy.fp16_allreduce.dtype", self.dtype,
                "allowed: float16, bfloat16", ("float16", "bfloat16"))

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(comm_hook=Component("plugins.fp16_allreduce:build_hook", asdict(self)))


def known_world_size(run: RunShape, key: str) -> int:
    """The run's process count, which model-parallel strategies need before anything starts."""
    world = run.world
    require(isinstance(world["world_size"], int), "trainer.devices", world["devices"],
            f"{key} needs a known process count: set trainer.devices to a number")
    return world["world_size"]


@dataclass
class ShardingConfig:
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
        key = "strategy.sharding."
        require(self.stage in (1, 2, 3), key + "stage", self.stage, "allowed: 1, 2, 3")
        require(self.degree is None or self.degree >= 1, key + "degree", self.degree, "must be >= 1 (or null: auto)")
        for name in ("dp_degree", "mp_degree", "gradient_merge_acc_step"):
            require(getattr(self, name) >= 1, key + name, getattr(self, name), "must be >= 1")
        require(self.pp_degree >= 1, key + "pp_degree", self.pp_degree, "must be >= 1")
        require(self.mp_degree == 1 or self.stage >= 2, key + "mp_degree", self.mp_degree,
                "tensor parallelism needs stage 2 or 3 (FSDP2 on a device mesh); stage 1 is DDP")
        require(not self.optimize_offload or self.stage >= 2, key + "optimize_offload", self.optimize_offload,
                "offload needs stage 2 or 3 (FSDP2 CPUOffloadPolicy)")
        require(self.segment_broadcast_MB > 0, key + "segment_broadcast_MB", self.segment_broadcast_MB, "must be > 0")

    def degrees(self, world_size: int) -> Dict[str, int]:
        """The four degrees with `degree` resolved; their product must be the world size."""
        others = self.dp_degree * self.mp_degree * self.pp_degree
        degree = self.degree if self.degree is not None else max(1, world_size // others)
        degrees = {"dp_degree": self.dp_degree, "degree": degree, "mp_degree": self.mp_degree,
                   "pp_degree": self.pp_degree}
        product = others * degree
        require(product == world_size, "strategy.sharding.degree", degree,
                f"dp_degree x degree x mp_degree x pp_degree = {' x '.join(map(str, degrees.values()))} = "
                f"{product}, but the run has {world_size} process(es)")
        return degrees

    def pipeline_replicas(self, world_size: int) -> int:
        """With strategy pipeline: the number of pipeline replicas (the sharding group), after
        checking the knobs that can go with a pipeline."""
        key = "strategy.sharding."
        require(self.stage == 1, key + "stage", self.stage,
                "with pipeline only stage 1: pipeline stages keep their parameters whole, and stages 2 and 3 "
                "would gather them again for every micro-batch")
        require(self.pp_degree >= 2, key + "pp_degree", self.pp_degree,
                "with pipeline: the processes of one pipeline (>= 2)")
        require(self.dp_degree == 1, key + "dp_degree", self.dp_degree,
                "with pipeline, degree spans all pipeline replicas; replica groups over them are not supported")
        require(self.gradient_merge_acc_step == 1, key + "gradient_merge_acc_step", self.gradient_merge_acc_step,
                "with pipeline, strategy.pipeline.accumulate_steps sets the micro-batches per step")
        return self.degrees(world_size)["degree"]

    def contribute(self, run: RunShape) -> Contribution:
        world_size = known_world_size(run, "sharding")
        if "pipeline" in run.selected:
            replicas = self.pipeline_replicas(world_size)
            return Contribution(notes=[
                f"sharding stage 1 with pipeline: {replicas} pipeline replica(s) of {self.pp_degree} processes, each "
                f"stage's optimizer states sharded over its replicas (carried out by the pipeline strategy)"])
        require(self.pp_degree == 1, "strategy.sharding.pp_degree", self.pp_degree, "> 1 needs strategy pipeline too")
        degrees = self.degrees(world_size)
        kwargs = {"stage": self.stage, **{k: v for k, v in degrees.items() if k != "pp_degree"},
                  "optimize_offload": self.optimize_offload, "segment_broadcast_MB": self.segment_broadcast_MB}
        contribution = Contribution(lightning_strategy=Component("plugins.sharding:build_sharding", kwargs))
        if self.gradient_merge_acc_step > 1:
            contribution.trainer_args["accumulate_grad_batches"] = self.gradient_merge_acc_step
        return contribution


SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble")
# Stages each process holds, by schedule: interleaved schedules loop over several.
STAGES_PER_PROCESS = {"1F1B": (1, 1), "GPipe": (1, 1), "Interleaved1F1B": (2, None), "ZBVZeroBubble": (2, 2)}  # (min, max)


@dataclass
class PipelineConfig:
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
        key = "strategy.pipeline."
        require(self.schedule_mode in SCHEDULES, key + "schedule_mode", self.schedule_mode,
                f"allowed: {', '.join(SCHEDULES)}", SCHEDULES)
        require(self.micro_batch_size is None or self.micro_batch_size >= 1, key + "micro_batch_size",
                self.micro_batch_size, "must be >= 1 (or null: batch_size / accumulate_steps)")
        require(self.accumulate_steps >= 1, key + "accumulate_steps", self.accumulate_steps, "must be >= 1")
        low, high = STAGES_PER_PROCESS[self.schedule_mode]
        require(low <= self.vpp_degree and (high is None or self.vpp_degree <= high), key + "vpp_degree",
                self.vpp_degree, f"schedule_mode={self.schedule_mode} needs {low if low == high else f'>= {low}'}")

    def micro_batch(self, batch_size: Optional[int]) -> int:
        """micro_batch_size, resolved from the data's batch size and checked against it."""
        key = "strategy.pipeline."
        if batch_size is None:
            require(self.micro_batch_size is not None, key + "micro_batch_size", None,
                    "required: the data config has no batch_size to derive it from")
            return self.micro_batch_size
        if self.micro_batch_size is None:
            require(batch_size % self.accumulate_steps == 0, key + "accumulate_steps", self.accumulate_steps,
                    f"must divide data.batch_size={batch_size} into equal micro-batches")
            return batch_size // self.accumulate_steps
        product = self.micro_batch_size * self.accumulate_steps
        require(product == batch_size, key + "micro_batch_size", self.micro_batch_size,
                f"micro_batch_size x accumulate_steps = {self.micro_batch_size} x {self.accumulate_steps} = "
                f"{product}, but data.batch_size={batch_size}")
        return self.micro_batch_size

    def check_micro_batches(self, world_size: int) -> None:
        """The micro-batch counts torch's schedules can order for a pipeline of this many processes."""
        key = "strategy.pipeline."
        require(world_size >= 2, "trainer.devices", world_size, "pipeline needs >= 2 processes (one per stage)")
        stages = world_size * self.vpp_degree
        needed = {"1F1B": world_size, "ZBVZeroBubble": stages}.get(self.schedule_mode, 1)
        require(self.accumulate_steps >= needed, key + "accumulate_steps", self.accumulate_steps,
                f"schedule_mode={self.schedule_mode} needs >= {needed} micro-batches for {stages} stages "
                f"on {world_size} processes")
        rounds = max(1, self.accumulate_steps // world_size)
        require(self.schedule_mode != "Interleaved1F1B" or self.accumulate_steps % rounds == 0,
                key + "accumulate_steps", self.accumulate_steps,
                f"Interleaved1F1B runs rounds of {world_size} micro-batches: use a multiple of {world_size} "
                f"or fewer than {2 * world_size}")

    def contribute(self, run: RunShape) -> Contribution:
        world_size = known_world_size(run, "pipeline")
        sharding = run.selected.get("sharding")
        replicas = sharding.pipeline_replicas(world_size) if sharding is not None else 1
        self.check_micro_batches(world_size // replicas)
        kwargs = {"schedule_mode": self.schedule_mode, "micro_batch_size": self.micro_batch(run.batch_size),
                  "accumulate_steps": self.accumulate_steps, "split_points": list(self.split_points),
                  "vpp_degree": self.vpp_degree}
        if sharding is not None:
            kwargs.update(data_parallel_size=replicas, shard_optimizer_states=True)
        samples = kwargs["micro_batch_size"] * self.accumulate_steps
        return Contribution(
            lightning_strategy=Component("plugins.pipeline:build_pipeline", kwargs),
            # accumulate_steps micro-batches already make one optimizer step.
            trainer_args={"accumulate_grad_batches": 1},
            notes=["pipeline: the model's training_step and validation_step are bypassed; each rank builds the "
                   "whole model, keeps its stages, and logs the loss of the last stage as train_loss, and its "
                   "eval-mode loss as val_loss (no other validation metric)",
                   f"pipeline: every training and validation batch must hold micro_batch_size x accumulate_steps "
                   f"= {samples} samples (drop a smaller last training batch; the validation set must divide into "
                   f"them); checkpoints are directories holding each stage's part"])


@dataclass
class StrategyConfig:
    """Knobs of the selected strategies; a key is present only when its strategy is selected."""

    amp: Optional[AmpConfig] = None
    recompute: Optional[RecomputeConfig] = None
    gradient_merge: Optional[GradientMergeConfig] = None
    lars: Optional[LarsConfig] = None
    lamb: Optional[LambConfig] = None
    localsgd: Optional[LocalSGDConfig] = None
    adaptive_localsgd: Optional[AdaptiveLocalSGDConfig] = None
    dgc: Optional[DGCConfig] = None
    fp16_allreduce: Optional[FP16AllreduceConfig] = None
    sharding: Optional[ShardingConfig] = None
    pipeline: Optional[PipelineConfig] = None


# --------------------------------------------------------------------------- the run


@dataclass
class TrainerConfig:
    """Arguments of `pytorch_lightning.Trainer`. lightfleet owns `strategy`, `precision`,
    `plugins`, `callbacks`, `logger` and `default_root_dir` (they come from the plan and the
    config groups), so they are not knobs here."""

    accelerator: str = "auto"
    """cpu, gpu/cuda or auto (CUDA when available)."""
    devices: Any = 1
    """Processes per node (an int), or a device list. On CPU, 2 means 2 real processes (gloo)."""
    num_nodes: int = 1
    """Nodes; the same command runs on each with MASTER_ADDR, MASTER_PORT and NODE_RANK set."""
    max_epochs: Optional[int] = None
    """Stop after this many epochs (None: Lightning's default, 1000, unless max_steps is set)."""
    min_epochs: Optional[int] = None
    """Run at least this many epochs."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: no limit)."""
    min_steps: Optional[int] = None
    """Run at least this many optimizer steps."""
    max_time: Any = None
    """Stop after this wall time ("DD:HH:MM:SS" or a dict)."""
    limit_train_batches: Any = None
    """Batches per training epoch (int) or fraction of them (float)."""
    limit_val_batches: Any = None
    """Batches per validation run (int) or fraction of them (float); 0 disables validation."""
    limit_test_batches: Any = None
    """Batches per test run (int) or fraction (float)."""
    limit_predict_batches: Any = None
    """Batches per predict run (int) or fraction (float)."""
    overfit_batches: Any = 0.0
    """Train and validate on this many (int) or this fraction (float) of training batches."""
    val_check_interval: Any = None
    """Validate every this many training batches (int) or fraction of an epoch (float)."""
    check_val_every_n_epoch: Optional[int] = 1
    """Validate every n epochs."""
    num_sanity_val_steps: Optional[int] = None
    """Validation batches run before training (Lightning default 2)."""
    log_every_n_steps: Optional[int] = None
    """Logging interval in steps (Lightning default 50)."""
    enable_checkpointing: Optional[bool] = None
    """Save checkpoints (see the callbacks group)."""
    enable_progress_bar: Optional[bool] = None
    """Show the progress bar."""
    enable_model_summary: Optional[bool] = None
    """Print the model summary at start."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step; prefer strategy=[gradient_merge] (which sets it)."""
    gradient_clip_val: Optional[float] = None
    """Clip gradients at this value (None: no clipping)."""
    gradient_clip_algorithm: Optional[str] = None
    """norm (default) or value."""
    deterministic: Any = None
    """Use deterministic algorithms (true, false or "warn")."""
    benchmark: Optional[bool] = None
    """cudnn.benchmark."""
    inference_mode: bool = True
    """Use torch.inference_mode in evaluation."""
    use_distributed_sampler: bool = True
    """Wrap dataloaders in a DistributedSampler when distributed."""
    profiler: Optional[str] = None
    """simple, advanced or pytorch."""
    detect_anomaly: bool = False
    """Enable autograd anomaly detection."""
    barebones: bool = False
    """Disable all features that may slow the loop (logging, checkpoints, progress bar...)."""
    sync_batchnorm: bool = False
    """Synchronise batch-norm statistics across processes."""
    reload_dataloaders_every_n_epochs: int = 0
    """Reload dataloaders every n epochs (0: never)."""
    fast_dev_run: Any = False
    """Run n (or 1 if true) batches of train/val/test to find bugs."""
    enable_autolog_hparams: bool = True
    """Log the module's hyperparameters to the loggers."""
    model_registry: Optional[str] = None
    """Lightning model registry name (unused by lightfleet)."""

    def __post_init__(self) -> None:
        devices_ok = (self.devices in ("auto", -1) or (isinstance(self.devices, int) and self.devices >= 1)
                      or (isinstance(self.devices, list) and len(self.devices) >= 1))
        require(devices_ok, "trainer.devices", self.devices, "allowed: a count >= 1, a list of device ids, auto or -1")
        require(self.num_nodes >= 1, "trainer.num_nodes", self.num_nodes, "must be >= 1")
        require(self.accumulate_grad_batches >= 1, "trainer.accumulate_grad_batches",
                self.accumulate_grad_batches, "must be >= 1")


@dataclass
class PathsConfig:
    """Where outputs go. Relative paths are taken from the directory lightfleet runs in."""

    root_dir: str = "."
    """Base of the default output locations."""
    output_dir: str = "${paths.root_dir}/outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    """Run directory of a single run: config, plan, env, metrics, checkpoints, rank logs."""
    sweep_dir: str = "${paths.root_dir}/multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    """Parent of a multirun's job directories (one per job: 0, 1, ...)."""


@dataclass
class RunConfig:
    """A whole run: what to train, on what, how, with which strategies, and where outputs go."""

    model: Dict[str, Any] = field(default_factory=dict)
    """The LightningModule: `_target_` (import path) and its constructor arguments."""
    data: Dict[str, Any] = field(default_factory=dict)
    """The LightningDataModule: `_target_` and its constructor arguments."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Lightning Trainer arguments."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    """Knobs of the strategies selected with `strategy=[...]`."""
    logger: Dict[str, Any] = field(default_factory=dict)
    """Loggers by name, each a `_target_` spec (null disables one)."""
    callbacks: Dict[str, Any] = field(default_factory=dict)
    """Extra callbacks by name, each a `_target_` spec (null disables one)."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    """Output locations."""
    name: str = "default"
    """Name of the run (experiments set it)."""
    seed: int = 0
    """Seed for torch, numpy and python random on every rank."""
    dry_run: bool = False
    """Print the plan and exit without training."""


def strategy_schemas() -> Dict[str, type]:
    """Strategy name -> its schema dataclass, read off StrategyConfig's fields."""
    import typing

    hints = typing.get_type_hints(StrategyConfig)
    return {name: typing.get_args(hint)[0] for name, hint in hints.items()}
