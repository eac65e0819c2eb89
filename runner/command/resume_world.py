"""Resume on another number of processes (docs/reliability.md#resume-on-another-number-of-processes):
the command keeps the checkpoint's global batch G = data-parallel processes x micro-batch x
accumulation. From the record every checkpoint holds (runner/rank/resume.py:GlobalPosition) and
the new plan's data-parallel size D', it sets the accumulation A' = G / (D' x micro-batch) through
the knob that sets it for the selected strategies, plans again and says so in one plan line;
where no whole A' >= 1 does (or the plan refuses it: a pipeline schedule), it refuses before any
process starts, naming the process counts that work. The micro-batch is kept.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from omegaconf import OmegaConf

from runner.command.planning import plan_for
from runner.config.checks import RunSpec, selected_strategies
from runner.core.errors import ConfigError, Refusal, require
from runner.core.plan import Plan
from runner.records.files import PLAN_YAML
from runner.records.run_dir import CheckpointContents, read_plan

PIPELINE_KNOB = "strategy.pipeline.accumulate_steps"  # with micro_batch_size kept: data.batch_size follows
GLOBAL_ORDER_LINE = "sampler=global_order(self.trainer, dataset, B)"  # runner/data/order.py, a user's train_dataloader


def keep_global_batch(spec: RunSpec, plan: Plan, checkpoint: CheckpointContents, path: Path) -> Tuple[RunSpec, Plan]:
    """The run's spec and plan for resuming `checkpoint` (at `path`): unchanged on the checkpoint's
    world (or where the settings already give its global batch), else with the accumulation that
    keeps it and a plan line saying both worlds and both settings."""
    record, devices = checkpoint.record, spec.trainer.devices
    if plan.data_parallel_size is None:  # trainer.devices=auto: Lightning counts the processes once they start
        return spec, plan
    if record is None or record["batch"]["global"] is None:  # where it stands is known on its own world only
        before = written_on(path)
        if before is not None and before != world_of(plan):
            raise ConfigError("trainer.devices", devices, f"ckpt_path {path} holds no record of its global batch "
                              f"(written before lightfleet kept one, or by a loader without a batch_size): its "
                              f"position in the epoch is per rank, for the {before[0]} process(es) of its run; "
                              f"resume it on those")
        return spec, plan
    old = record["world"]
    another_world = (old["processes"], old["data_parallel"]) != world_of(plan)
    require(not another_world or record["data"]["order"] == "global", "trainer.devices", devices,
            f"ckpt_path {path} was written by a training loader with a sampler of its own, whose position in the "
            f"epoch is per rank: resume it on {old['processes']} process(es), or give the data module's "
            f"train_dataloader `{GLOBAL_ORDER_LINE}` (runner/data/order.py)")
    knob = accumulation_knob(spec)
    try:
        spec, plan, accumulation = kept(spec, plan, record, knob, explicit=knob in typed_keys())
    except Unkept as unkept:
        working = devices_that_work(spec, record, knob)
        counts = [str(count) for count in working]
        nodes = spec.trainer.num_nodes
        use = (f"use trainer.devices={' or '.join(filter(None, [', '.join(counts[:-1]), counts[-1]]))}"
               f"{f' (per node, on {nodes} nodes)' if nodes > 1 else ''}" if counts
               else "no number of processes does with this micro-batch")
        raise ConfigError("trainer.devices", devices, f"{unkept}; {use}") from None
    if another_world or accumulation != record["batch"]["accumulation"]:
        plan.notes.append(world_line(record, plan, micro_batch(spec, record), accumulation, knob))
    return spec, plan


class Unkept(Exception):
    """The checkpoint's global batch cannot be kept on this world: why, for the refusal's line."""


def kept(spec: RunSpec, plan: Plan, record: Mapping[str, Any], knob: str,
         explicit: bool = False) -> Tuple[RunSpec, Plan, int]:
    """`spec` and `plan` with the accumulation that keeps the record's global batch on the plan's
    world, and that accumulation. An `explicit` knob that gives another global batch is refused,
    naming the value that keeps it; Unkept where none does."""
    global_batch, micro = record["batch"]["global"], micro_batch(spec, record)
    data_parallel, given = plan.data_parallel_size, OmegaConf.select(spec.cfg, knob)
    accumulation, left = divmod(global_batch, data_parallel * micro)
    if data_parallel * micro * given == global_batch:
        return spec, plan, given
    shape = f"the checkpoint's global batch of {global_batch} ({batch_shape(record)})"
    here = f"{data_parallel} data-parallel process(es) x micro-batch {micro}"
    if left or not accumulation:
        raise Unkept(f"{shape} is no whole multiple of {here}")
    require(not explicit, knob, given, f"gives a global batch of {data_parallel * micro * given} on {here}, not "
            f"{shape}: use {knob}={accumulation}")
    spec = with_settings(spec, accumulation_settings(spec, knob, accumulation, micro))
    try:
        return spec, plan_for(spec), accumulation
    except (ConfigError, Refusal) as refused:
        raise Unkept(f"{shape} needs {knob}={accumulation} on {here}, which the plan refuses ({refused})") from None


def devices_that_work(spec: RunSpec, record: Mapping[str, Any], knob: str) -> List[int]:
    """The trainer.devices (per node, on the run's nodes) on which the record's global batch is
    kept: each planned as a run on it would be (the layout's rules, the pipeline's schedules)."""
    batch, world = record["batch"], record["world"]
    model_parallel = world["processes"] // world["data_parallel"]  # pipeline stages x tensor-parallel ranks
    most = batch["global"] // micro_batch(spec, record) * model_parallel // spec.trainer.num_nodes
    working = []
    for devices in range(1, min(most, 256) + 1):
        candidate = with_settings(spec, {"trainer.devices": devices})
        try:
            kept(candidate, plan_for(candidate), record, knob)
        except (ConfigError, Refusal, Unkept):
            continue
        working.append(devices)
    return working


def accumulation_knob(spec: RunSpec) -> str:
    """The knob that sets the accumulation for the selected strategies: the pipeline's micro-batches
    per step; gradient_merge's or sharding's (unless the run set Lightning's own beside them);
    else Lightning's."""
    selected, trainer_value = spec.strategies, spec.trainer.accumulate_grad_batches
    if "pipeline" in selected:
        return PIPELINE_KNOB
    for name, knob in (("gradient_merge", "k_steps"), ("sharding", "gradient_merge_acc_step")):
        if name in selected and (getattr(selected[name], knob) > 1 or trainer_value == 1):
            return f"strategy.{name}.{knob}"
    return "trainer.accumulate_grad_batches"


def micro_batch(spec: RunSpec, record: Mapping[str, Any]) -> int:
    """The run's micro-batch: the pipeline's micro_batch_size, else data.batch_size (the record's
    where the data's config has none: a user's loader keeps its own)."""
    pipeline = spec.strategies.get("pipeline")
    if pipeline is not None:
        return pipeline.micro_batch(spec.batch_size)
    return spec.batch_size or record["batch"]["micro"]


def accumulation_settings(spec: RunSpec, knob: str, accumulation: int, micro: int) -> Dict[str, int]:
    """The keys to set for `accumulation`: the pipeline's loader batch is its micro-batches' samples."""
    if knob != PIPELINE_KNOB:
        return {knob: accumulation}
    batch = {"data.batch_size": micro * accumulation} if spec.batch_size is not None else {}
    return {knob: accumulation, "strategy.pipeline.micro_batch_size": micro, **batch}


def with_settings(spec: RunSpec, settings: Mapping[str, Any]) -> RunSpec:
    """A copy of `spec` with `settings` in its config (the config the run saves holds what it ran with)."""
    cfg = copy.deepcopy(spec.cfg)
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value)
    return RunSpec(cfg, selected_strategies(cfg), OmegaConf.to_object(cfg.trainer))


def typed_keys() -> set:
    """The keys the command line sets (a value typed there is the user's, not the saved run's)."""
    from hydra.core.hydra_config import HydraConfig

    return {override.lstrip("+~").partition("=")[0] for override in HydraConfig.get().overrides.task}


def world_of(plan: Plan) -> Tuple[Any, Optional[int]]:
    return plan.world["world_size"], plan.data_parallel_size


def written_on(path: Path) -> Optional[Tuple[Any, Optional[int]]]:
    """The world of the run whose checkpoints/ holds `path`, from its plan.yaml (None: not a run's)."""
    run = path.parent.parent
    return world_of(read_plan(run)) if (run / PLAN_YAML).is_file() else None


def processes(count: Any) -> str:
    return f"{count} process{'' if count == 1 else 'es'}"


def batch_shape(record: Mapping[str, Any]) -> str:
    world, batch = record["world"], record["batch"]
    return (f"{processes(world['processes'])} ({world['data_parallel']} data-parallel) x micro-batch "
            f"{batch['micro']} x accumulation {batch['accumulation']}")


def world_line(record: Mapping[str, Any], plan: Plan, micro: int, accumulation: int, knob: str) -> str:
    """The plan's line: both worlds and both settings."""
    return (f"resume on another world: {batch_shape(record)} = global batch {record['batch']['global']} -> "
            f"{processes(plan.world['world_size'])} ({plan.data_parallel_size} data-parallel) x {micro} x "
            f"{accumulation} ({knob}={accumulation})")
