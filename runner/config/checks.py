"""Check a composed config: merge it onto the schema (types, ranges, finite numbers), apply the
cross-field rules that rewrite it (GEO-SGD as localsgd, two-level allreduce as hybrid sharding),
resolve its interpolations, and make its plan once the table allows its strategies."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from hydra.errors import HydraException

from runner import strategies
from runner.config import schema
from runner.config.compose import explain
from runner.core.errors import ConfigError, first_line, require
from runner.core.plan import Plan
from runner.core.world import World, devices_for


@dataclass
class RunSpec:
    """A composed, validated run: the config and the strategies' checked knobs."""

    cfg: DictConfig  # merged onto the schema; interpolations not yet resolved
    strategies: Dict[str, Any]  # name -> schema dataclass instance, in selection order
    trainer: schema.TrainerConfig

    @property
    def batch_size(self) -> Optional[int]:
        """The data's batch size per step and process, when its config has one."""
        value = self.cfg.data.get("batch_size")
        return value if isinstance(value, int) else None


def validate(cfg: DictConfig) -> RunSpec:
    """The schema, then the cross-field rules: the preflight's two stages (runner/command/preflight.py)
    for callers that need both at once (auto's trials, tests)."""
    spec = check_schema(cfg)
    apply_cross_field_rules(spec)
    return spec


def check_schema(cfg: DictConfig) -> RunSpec:
    """Merge the composed config onto the schema: types, and the ranges each node's dataclass and
    each selected strategy's dataclass check as they are built (__post_init__); every number finite."""
    try:
        # Through a plain container: merged as it comes from Hydra (typed RunConfig already), a key
        # added with `+key=` would pass the schema unseen.
        plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        merged = OmegaConf.merge(OmegaConf.structured(schema.RunConfig), plain)
        knobs = {node: OmegaConf.to_object(merged[node])
                 for node in ("measure", "collective", "parameter_server", "fast_path", "rehearse")}
        strategies = selected_strategies(merged)
        trainer = OmegaConf.to_object(merged.trainer)
        for key, node in [*knobs.items(), ("trainer", trainer), *((f"strategy.{n}", k) for n, k in strategies.items())]:
            require_finite(key, node)
    except OmegaConfBaseException as error:
        raise explain(error) from None
    return RunSpec(merged, strategies, trainer)


def selected_strategies(merged: DictConfig) -> Dict[str, Any]:
    """Each selected strategy's knobs dataclass (built: its ranges checked), in selection order."""
    return {name: OmegaConf.to_object(node) for name, node in merged.strategy.items() if node is not None}


def apply_cross_field_rules(spec: RunSpec) -> None:
    """The rules between keys of different nodes. Three rewrite the config, so that the config the
    run saves says what ran: parameter_server.mode=geo selects localsgd, the two-level allreduce
    sets hybrid sharding's degrees, and trainer.enable_checkpointing=false leaves out the
    checkpoint callback. The others refuse: evaluate without a checkpoint, test or evaluate with
    the pipeline."""
    cfg = spec.cfg
    try:
        as_localsgd(OmegaConf.to_object(cfg.parameter_server), cfg)
        as_hybrid_sharding(OmegaConf.to_object(cfg.collective), cfg)
        without_checkpoint_callbacks(cfg)
        spec.strategies = selected_strategies(cfg)
    except OmegaConfBaseException as error:
        raise explain(error) from None
    require(cfg.ckpt_path is not None or not cfg.evaluate, "evaluate", True,
            "needs ckpt_path=PATH|last: the weights to evaluate")
    require(not cfg.test or "pipeline" not in spec.strategies, "test", True,
            "the pipeline strategy runs fit and validation only")
    require(not cfg.evaluate or "pipeline" not in spec.strategies, "evaluate", True,
            "the pipeline strategy builds its stages in fit only; export the checkpoint to one file "
            "(python -m plugins.sharding export CKPT model.pt) and evaluate it without the pipeline: "
            "lightfleet eval RUN strategy.pipeline=null trainer.devices=1 ckpt_path=model.pt")


def check_epoch(spec: RunSpec, plan: Plan) -> None:
    """An epoch of the built-in synthetic data (whose config says its num_train samples) is
    num_train // G optimizer steps, in global batches of G = data-parallel processes x
    data.batch_size x accumulation (runner/data/order.py: the samples short of a whole global
    batch sit the epoch out). Refused here, before the ranks start: data too small for one global
    batch (an empty epoch), and a count in trainer.val_check_interval (optimizer steps within an
    epoch, unless trainer.check_val_every_n_epoch=null counts them across epochs) above an epoch's,
    which Lightning refuses in every rank."""
    trainer, data, batch_size = spec.trainer, spec.cfg.data, spec.batch_size
    num_train, processes = data.get("num_train"), plan.data_parallel_size
    if not (str(data.get("_target_")).startswith("runner.data.") and isinstance(num_train, int)
            and bool(batch_size) and bool(processes)):
        return
    claimed = plan.trainer_args.get("accumulate_grad_batches")
    accumulation = claimed["value"] if claimed else trainer.accumulate_grad_batches
    global_batch = processes * batch_size * accumulation
    shape = (f"global batches of {global_batch} = {processes} data-parallel process(es) x data.batch_size={batch_size} "
             f"x {accumulation} accumulated")
    steps = num_train // global_batch
    require(steps >= 1, "data.num_train", num_train, f"fewer samples than one of the epoch's {shape}: at least "
            f"{global_batch}, or a smaller data.batch_size")
    interval = trainer.val_check_interval
    within_epochs = (isinstance(interval, int) and not isinstance(interval, bool)
                     and trainer.check_val_every_n_epoch is not None and trainer.limit_val_batches not in (0, 0.0)
                     and not trainer.overfit_batches and not trainer.fast_dev_run)
    if not within_epochs:
        return
    limit = trainer.limit_train_batches
    epoch = steps if limit is None else min(steps, limit) if isinstance(limit, int) else int(steps * limit)
    require(interval <= epoch, "trainer.val_check_interval", interval,
            f"more than the {epoch} optimizer steps of an epoch (data.num_train={num_train} in {shape}): at most "
            f"{epoch}, or trainer.check_val_every_n_epoch=null to count steps across epochs")


def require_finite(key: str, node: Any) -> None:
    """Every number of a knob dataclass is finite: inf or nan is refused, naming the knob."""
    if is_dataclass(node):
        for item in fields(node):
            require_finite(f"{key}.{item.name}", getattr(node, item.name))
    elif isinstance(node, (list, tuple)):
        require(all(not isinstance(item, float) or math.isfinite(item) for item in node), key, node,
                "every number must be finite")
    elif isinstance(node, float):
        require(math.isfinite(node), key, node, "must be a finite number")


def as_localsgd(parameter_server: schema.ParameterServerConfig, merged: DictConfig) -> None:
    """GEO-SGD is local SGD: parameter_server.mode=geo selects localsgd with its k_steps, in the
    config itself, so the config the run saves says what ran."""
    if parameter_server.mode != "geo":
        return
    localsgd = merged.strategy.localsgd
    if localsgd is None:
        merged.strategy.localsgd = strategies.schemas()["localsgd"](k_steps=parameter_server.k_steps)
    else:
        require(localsgd.k_steps == parameter_server.k_steps, "strategy.localsgd.k_steps", localsgd.k_steps,
                f"parameter_server.mode=geo runs as localsgd with parameter_server.k_steps={parameter_server.k_steps}; "
                f"set one of them")


def without_checkpoint_callbacks(merged: DictConfig) -> None:
    """trainer.enable_checkpointing=false drops the callbacks group's ModelCheckpoint (the default
    config has one), which Lightning would refuse beside it in every rank."""
    if merged.trainer.enable_checkpointing is not False:
        return
    for name in [name for name, node in merged.callbacks.items()
                 if node and str(node.get("_target_", "")).rpartition(".")[2] == "ModelCheckpoint"]:
        del merged.callbacks[name]


def as_hybrid_sharding(collective: schema.CollectiveConfig, merged: DictConfig) -> None:
    """Fleet's two-level allreduce is, for sharded runs, hybrid sharding's 2-D mesh: sharding
    groups of hierarchical_allreduce_inter_nranks ranks (1, Fleet's default: a node's processes),
    replicated across the rest. Set as strategy.sharding's degree and dp_degree in the config."""
    sharding = merged.strategy.sharding
    if not collective.use_hierarchical_allreduce or sharding is None:
        return
    world = World.of(merged.trainer)
    inner = collective.hierarchical_allreduce_inter_nranks
    inner = inner if inner > 1 else world.devices
    key = "collective.hierarchical_allreduce_inter_nranks"
    require(isinstance(inner, int), "trainer.devices", world.devices, "must be a number with collective.use_hierarchical_allreduce")
    groups = inner * sharding.mp_degree * sharding.pp_degree
    world_size = world.known_size("collective.use_hierarchical_allreduce")
    require(world_size % groups == 0, key, inner,
            f"sharding groups of {inner} rank(s) (x mp_degree x pp_degree) must divide the {world_size} processes: "
            f"set {devices_for(-(-world_size // groups) * groups, world.num_nodes)}, or groups that divide {world_size}")
    degrees = {"degree": inner, "dp_degree": world_size // groups}
    for name, value in degrees.items():
        default = getattr(type(OmegaConf.to_object(sharding))(), name)
        require(sharding[name] in (default, value), f"strategy.sharding.{name}", sharding[name],
                f"collective.use_hierarchical_allreduce sets it to {value}; set one of them")
        sharding[name] = value


def resolved(cfg: DictConfig) -> Dict[str, Any]:
    """The config as plain data, every interpolation resolved; one that cannot be is one line
    naming its key (`${now:}`, `${oops}`)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except (OmegaConfBaseException, HydraException, ValueError) as error:
        key = getattr(error, "full_key", None) or getattr(error.__cause__, "full_key", None)
        if not key:
            raise explain(error) from None
        raw: Any = OmegaConf.to_container(cfg, resolve=False)  # the `${...}` as written
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        raise ConfigError(key, raw, f"cannot be resolved: {first_line(error.__cause__ or error)}") from None
