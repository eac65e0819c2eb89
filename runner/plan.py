"""The plan: a small, printable data object saying what a run will do and which strategy asked.

Pure data (no torch). Slots make conflicts structural: precision, Lightning strategy, optimizer
replacement and gradient communication hook hold one claim each; model transforms are applied
in a fixed phase order (like torchtitan's parallelize); trainer arguments may be set by one
claimant each; callbacks are an ordered list. Build (runner/build.py) turns it into objects.
"""
from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from runner.errors import Refusal

EXCLUSIVE_SLOTS = ("precision", "lightning_strategy", "optimizer", "comm_hook")
# Order in which model transforms are applied: parallelism that splits the model first, then
# per-module rewrites, then wrappers that must see the final module tree.
PHASES = ("tensor_parallel", "pipeline", "precision", "recompute", "compile", "sharding")


@dataclass(frozen=True)
class Component:
    """A callable named by import path ("package.module:attr") and the keyword arguments it gets.

    Calling conventions by slot: precision `f(device_type=..., **kwargs) -> Precision`;
    lightning_strategy `f(comm_hook=None, **kwargs) -> Strategy`; comm hook
    `f(**kwargs) -> (state, hook)`, called once the process group exists; optimizer replacement
    `f(optimizer, model=..., **kwargs) -> Optimizer`, applied to each optimizer the model's
    `configure_optimizers` returns; model transform `f(model, device_type=..., **kwargs) ->
    list of module names changed`; callback `f(**kwargs) -> Callback`.
    """

    target: str
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def load(self) -> Any:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class RunShape:
    """What a strategy may need to know about the run to contribute: the processes
    (`world_of`), the data's batch size per step and process (None when the data config has no
    `batch_size`), and the selected strategies' knobs (strategies that split the same processes
    between them, like pipeline and sharding, read each other's degrees)."""

    world: Dict[str, Any]
    batch_size: Optional[int] = None
    selected: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Contribution:
    """What one strategy adds to the plan (returned by its schema's `contribute()`)."""

    precision: Optional[Component] = None
    lightning_strategy: Optional[Component] = None
    optimizer: Optional[Component] = None
    comm_hook: Optional[Component] = None
    model_transforms: List[Tuple[str, Component]] = field(default_factory=list)  # (phase, component)
    trainer_args: Dict[str, Any] = field(default_factory=dict)
    callbacks: List[Component] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


@dataclass
class Claim:
    by: str
    component: Component
    phase: Optional[str] = None


@dataclass
class Plan:
    strategies: List[str]
    world: Dict[str, Any]
    precision: Optional[Claim] = None
    lightning_strategy: Optional[Claim] = None
    optimizer: Optional[Claim] = None
    comm_hook: Optional[Claim] = None
    model_transforms: List[Claim] = field(default_factory=list)
    trainer_args: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # arg -> {value, by}
    callbacks: List[Claim] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def world_of(trainer: Any) -> Dict[str, Any]:
    """Processes per node and in all, from the trainer config (devices may stay "auto")."""
    devices = trainer.devices
    per_node = len(devices) if isinstance(devices, (list, tuple)) else devices
    if isinstance(per_node, str) and per_node.isdigit():
        per_node = int(per_node)
    world_size = per_node * trainer.num_nodes if isinstance(per_node, int) else "auto"
    return {"devices": per_node, "num_nodes": trainer.num_nodes, "world_size": world_size}


def make_plan(strategies: Dict[str, Any], trainer: Any, batch_size: Optional[int] = None) -> Plan:
    """Combine the selected strategies' contributions into one plan.

    `strategies` maps name -> validated schema object (in selection order); `trainer` is the
    validated TrainerConfig; `batch_size` the data's batch size, if known. A strategy whose
    knobs do not fit the run (degrees against the world size) raises ConfigError. Raises Refusal when two strategies claim one exclusive slot or one
    trainer argument, or a strategy's trainer argument contradicts the user's own setting.
    """
    from runner.schema import TrainerConfig  # the user's trainer defaults, to tell set from unset

    plan = Plan(strategies=list(strategies), world=world_of(trainer))
    run = RunShape(plan.world, batch_size, dict(strategies))
    defaults = TrainerConfig()
    for name, knobs in strategies.items():
        contribution: Contribution = knobs.contribute(run)
        for slot in EXCLUSIVE_SLOTS:
            component = getattr(contribution, slot)
            if component is None:
                continue
            held = getattr(plan, slot)
            if held is not None:
                raise Refusal(f"{held.by} and {name} both set the {slot.replace('_', ' ')}; choose one of them")
            setattr(plan, slot, Claim(name, component))
        for phase, component in contribution.model_transforms:
            plan.model_transforms.append(Claim(name, component, phase))
        for arg, value in contribution.trainer_args.items():
            if arg in plan.trainer_args and plan.trainer_args[arg]["value"] != value:
                raise Refusal(f"{plan.trainer_args[arg]['by']} and {name} both set trainer.{arg}; choose one of them")
            user_value = getattr(trainer, arg, None)
            if user_value != getattr(defaults, arg, None) and user_value != value:
                raise Refusal(f"trainer.{arg}={user_value!r} conflicts with strategy {name}, which sets it to "
                              f"{value!r}; set it in one place")
            plan.trainer_args[arg] = {"value": value, "by": name}
        plan.callbacks.extend(Claim(name, component) for component in contribution.callbacks)
        plan.notes.extend(contribution.notes)
    plan.model_transforms.sort(key=lambda claim: PHASES.index(claim.phase))
    if plan.lightning_strategy is None and (plan.world["world_size"] != 1 or plan.comm_hook is not None):
        # Processes are started by lightfleet's launcher (or torchrun/SLURM); Lightning joins them.
        # A communication hook needs DDP even in one process: it may carry the update (dgc's momentum).
        plan.lightning_strategy = Claim("lightfleet", Component("plugins.ddp:build_ddp", {}))
    return plan


def format_plan(plan: Plan) -> str:
    """Human-readable plan: one line per decision, each with the strategy that asked for it."""
    world = plan.world
    lines = [f"strategies: {', '.join(plan.strategies) or '(none)'}",
             f"world: {world['world_size']} process(es) = {world['devices']} per node x {world['num_nodes']} node(s)"]

    def describe(claim: Optional[Claim], default: str) -> str:
        if claim is None:
            return default
        kwargs = ", ".join(f"{k}={v!r}" for k, v in claim.component.kwargs.items())
        return f"{claim.component.target}({kwargs})  <- {claim.by}"

    lines.append(f"precision: {describe(plan.precision, '32-true (default)')}")
    lines.append(f"lightning strategy: {describe(plan.lightning_strategy, 'single device (default)')}")
    lines.append(f"optimizer replacement: {describe(plan.optimizer, 'none: the model configures its own')}")
    lines.append(f"gradient communication hook: {describe(plan.comm_hook, 'none')}")
    lines.append("model transforms (in order):" + ("" if plan.model_transforms else " none"))
    lines += [f"  {i}. [{c.phase}] {describe(c, '')}" for i, c in enumerate(plan.model_transforms, 1)]
    lines.append("trainer arguments:" + ("" if plan.trainer_args else " none beyond trainer.*"))
    lines += [f"  {arg}={v['value']!r}  <- {v['by']}" for arg, v in plan.trainer_args.items()]
    lines.append("callbacks:" + ("" if plan.callbacks else " none beyond callbacks.*"))
    lines += [f"  {describe(c, '')}" for c in plan.callbacks]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)
