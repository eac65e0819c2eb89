"""What a strategy says it adds to a run, as plain data; runner/core/plan.py combines these.

A strategy (runner/strategies/<name>.py) is a dataclass of its knobs deriving from `Strategy`:
its fields are the knobs (each documented by the string under it), `__post_init__` checks
their ranges, and `contribute(run)` returns a `Contribution`. No torch here or there.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

from runner.core.errors import Refusal
from runner.core.world import Layout, World, device_type


@dataclass(frozen=True)
class Component:
    """A callable named by import path ("package.module:attr") and the keyword arguments it gets.

    Calling conventions by plan slot: precision `f(device_type=..., **kwargs) -> Precision`;
    lightning_strategy `f(comm_hook=None, **kwargs, **the plan's lightning strategy arguments)
    -> Strategy` (comm_hook only where it takes one; every one takes `timeout_s`, the process
    group's timeout in seconds); comm hook `f(**kwargs) -> (state, hook)`, called once the
    process group exists; optimizer replacement `f(optimizer, model=..., **kwargs) -> Optimizer`,
    applied to each optimizer the model's `configure_optimizers` returns, then each optimizer
    transform `f(optimizer, **kwargs) -> Optimizer` in order; model transform `f(module, context,
    **kwargs) -> names of the modules changed` (plugins/transforms.py); callback `f(**kwargs) -> Callback`;
    checkpoint io `f(**kwargs) -> CheckpointIO`.
    """

    target: str
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def load(self) -> Any:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


def no_cuda() -> bool:
    """RunShape's CUDA probe unless the command gives its own: a machine without CUDA."""
    return False


@dataclass(frozen=True)
class RunShape:
    """What a contributor may know about the run when it contributes: its processes, the data's
    batch size per step and process (None when the data config has none), the selected
    strategies' knobs by name, the trainer's arguments, its device type and, for lightfleet's
    own contributors (runner/core/plan.py: they come after the strategies), the Lightning
    strategy and the precision plugin the plan has."""

    world: World
    batch_size: Optional[int] = None
    selected: Dict[str, "Strategy"] = field(default_factory=dict)
    trainer: Any = None  # the validated TrainerConfig (runner/config/schema.py); None: its defaults
    # Asked only when a contribution needs `device_type` with trainer.accelerator=auto: the
    # command's probe imports torch, which a refused command should not pay for.
    cuda_available: Callable[[], bool] = field(default=no_cuda, compare=False, repr=False)
    lightning_strategy: Optional[str] = None  # its target (None: Lightning's own, in one process)
    precision: Optional[str] = None  # its target (None: float32 throughout)

    @functools.cached_property
    def device_type(self) -> str:
        """cuda or cpu (runner.core.world.device_type)."""
        return device_type(getattr(self.trainer, "accelerator", "auto"), self.cuda_available)

    @functools.cached_property
    def layout(self) -> Optional[Layout]:
        """The process layout a selected strategy arranges (one that defines `layout(run)`), or None."""
        arranged = {name: knobs.layout(self) for name, knobs in self.selected.items() if hasattr(knobs, "layout")}
        if len(arranged) > 1:
            raise Refusal(f"{' and '.join(arranged)} both arrange the processes; choose one of them")
        return next(iter(arranged.values()), None)


@dataclass
class Contribution:
    """What one strategy (or lightfleet itself) adds to the plan: claims on the exclusive slots,
    arguments for the plan's Lightning strategy, model transforms by phase, optimizer transforms,
    trainer arguments, callbacks and notes for the printed plan."""

    precision: Optional[Component] = None
    lightning_strategy: Optional[Component] = None
    takes_comm_hook: bool = False  # whether `lightning_strategy` registers a gradient communication hook
    lightning_strategy_args: Dict[str, Any] = field(default_factory=dict)  # for whichever the plan has
    optimizer: Optional[Component] = None
    comm_hook: Optional[Component] = None
    checkpoint_io: Optional[Component] = None  # Lightning's CheckpointIO plugin
    model_transforms: List[Tuple[str, Component]] = field(default_factory=list)  # (phase, component)
    optimizer_transforms: List[Component] = field(default_factory=list)  # after the optimizer replacement
    trainer_args: Dict[str, Any] = field(default_factory=dict)
    callbacks: List[Component] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


# Optimizer state per parameter, in bytes of float32, by optimizer family (momentum; Adam's two moments).
OPTIMIZER_STATE_BYTES = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "other": 8}
# The families a strategy's optimizer replacement needs, as its refusal names them: what they are and
# the option of the built-in models' optimizer group (conf/model/optimizer/) that gives one.
NEEDED_OPTIMIZER = {
    "sgd_momentum": "momentum SGD (torch.optim.SGD with momentum > 0); choose it with model/optimizer=sgd",
    "adam": "an Adam-family optimizer (torch.optim.Adam or torch.optim.AdamW); choose one with "
            "model/optimizer=adam or model/optimizer=adamw",
}


@dataclass(frozen=True)
class Facts:
    """What `strategy=[auto]` knows of a run before it chooses (plugins/auto.py gathers them on
    the driver, the model built on the meta device)."""

    parameters: int
    optimizer: str  # the family of what configure_optimizers returns: a key of OPTIMIZER_STATE_BYTES
    blocks: int  # modules in the model's first repeated block list (0: none)
    has_loss: bool  # the model has loss(outputs, targets), which the pipeline's last stage needs
    activation_bytes: int  # saved for backward by one float32 training forward of one process (distinct storages)
    batch_size: Optional[int]
    world_size: int
    num_nodes: int = 1
    device: str = "cpu"  # cpu | cuda
    device_memory_bytes: Optional[int] = None  # per process; None: unknown, nothing pruned
    bf16: bool = True  # the device computes bfloat16
    # What one training forward saves, measured by precision (SAVED_PRECISIONS), each split by where
    # it is saved (SAVED_PARTS) at the whole batch, with "<part>_fixed" the bytes of that part
    # that do not shrink with the batch (the weights' 16-bit copies under autocast). None where not
    # measured (facts written by hand): activations are then taken as spread evenly over the
    # blocks and halved by 16 bits.
    saved: Optional[Dict[str, Dict[str, int]]] = None


# Facts.saved's precisions: a float32 forward; under 16-bit autocast (amp); under autocast with
# the parameters already 16-bit (amp with FSDP2's sharding stages 2 and 3, which gather them so).
SAVED_PRECISIONS = ("float32", "autocast", "autocast_16bit_parameters")
# Facts.saved's parts: all of it; what the head after the last repeated block saves (freed before
# recompute rebuilds a block); what the blocks save and nothing outside them does; the blocks'
# inputs not saved elsewhere (what recompute keeps); the largest block's own (what recompute
# rebuilds at once in backward); and, not saved but held on top of all that at the start of
# backward, the most bytes the loss's backward holds at once (the gradients of its float32
# log-softmax: twice the float32 logits of a language model).
SAVED_PARTS = ("total", "head", "in_blocks", "block_inputs", "largest_block", "loss_backward")


@dataclass(frozen=True)
class Memory:
    """Bytes one process holds at its peak, by kind: float32 training before strategies act.

    Strategies change the first three kinds directly; the activations they shape through the
    fields below, and `held_activations` turns those into bytes once every strategy has acted."""

    parameters: float
    gradients: float
    optimizer_states: float
    activations: float  # Memory.of: float32's; `estimate` sets it from held_activations once every strategy acted
    compute_bytes: float = 4.0  # of a parameter as forward and backward use it (amp: 2); sharding gathers these
    autocast: bool = False  # amp: the forward runs under 16-bit autocast
    parameters_gathered: bool = False  # FSDP2 (sharding stages 2 and 3): forward uses gathered compute-dtype copies
    micro_batch_fraction: float = 1.0  # of the batch one forward sees (gradient merging, the pipeline's micro-batches)
    micro_batches_alive: int = 1  # whose activations are held at once (the pipeline's schedule)
    stage_share: float = 1.0  # of the model's layers this process runs (the pipeline's stage)
    recompute: bool = False  # the repeated blocks keep their inputs only and are rebuilt in backward

    @classmethod
    def of(cls, facts: Facts) -> "Memory":
        return cls(4.0 * facts.parameters, 4.0 * facts.parameters,
                   OPTIMIZER_STATE_BYTES[facts.optimizer] * float(facts.parameters), float(facts.activation_bytes))

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.activations

    def held_activations(self, facts: Facts) -> float:
        """The activation bytes held at the peak: the micro-batches alive, each of this stage's share
        of the layers at its fraction of the batch; what does not shrink with the batch (the weights'
        16-bit copies, made once per step) counted once; with recompute, the blocks' inputs; and on
        top, the larger of what the loss's backward holds at once (one micro-batch's) and, with
        recompute, what rebuilding one block of one micro-batch holds (the head's freed by then)."""
        if facts.saved is None:  # written by hand: even blocks, everything 16-bit under autocast
            kept = min(1.0, 2 / facts.blocks) if self.recompute and facts.blocks else 1.0
            return (facts.activation_bytes * (0.5 if self.autocast else 1.0) * kept * self.micro_batch_fraction
                    * self.micro_batches_alive * self.stage_share)
        split = facts.saved["float32" if not self.autocast else
                            "autocast_16bit_parameters" if self.parameters_gathered else "autocast"]

        def fixed(part: str) -> float:
            return split[part + "_fixed"]

        def per_micro_batch(part: str) -> float:  # the part of one micro-batch that grows with it
            return self.micro_batch_fraction * (split[part] - fixed(part))

        def of_one_micro_batch(part: str) -> float:
            return fixed(part) + per_micro_batch(part)

        # What stays saved through backward: all of it, or with recompute the blocks' inputs in place of their own.
        kept = {"total": 1} if not self.recompute else {"total": 1, "in_blocks": -1, "block_inputs": 1}
        steady = self.stage_share * sum(sign * (fixed(part) + self.micro_batches_alive * per_micro_batch(part))
                                        for part, sign in kept.items())
        if self.stage_share < 1 and facts.blocks:
            # A pipeline's schedule holds each live micro-batch's stage output (a block's output: the
            # next block's input) until its backward, beside what autograd saves.
            steady += self.micro_batches_alive * per_micro_batch("block_inputs") / facts.blocks
        # Two moments of backward: the loss's, first, with everything saved still held (on the last
        # stage, which computes the whole loss: no stage's share); and with recompute, a block's
        # rebuild, later, once the loss's gradients and the head's saved tensors are freed. The
        # peak is the larger.
        rebuilt = (of_one_micro_batch("largest_block") - self.stage_share * of_one_micro_batch("head")
                   if self.recompute else 0.0)
        return steady + max(of_one_micro_batch("loss_backward"), rebuilt)


class Strategy:
    """Base of every strategy's knobs dataclass; `name` is its module's name in runner/strategies/.

    Besides `contribute`, a strategy answers `strategy=[auto]`'s questions (defaults: applies to
    any run, changes no memory, costs no time): `applies`, `memory`, `speed` and `variants`."""

    name: ClassVar[str]
    changes_numerics: ClassVar[bool] = False  # the result differs beyond floating-point rounding
    for_memory_only: ClassVar[bool] = False  # auto tries it only when a candidate does not fit without it

    def contribute(self, run: RunShape) -> Contribution:
        raise NotImplementedError(f"{type(self).__name__}.contribute")

    def applies(self, facts: Facts) -> Optional[str]:
        """Why the strategy cannot serve a run of these facts; None when it can."""
        return None

    def memory(self, memory: Memory, facts: Facts) -> Memory:
        """The per-process bytes of a run with this strategy on, from those without it."""
        return memory

    def speed(self, facts: Facts) -> float:
        """Estimated throughput with this strategy relative to without it (auto tries the fastest first)."""
        return 1.0

    def variants(self, facts: Facts) -> List[Dict[str, Any]]:
        """The knob settings worth trying for these facts (each a dict of knobs over the defaults)."""
        return [{}]

    def fast_path_conflict(self, mechanism: str, run: RunShape) -> Optional[str]:
        """Why the fast path's `mechanism` (FAST_PATH: runner/config/fast_path.py) cannot serve a run
        with this strategy at these knobs, as a phrase following the strategy's name; None when
        they combine."""
        return None
