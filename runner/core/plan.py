"""The plan: a small, printable data object saying what a run will do and which strategy asked.

Pure data (no torch). The command makes it once (`make_plan`) and saves it in the run
directory, where every rank reads it (`Plan.from_dict`). Its rules hold whatever the table
allows: one claim per exclusive slot, a gradient communication hook only beside a Lightning
strategy that takes one, model transforms only in the declared phases, in their order.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from runner.core.contribution import Component, Contribution, RunShape, Strategy
from runner.core.errors import Refusal
from runner.core.world import World

EXCLUSIVE_SLOTS = ("precision", "lightning_strategy", "optimizer", "comm_hook")
# The order model transforms run in, all once the process group exists (in the model's
# configure_model): rewrites of the forward's dtypes first, as the pipeline split traces the
# forward; then each stage (or the whole model) is split over tensor-parallel ranks, wrapped for
# recomputation, and sharded last, so that sharding sees the final module tree.
PHASES = ("precision", "pipeline", "tensor_parallel", "recompute", "sharding")


@dataclass
class Claim:
    by: str
    component: Component
    phase: Optional[str] = None

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> Optional["Claim"]:
        if data is None:
            return None
        return cls(data["by"], Component(data["component"]["target"], dict(data["component"]["kwargs"])),
                   data.get("phase"))


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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """The plan as `to_dict` wrote it (extra keys, like the printed form, are ignored)."""
        return cls(strategies=list(data["strategies"]), world=dict(data["world"]),
                   **{slot: Claim.from_dict(data[slot]) for slot in EXCLUSIVE_SLOTS},
                   model_transforms=[Claim.from_dict(c) for c in data["model_transforms"]],
                   trainer_args={arg: dict(claim) for arg, claim in data["trainer_args"].items()},
                   callbacks=[Claim.from_dict(c) for c in data["callbacks"]], notes=list(data["notes"]))


def make_plan(strategies: Dict[str, Strategy], trainer: Any, batch_size: Optional[int] = None) -> Plan:
    """Combine the selected strategies' contributions into one plan.

    `strategies` maps name -> validated knobs (in selection order); `trainer` is the validated
    TrainerConfig (runner/config/schema.py); `batch_size` the data's batch size, if known. A strategy whose knobs do not
    fit the run (degrees against the world size) raises ConfigError; a broken plan rule raises
    Refusal naming the strategies involved.
    """
    world = World.of(trainer)
    plan = Plan(strategies=list(strategies), world=world.to_dict())
    run = RunShape(world, batch_size, dict(strategies))
    takes_comm_hook = True  # lightfleet's own DDP, unless a strategy brings its Lightning strategy
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
        if contribution.lightning_strategy is not None:
            takes_comm_hook = contribution.takes_comm_hook
        for phase, component in contribution.model_transforms:
            if phase not in PHASES:
                raise Refusal(f"strategy {name} adds a model transform in phase {phase!r}; phases: {', '.join(PHASES)}")
            plan.model_transforms.append(Claim(name, component, phase))
        _claim_trainer_args(plan, name, contribution.trainer_args, trainer)
        plan.callbacks.extend(Claim(name, component) for component in contribution.callbacks)
        plan.notes.extend(contribution.notes)
    plan.model_transforms.sort(key=lambda claim: PHASES.index(claim.phase))
    if plan.comm_hook is not None and plan.lightning_strategy is not None and not takes_comm_hook:
        raise Refusal(f"{plan.lightning_strategy.by} and {plan.comm_hook.by} both own the gradient communication "
                      f"hook: {plan.lightning_strategy.by}'s Lightning strategy "
                      f"({plan.lightning_strategy.component.target}) communicates gradients itself and takes no "
                      f"hook; choose one of them")
    if plan.lightning_strategy is None and (world.world_size != 1 or plan.comm_hook is not None):
        # Processes are started by lightfleet's launcher (or torchrun/SLURM); Lightning joins them.
        # A communication hook needs DDP even in one process: it may carry the update (dgc's momentum).
        plan.lightning_strategy = Claim("lightfleet", Component("plugins.ddp:build_ddp", {}))
    return plan


def _claim_trainer_args(plan: Plan, name: str, trainer_args: Dict[str, Any], trainer: Any) -> None:
    """One value per trainer argument, and none against the user's own setting."""
    defaults = type(trainer)()  # the schema's TrainerConfig, at its defaults
    for arg, value in trainer_args.items():
        if arg in plan.trainer_args and plan.trainer_args[arg]["value"] != value:
            raise Refusal(f"{plan.trainer_args[arg]['by']} and {name} both set trainer.{arg}; choose one of them")
        user_value = getattr(trainer, arg, None)
        if user_value != getattr(defaults, arg, None) and user_value != value:
            raise Refusal(f"trainer.{arg}={user_value!r} conflicts with strategy {name}, which sets it to "
                          f"{value!r}; set it in one place")
        plan.trainer_args[arg] = {"value": value, "by": name}


def format_plan(plan: Plan) -> str:
    """Human-readable plan: one line per decision that is switched on, each with the strategy
    that asked for it (plan.yaml holds the whole plan)."""
    world = plan.world
    lines = [f"strategies: {', '.join(plan.strategies) or '(none)'}",
             f"world: {world['world_size']} process(es) = {world['devices']} per node x {world['num_nodes']} node(s)"]

    def describe(claim: Claim) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in claim.component.kwargs.items())
        return f"{claim.component.target}({kwargs})  <- {claim.by}"

    for slot, claim in (("precision", plan.precision), ("lightning strategy", plan.lightning_strategy),
                        ("optimizer replacement", plan.optimizer), ("gradient communication hook", plan.comm_hook)):
        if claim is not None:
            lines.append(f"{slot}: {describe(claim)}")
    if plan.model_transforms:
        lines.append("model transforms (in order, in the model's configure_model):")
        lines += [f"  {i}. [{c.phase}] {describe(c)}" for i, c in enumerate(plan.model_transforms, 1)]
    if plan.trainer_args:
        lines.append("trainer arguments:")
        lines += [f"  {arg}={v['value']!r}  <- {v['by']}" for arg, v in plan.trainer_args.items()]
    if plan.callbacks:
        lines.append("callbacks:")
        lines += [f"  {describe(c)}" for c in plan.callbacks]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)
