"""The preflight: every check a command makes before anything is created, in order.

A refusal is one line and exit status 2 with no directory made and no process started. The
command runs the stages once per job and keeps what they found (the checked config, the plan,
the model built on the meta device) for the job: Hydra's task function (runner/command/job.py)
takes it instead of checking again, and a rank reads the config.yaml and plan.yaml the job saved
and re-checks nothing. A job the command never saw (one an optimising sweeper such as Optuna
chooses, or one a launcher runs in another process) runs the job stages itself.

`STAGES` is the list, in order; docs/preflight.md is generated from it (`python -m
runner.command.preflight`), and tests/runner/test_preflight.py checks that it is current.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

from runner.config.compat import check, load_table, strategies_from_argv
from runner.core.errors import ConfigError, require
from runner.core.plan import Plan
from runner.core.world import World, check_multi_node

# The command imports this module before it knows the run is allowed: what the job stages need
# (Hydra, torch, the user's code) is imported by each stage when it runs.
if TYPE_CHECKING:
    from omegaconf import DictConfig

    from runner.config.checks import RunSpec
    from runner.records.run_dir import CheckpointContents


@dataclass
class Flight:
    """What the job stages have found so far."""

    cfg: "DictConfig"  # the job's composed config, without Hydra's node
    spec: Optional["RunSpec"] = None
    plan: Optional[Plan] = None
    model: Any = None  # the user's model built on the meta device (None: its constructor needs real tensors)
    datamodule: Any = None  # the user's data module (None: its constructor needs real tensors)
    start_step: Optional[int] = None  # the step ckpt_path was saved at (None: no ckpt_path)
    checkpoint: Optional["CheckpointContents"] = None  # what ckpt_path holds (None: no ckpt_path)
    notes: List[str] = field(default_factory=list)  # what the stages before the plan have to say in it
    rehearsal: bool = False  # checked for `lightfleet rehearse`: planned for the cluster, not this machine

    def for_the_job(self) -> "Flight":
        """What the job takes: the checked config, plan and start step (the meta-device model, the
        data module and the checkpoint's contents stay here: a launcher may carry the flight to
        another process)."""
        return replace(self, model=None, datamodule=None, checkpoint=None)


@dataclass(frozen=True)
class Stage:
    name: str
    refuses: str  # what it checks, for docs/preflight.md
    run: Callable[..., Any]
    per_job: bool = True  # runs on each job's Flight; else the command runs it (runner/command/cli.py)
    rehearsal: str = "runs"  # in `lightfleet rehearse`: "runs", "only" (a rehearsal's own), or why it skips it

    def runs_in(self, rehearsal: bool) -> bool:
        return self.rehearsal in ("runs", "only") if rehearsal else self.rehearsal != "only"


def command_line(args: Sequence[str]) -> None:
    """The first stage: a plain `strategy=[...]` on the command line (not a sweep, not a flag that
    only shows something) wins over any experiment's, so it is decided at once."""
    selected = strategies_from_argv(args)
    if selected is not None:
        check(selected, load_table())


def compose(overrides: Sequence[str], config_dir: Optional[str], config_name: str, multirun: bool = False) -> "DictConfig":
    """Hydra's composition, as the job will get it (with Hydra's own node)."""
    from hydra.types import RunMode

    from runner.config.compose import compose_config

    return compose_config(overrides, config_dir, config_name, RunMode.MULTIRUN if multirun else RunMode.RUN,
                          with_hydra=True)


def typed_strategy_list(flight: Flight) -> None:
    """The job's own overrides (a sweep job's too) say whether it has a plain `strategy=[...]`."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from runner.config.compose import keep_typed_selection

    # As typed: an override holding `${...}` is the schema stage's to refuse, not resolved here.
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
    note = keep_typed_selection(flight.cfg, overrides)
    flight.notes += [note] if note else []


def schema_and_ranges(flight: Flight) -> None:
    from runner.config.arguments import check_given
    from runner.config.checks import check_schema, resolved
    from runner.config.values import check_node

    flight.spec = check_schema(flight.cfg)
    run = resolved(flight.spec.cfg)
    for key in ("model", "data"):
        check_given(key, run.get(key) or {})
        check_node(key, run.get(key) or {})


def cross_field_rules(flight: Flight) -> None:
    from runner.config.checks import apply_cross_field_rules

    apply_cross_field_rules(flight.spec)


def rehearsed_device(flight: Flight) -> None:
    from omegaconf import OmegaConf

    World.of(flight.spec.trainer).known_size("lightfleet rehearse")
    OmegaConf.to_object(flight.spec.cfg.rehearse).target(flight.spec.trainer.accelerator)


def table(flight: Flight) -> None:
    check(list(flight.spec.strategies), load_table())


def plan(flight: Flight) -> None:
    from runner.command.planning import plan_for
    from runner.command.resume_world import keep_global_batch
    from runner.config.checks import check_epoch

    # A rehearsal plans for the cluster's devices: CUDA unless the run asks for the CPU.
    flight.plan = plan_for(flight.spec, cuda_available=(lambda: True) if flight.rehearsal else None)
    if flight.checkpoint is not None and not flight.spec.cfg.evaluate:
        flight.spec, flight.plan = keep_global_batch(flight.spec, flight.plan, flight.checkpoint,
                                                     Path(flight.spec.cfg.ckpt_path))
    check_epoch(flight.spec, flight.plan)
    flight.plan.notes[:0] = flight.notes  # first, as the selection is the plan's first line


def world_and_devices(flight: Flight) -> None:
    from runner.command.launch import check_devices, keep_forkable

    world = World(**flight.plan.world)
    keep_forkable(world)
    check_multi_node(world)
    check_accelerator(flight.spec.trainer.accelerator)
    check_devices(flight.spec.trainer, world)


def check_accelerator(accelerator: str) -> None:
    """An accelerator Lightning knows (mps, tpu, ...) that this machine lacks is refused here, not
    when a rank builds its Trainer (gpu and cuda: check_devices, which also counts them)."""
    from pytorch_lightning.accelerators import AcceleratorRegistry

    if accelerator in ("auto", "gpu", "cuda") or accelerator not in AcceleratorRegistry:
        return
    if not AcceleratorRegistry[accelerator]["accelerator"].is_available():
        raise ConfigError("trainer.accelerator", accelerator, "this machine has no such device; use cpu or auto")


def targets(flight: Flight) -> None:
    from runner.config.arguments import check_arguments, check_builds, check_kind, check_logger_package
    from runner.config.checks import resolved

    run = resolved(flight.spec.cfg)
    check_kind("model", run["model"])
    check_kind("data", run["data"])
    check_arguments("model", run["model"])
    check_arguments("data", run["data"])
    for group in ("callbacks", "logger"):
        for name, node in (run.get(group) or {}).items():
            if node:
                check_arguments(f"{group}.{name}", node)
    for name, node in (run.get("logger") or {}).items():
        if node:
            check_logger_package(f"logger.{name}", node)
    flight.model, flight.datamodule = check_builds(run["model"], run["data"])


def the_model_on_one_batch(flight: Flight) -> None:
    from runner.config.arguments import check_one_batch, check_sizes
    from runner.config.checks import resolved

    if flight.model is not None and flight.datamodule is not None:
        run = resolved(flight.spec.cfg)
        check_sizes(flight.model, flight.datamodule, run["model"], run["data"])
        check_one_batch(flight.model, flight.datamodule, run["model"], run["data"])


def plan_on_the_model(flight: Flight) -> None:
    from runner.rank.build import check_plan_on_model

    if flight.model is not None:
        check_plan_on_model(flight.model, flight.plan)


def checkpoint(flight: Flight) -> None:
    from hydra.core.hydra_config import HydraConfig

    from runner.records.run_dir import find_checkpoint, verified_contents

    run = flight.spec.cfg
    if run.ckpt_path is not None:  # relative to where the command ran, also after hydra.job.chdir
        path = find_checkpoint(run, Path(HydraConfig.get().runtime.cwd))
        flight.checkpoint, unverified = verified_contents(path, run.evaluate)
        run.ckpt_path = str(path)
        saved, steps = flight.checkpoint.step, run.trainer.max_steps
        require(run.evaluate or steps is None or steps < 0 or saved < steps, "trainer.max_steps", steps,
                f"ckpt_path {path} was saved at step {saved}: nothing is left to train; raise it "
                f"(e.g. trainer.max_steps={2 * max(saved, 1)})")
        flight.start_step = saved
        flight.notes += [unverified] if unverified else []


def checkpoint_on_the_model(flight: Flight) -> None:
    from runner.records.run_dir import check_weights_fit

    if flight.checkpoint is not None and flight.model is not None:
        check_weights_fit(Path(flight.spec.cfg.ckpt_path), flight.checkpoint, flight.model)


def run_directory(cfg: "DictConfig", plan: Plan, rehearsal: bool = False) -> Tuple[Path, str]:
    """The last stage of a run: its directory (hydra.run.dir), and the subdirectory this copy of the
    command records into (a second node's, or an externally launched rank's; a rehearsal is one
    command for every node)."""
    from runner.records.run_dir import records_subdir, reserve_dir

    check_directories(cfg, "paths.output_dir")
    subdir = "" if rehearsal else records_subdir(World(**plan.world))
    return reserve_dir(cfg, "hydra.run.dir", "paths.output_dir", subdir), subdir


def sweep_directory(cfg: "DictConfig") -> Path:
    """The last stage of a sweep: its directory (hydra.sweep.dir)."""
    from runner.records.run_dir import reserve_dir

    check_directories(cfg, "paths.sweep_dir")
    return reserve_dir(cfg, "hydra.sweep.dir", "paths.sweep_dir")


def check_directories(cfg: "DictConfig", paths_key: str) -> None:
    """Directories named by the user that a run cannot write into: an empty `paths_key` (it would be
    the working directory itself), a callback's dirpath that is an existing file."""
    from omegaconf import OmegaConf

    require(str(OmegaConf.select(cfg, paths_key)).strip() != "", paths_key, "",
            "must name a directory (relative paths are taken from where lightfleet runs)")
    for name, node in (cfg.get("callbacks") or {}).items():
        dirpath = node.get("dirpath") if node else None
        if dirpath and Path(str(dirpath)).expanduser().is_file():
            raise ConfigError(f"callbacks.{name}.dirpath", str(dirpath), "is a file; a checkpoint directory is needed")


STAGES = (
    Stage("table, from the command line",
          "a plain `strategy=[...]` on the command line against conf/compat.yaml, before Hydra or torch "
          "is imported (a forbidden combination costs a fraction of a second)", command_line, per_job=False),
    Stage("compose",
          "Hydra composes conf/, experiments/ and --config-dir with the overrides: unknown groups, options "
          "and keys (with \"did you mean\", or the `+` a key its config leaves out needs), malformed overrides, "
          "config files that are not YAML (file, line, column), unknown flags, a bool knob given anything but "
          "true or false; for a sweep, every job of a basic sweep",
          compose, per_job=False),
    Stage("strategy list, from the command line",
          "a plain `strategy=[...]` on the command line is the whole selection: a config file's knobs for a "
          "strategy it leaves out (an experiment's `strategy.amp.dtype`) are dropped, with a note in the plan; a "
          "knob typed for such a strategy is refused", typed_strategy_list),
    Stage("schema and ranges", "every value against the schema's type, every knob against its range (the "
          "strategy's dataclass in runner/strategies/, runner/config/schema.py), every number finite; the built-in model's and data's counts, sizes and paths "
          "(runner/config/values.py: a batch size of 0, a data.root that is missing or cannot be read) and their mandatory values given, before "
          "torch is imported",
          schema_and_ranges),
    Stage("cross-field rules", "parameter_server.mode=geo becomes localsgd, the two-level allreduce sets hybrid "
          "sharding's degrees (each against an explicit setting), evaluate needs ckpt_path, test excludes the "
          "pipeline", cross_field_rules),
    Stage("the rehearsed device", "a process count (trainer.devices a number); trainer.accelerator auto, "
          "gpu, cuda (the cluster's GPUs) or cpu; rehearse.device or rehearse.device_memory_gb gives the memory "
          "each rank must fit (with trainer.accelerator=cpu, rehearse.device_memory_gb must)", rehearsed_device,
          rehearsal="only"),
    Stage("table", "the selected strategies (also an experiment's, or geo's localsgd) against conf/compat.yaml",
          table),
    Stage("checkpoint", "ckpt_path exists, its bytes match its manifest (sha256; damaged or truncated: "
          "refused naming the newest intact checkpoint beside it; none: read, with a note in the plan), it loads as data "
          "only (torch's weights-only unpickler: a pickle that calls code is refused); `last` is the newest "
          "last.ckpt of the same experiment and model under paths.root_dir, named in one line; unless "
          "evaluating, its step is below trainer.max_steps (a finished run resumed trains nothing); its record "
          "of the world and global batch it was written with is read for the plan", checkpoint),
    Stage("plan", "the strategies' contributions combined: one claim per exclusive slot, trainer arguments "
          "against the user's, degrees against the world size, the collective knobs against the trainer, "
          "pipeline schedules against the backend and gradient clipping, the fast path against the strategies "
          "(compile, the fused optimizer) and the device (the attention kernel); where the data's config says "
          "its size (the built-in synthetic data), an epoch of at least one global batch and a count in "
          "trainer.val_check_interval within an epoch's optimizer steps; resuming ckpt_path on another number of "
          "processes, the accumulation that keeps its global batch, set through the strategies' knob (refused "
          "where none does, naming the process counts that do; refused for a checkpoint whose position is per "
          "rank: runner/command/resume_world.py)", plan),
    Stage("world and devices", "multi-node rendezvous variables; the accelerator and devices this machine "
          "has (GPU count and ids, device ids on CPU)", world_and_devices,
          rehearsal="a rehearsal builds every rank on fake tensors in a fake process group, on this machine: "
                    "the cluster's rendezvous variables and devices are not needed here"),
    Stage("targets and the model on the meta device", "the model and the data are a LightningModule and a "
          "LightningDataModule; every `_target_` node's arguments against its constructor (names, required "
          "ones, types); the loggers' packages installed; the model built on the meta device and the data module "
          "built, once, so their constructors' refusals stop the command", targets),
    Stage("the model on one batch", "the data's classes and vocabulary against the model's (num_classes, "
          "vocab_size); the meta-device model's training_step on one batch of the data, moved to "
          "the meta device: a model and data that do not go together (token ids for an image model, float "
          "features for an embedding) are refused by torch", the_model_on_one_batch),
    Stage("the plan on the model", "the plan's model transforms (module names of recompute and amp, pipeline "
          "split points, blocks enough for the stages and a loss()), its optimizer replacement (the optimizer "
          "family lars, lamb and dgc need) and the model's optimizer's own arguments (a negative learning rate) on the meta-device model", plan_on_the_model),
    Stage("the checkpoint on the model", "ckpt_path's weights fit the meta-device model (names and shapes)",
          checkpoint_on_the_model),
    Stage("directories", "the run or sweep directory: named, writable, not a file, not inside a run, not "
          "holding a run or sweep; a checkpoint callback's dirpath not a file; taken by this command in one "
          "atomic step (its owner.yaml, with a node's or rank's record subdirectory), refused while another "
          "command holds it (a clock-named one taken gets a suffix)", run_directory, per_job=False),
)
# What only a rank can know, checked there (a failure ends the run with the rank's one line).
RANK_ONLY = (
    "what needs the process group: how many split points each pipeline stage takes, DDP/FSDP wrapping, "
    "the communication hooks' state (dgc)",
    "the loggers and the callbacks, instantiated in each rank",
    "whether torch has a fused step for the optimizer the model builds and for its parameters "
    "(fast_path.fused_optimizer: one log line where it has none)",
    "the user's code itself: forward, loss, data loading",
)
JOB_STAGES = tuple(stage for stage in STAGES if stage.per_job)


def job_overrides(overrides: Sequence[str]) -> Tuple[str, ...]:
    """The overrides as Hydra hands them to the job (hydra.overrides.task): without hydra.* keys."""
    return tuple(o for o in overrides if not o.lstrip("+~").startswith("hydra"))


def check_job(cfg: "DictConfig", rehearsal: bool = False) -> Flight:
    """Run the job stages on `cfg`, a composed config (those of a `rehearsal`, for `lightfleet
    rehearse`). With its `hydra` node (as the command composes it), `${hydra:...}` is made to
    resolve as it will in the job and the stages check the config without it; without one (as a
    job gets it), Hydra has set that up already."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    if "hydra" in cfg:
        HydraConfig.instance().set_config(cfg)
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    flight = Flight(cfg, rehearsal=rehearsal or auto_rehearses(cfg))
    for stage in JOB_STAGES:
        if stage.runs_in(flight.rehearsal):
            stage.run(flight)
    return flight


def auto_rehearses(cfg: "DictConfig") -> bool:
    """strategy=[auto] with strategy.auto.mode=rehearse chooses for a cluster this machine is not: it is
    checked as `lightfleet rehearse` checks a run (docs/auto.md, "Choosing for a cluster")."""
    return auto_selected(cfg) and cfg.strategy.auto.get("mode") == "rehearse"


def auto_selected(cfg: "DictConfig") -> bool:
    return (cfg.get("strategy") or {}).get("auto") is not None


def document() -> str:
    """docs/preflight.md."""
    lines = ["# What lightfleet checks before anything starts", "",
             "Generated by `python -m runner.command.preflight` from `runner/command/preflight.py`. Every check",
             "below runs in the command, in this order, before any directory is made or any process started;",
             "a refusal is one line naming the key, the value and what is allowed, with exit status 2.", ""]
    lines += [f"{number}. **{stage.name}**{' (`lightfleet rehearse` only)' if stage.rehearsal == 'only' else ''}: "
              f"{stage.refuses}." for number, stage in enumerate(STAGES, 1)]
    lines += ["", "A rehearsal (`lightfleet rehearse`, docs/rehearse.md, and `strategy=[auto]` with "
                  "`strategy.auto.mode=rehearse`, docs/auto.md) skips:", ""]
    lines += [f"- **{stage.name}**: {stage.rehearsal}." for stage in STAGES if stage.rehearsal not in ("runs", "only")]
    lines += ["", "What only a rank can know is checked there:", ""]
    lines += [f"- {item}." for item in RANK_ONLY]
    return "\n".join(lines) + "\n"


def stage_names() -> List[str]:
    return [stage.name for stage in STAGES]


if __name__ == "__main__":
    print(document(), end="")
