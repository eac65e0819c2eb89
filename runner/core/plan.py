"""The plan: a small, printable data object saying what a run will do and who asked for each part.

The whole truth: every component that changes how the model trains or communicates is a claim
in it, the strategies' and lightfleet's own (`collective`: DDP's arguments, the process group's
timeout, foreach optimizers; `fast_path`: compile, fused optimizers, the attention kernel;
`lightfleet`: the runner's callbacks); the build (runner/rank/build.py) carries it out and adds
nothing. Pure data (no torch). The command makes it once (`make_plan`) and saves it in the run
directory, where every rank reads it (`Plan.from_dict`). Its rules hold whatever the table
allows: one claim per exclusive slot, a gradient communication hook only beside a Lightning
strategy that takes one, model transforms only in the declared phases, in their order, each
once.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional

from runner.core.contribution import Component, Contribution, RunShape, Strategy, no_cuda
from runner.core.errors import Refusal
from runner.core.world import Layout, World

EXCLUSIVE_SLOTS = ("precision", "lightning_strategy", "optimizer", "comm_hook", "checkpoint_io")
# The order model transforms run in, all once the process group exists (in the model's
# configure_model): rewrites of the forward's dtypes first, as the pipeline split traces the
# forward; then each stage (or the whole model) is split over tensor-parallel ranks, wrapped for
# recomputation, and sharded, so that sharding sees the final module tree; torch.compile last, on
# the module the others made (compiled in place, so DDP, which wraps after configure_model, and
# FSDP2's hooks still see the same module objects).
PHASES = ("precision", "pipeline", "tensor_parallel", "recompute", "sharding", "compile")
# Callbacks run in list order, hook by hook: the strategies' first, then the user's (the config's
# callbacks group, which so see what the strategies did: summed gradients, averaged parameters),
# then lightfleet's own, in phase AFTER_USER: the measurement sees whole steps, and the preemption
# checkpoint holds the state the user's callbacks kept for its step.
AFTER_USER = "after_user"
RUNNER = "lightfleet"  # who asks for what every run has: the runner's callbacks, DDP where no strategy brings one


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
    checkpoint_io: Optional[Claim] = None  # how checkpoint files are written and read
    lightning_strategy_args: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # arg -> {value, by}
    model_transforms: List[Claim] = field(default_factory=list)
    optimizer_transforms: List[Claim] = field(default_factory=list)
    trainer_args: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # arg -> {value, by}
    callbacks: List[Claim] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @property
    def layout(self) -> Optional[Layout]:
        """The layout the Lightning strategy is given (sharding's, the pipeline's); None: every
        process a replica of the whole model."""
        layout = self.lightning_strategy.component.kwargs.get("layout") if self.lightning_strategy else None
        return None if layout is None else Layout(**layout)

    @property
    def data_parallel_size(self) -> Optional[int]:
        """How many processes read different batches: the replicas of the layout the Lightning
        strategy is given (sharding's, the pipeline's), else every process (None: not known before
        Lightning resolves trainer.devices=auto)."""
        if self.layout is not None:
            return self.layout.data_parallel_size
        size = self.world["world_size"]
        return size if isinstance(size, int) else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """The plan as `to_dict` wrote it (extra keys, like the printed form, are ignored)."""
        return cls(strategies=list(data["strategies"]), world=dict(data["world"]),
                   **{slot: Claim.from_dict(data.get(slot)) for slot in EXCLUSIVE_SLOTS},  # get: older plans
                   **{args: {arg: dict(claim) for arg, claim in data[args].items()}
                      for args in ("lightning_strategy_args", "trainer_args")},
                   **{claims: [Claim.from_dict(c) for c in data[claims]]
                      for claims in ("model_transforms", "optimizer_transforms", "callbacks")},
                   notes=list(data["notes"]))


def make_plan(strategies: Dict[str, Strategy], trainer: Any, batch_size: Optional[int] = None,
              lightfleet: Optional[Mapping[str, Callable[[RunShape], Contribution]]] = None,
              cuda_available: Callable[[], bool] = no_cuda, data_parallel: Optional[Component] = None) -> Plan:
    """Combine the selected strategies' contributions, then lightfleet's own, into one plan.

    `strategies` maps name -> validated knobs (in selection order); `trainer` is the validated
    TrainerConfig (runner/config/schema.py); `batch_size` the data's batch size, if known.
    `lightfleet` maps who asks -> lightfleet's own contributors (the collective knobs, the fast
    path, the runner's callbacks): they contribute once the Lightning strategy and the precision
    are settled (RunShape.lightning_strategy, RunShape.precision), and their callbacks run after
    the user's. `cuda_available` answers RunShape.device_type. `data_parallel` is the Lightning
    strategy of a run of several processes whose strategies bring none (lightfleet's DDP: the
    caller names it, as this layer names no component).
    A strategy whose knobs do not fit the run (degrees against the world size) raises
    ConfigError; a broken plan rule raises Refusal naming the strategies involved.
    """
    world = World.of(trainer)
    plan = Plan(strategies=list(strategies), world=world.to_dict())
    run = RunShape(world, batch_size, dict(strategies), trainer, cuda_available)
    takes_comm_hook = True  # lightfleet's own DDP, unless a strategy brings its Lightning strategy
    for name, knobs in strategies.items():
        contribution: Contribution = knobs.contribute(run)
        if contribution.lightning_strategy is not None:
            takes_comm_hook = contribution.takes_comm_hook
        _add(plan, name, contribution, trainer)
    if plan.comm_hook is not None and plan.lightning_strategy is not None and not takes_comm_hook:
        raise Refusal(f"{plan.lightning_strategy.by} and {plan.comm_hook.by} both own the gradient communication "
                      f"hook: {plan.lightning_strategy.by}'s Lightning strategy "
                      f"({plan.lightning_strategy.component.target}) communicates gradients itself and takes no "
                      f"hook; choose one of them")
    if plan.lightning_strategy is None and (world.world_size != 1 or plan.comm_hook is not None):
        # Processes are started by lightfleet's launcher (or torchrun/SLURM); Lightning joins them.
        # A communication hook needs DDP even in one process: it may carry the update (dgc's momentum).
        if data_parallel is None:
            raise Refusal(f"a run of {world.world_size} process(es) whose strategies bring no Lightning strategy "
                          f"needs one, and make_plan was given none (data_parallel)")
        plan.lightning_strategy = Claim(RUNNER, data_parallel)
    settled = replace(run, precision=plan.precision.component.target if plan.precision else None,
                      lightning_strategy=plan.lightning_strategy.component.target if plan.lightning_strategy else None)
    for name, contribute in (lightfleet or {}).items():
        _add(plan, name, contribute(settled), trainer, callback_phase=AFTER_USER)
    plan.model_transforms.sort(key=lambda claim: PHASES.index(claim.phase))
    return plan


def _add(plan: Plan, name: str, contribution: Contribution, trainer: Any, callback_phase: Optional[str] = None) -> None:
    """`name`'s contribution into the plan, each claim marked with who asked."""
    for slot in EXCLUSIVE_SLOTS:
        component = getattr(contribution, slot)
        if component is None:
            continue
        held = getattr(plan, slot)
        if held is not None:
            raise Refusal(f"{held.by} and {name} both set the {slot.replace('_', ' ')}; choose one of them")
        setattr(plan, slot, Claim(name, component))
    _claim_lightning_strategy_args(plan, name, contribution.lightning_strategy_args)
    for phase, component in contribution.model_transforms:
        if phase not in PHASES:
            raise Refusal(f"strategy {name} adds a model transform in phase {phase!r}; phases: {', '.join(PHASES)}")
        _claim_model_transform(plan, name, component, phase)
    plan.optimizer_transforms.extend(Claim(name, component) for component in contribution.optimizer_transforms)
    _claim_trainer_args(plan, name, contribution.trainer_args, trainer)
    plan.callbacks.extend(Claim(name, component, callback_phase) for component in contribution.callbacks)
    plan.notes.extend(contribution.notes)


def _claim_model_transform(plan: Plan, name: str, component: Component, phase: str) -> None:
    """A transform asked for twice runs once: one claim naming both (the model is compiled once
    whether fast_path.compile or a collective fusion flag asks); asked with other arguments, refused."""
    held = next((claim for claim in plan.model_transforms
                 if claim.phase == phase and claim.component.target == component.target), None)
    if held is None:
        plan.model_transforms.append(Claim(name, component, phase))
    elif held.component == component:
        held.by = f"{held.by}, {name}"
    else:
        raise Refusal(f"{held.by} and {name} both add {component.target} ({phase}) with different arguments; "
                      f"choose one of them")


def _claim_lightning_strategy_args(plan: Plan, name: str, args: Dict[str, Any]) -> None:
    """Arguments for the plan's Lightning strategy: one value each, none the claim already sets."""
    strategy = plan.lightning_strategy
    for arg, value in args.items():
        if strategy is None:
            raise Refusal(f"{name} sets the Lightning strategy's {arg}, but the run has none (one process)")
        if arg in strategy.component.kwargs or arg in plan.lightning_strategy_args:
            held = plan.lightning_strategy_args.get(arg, {"by": strategy.by})["by"]
            raise Refusal(f"{held} and {name} both set the Lightning strategy's {arg}; choose one of them")
        plan.lightning_strategy_args[arg] = {"value": value, "by": name}


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


def format_plan(plan: Plan, everything: bool = True) -> str:
    """Human-readable plan: one line per decision that is switched on, each with who asked for it
    (a strategy, `collective` or `lightfleet`; plan.yaml holds the whole plan). Without
    `everything` (a run's console), the callbacks every run has (the runner's own) are left out."""
    world = plan.world
    lines = [f"strategies: {', '.join(plan.strategies) or '(none)'}",
             f"world: {world['world_size']} process(es) = {world['devices']} per node x {world['num_nodes']} node(s)"]

    def describe(claim: Claim) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in claim.component.kwargs.items())
        return f"{claim.component.target}({kwargs})  <- {claim.by}"

    def arguments(claimed: Dict[str, Dict[str, Any]]) -> List[str]:
        return [f"  {arg}={v['value']!r}  <- {v['by']}" for arg, v in claimed.items()]

    for slot, claim in (("precision", plan.precision), ("lightning strategy", plan.lightning_strategy),
                        ("optimizer replacement", plan.optimizer), ("gradient communication hook", plan.comm_hook)):
        if claim is not None:
            lines.append(f"{slot}: {describe(claim)}")
        if claim is not None and claim is plan.lightning_strategy:
            lines += arguments(plan.lightning_strategy_args)
    if plan.checkpoint_io is not None and (everything or plan.checkpoint_io.by != RUNNER):  # as the runner's callbacks
        lines.append(f"checkpoint io: {describe(plan.checkpoint_io)}")
    if plan.optimizer_transforms:
        lines.append("optimizer transforms (in order, after any replacement):")
        lines += [f"  {describe(c)}" for c in plan.optimizer_transforms]
    if plan.model_transforms:
        lines.append("model transforms (in order, in the model's configure_model):")
        lines += [f"  {i}. [{c.phase}] {describe(c)}" for i, c in enumerate(plan.model_transforms, 1)]
    if plan.trainer_args:
        lines.append("trainer arguments:")
        lines += arguments(plan.trainer_args)
    shown = [c for c in plan.callbacks if everything or c.by != RUNNER]
    if shown:
        lines.append("callbacks (in order):")
        lines += [f"  {describe(c)}" for c in shown if c.phase != AFTER_USER]
        lines.append("  (the config's callbacks.*)")
        lines += [f"  {describe(c)}" for c in shown if c.phase == AFTER_USER]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)
