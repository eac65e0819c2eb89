"""The plan: slots, phase order, conflicts, and its printed form; lightfleet's own contributions
(the collective knobs', the runner's callbacks) in it, as `plan_for` makes it for the command."""
from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

from runner.command.planning import plan_for
from runner.config.collective import LIGHTFLEET_DDP, BuildStrategyConfig, CollectiveConfig, ExecutionStrategyConfig
from runner.core.contribution import Component, Contribution
from runner.core.errors import ConfigError, Refusal
from runner.core.paths import EXPERIMENTS_DIR
from runner.core.plan import AFTER_USER, PHASES, Plan, format_plan, make_plan
from runner.config.checks import check_epoch
from runner.config.schema import TrainerConfig
from runner.strategies.amp import AmpConfig
from runner.strategies.gradient_merge import GradientMergeConfig
from runner.strategies.pipeline import PipelineConfig
from runner.strategies.recompute import RecomputeConfig
from runner.strategies.sharding import ShardingConfig
from tests.helpers.data_files import on_device

# Plans as the command makes them (runner/command/planning.py): lightfleet's DDP for several processes.
plan_of = partial(make_plan, data_parallel=LIGHTFLEET_DDP)


COMPILING = CollectiveConfig(build_strategy=BuildStrategyConfig(fuse_elewise_add_act_ops=True))


@dataclasses.dataclass
class Claims:
    """A stand-in strategy schema whose contribution is given directly."""
    contribution: Contribution

    def contribute(self, run) -> Contribution:
        return self.contribution


def test_each_strategy_fills_its_slots():
    plan = plan_of({"amp": AmpConfig(custom_black_list=["LayerNorm"]), "recompute": RecomputeConfig(),
                      "gradient_merge": GradientMergeConfig(k_steps=4, avg=False)}, TrainerConfig())
    assert plan.precision.by == "amp" and plan.precision.component.target == "plugins.amp:build_precision"
    assert plan.precision.component.kwargs["init_loss_scaling"] == 32768.0
    assert [(c.by, c.phase) for c in plan.model_transforms] == [("amp", "precision"), ("recompute", "recompute")]
    assert plan.trainer_args == {"accumulate_grad_batches": {"value": 4, "by": "gradient_merge"}}
    assert [(c.by, c.component.target) for c in plan.callbacks] == [("gradient_merge", "plugins.gradient_merge:GradientSum")]
    assert plan.lightning_strategy is None and plan.world["world_size"] == 1


def test_transforms_follow_phase_order_not_selection_order():
    plan = plan_of({"recompute": RecomputeConfig(), "amp": AmpConfig(custom_white_list=["Linear"])}, TrainerConfig())
    assert [c.phase for c in plan.model_transforms] == ["precision", "recompute"]


def test_several_processes_get_ddp():
    plan = plan_of({}, TrainerConfig(devices=2, num_nodes=2))
    assert plan.world == {"devices": 2, "num_nodes": 2, "world_size": 4}
    assert plan.lightning_strategy.component.target == "plugins.ddp:build_ddp"


def test_two_claims_on_one_exclusive_slot_are_refused_even_if_the_table_forgot():
    precision = Contribution(precision=Component("x:y"))
    with pytest.raises(Refusal, match="a and b both set the precision"):
        plan_of({"a": Claims(precision), "b": Claims(precision)}, TrainerConfig())


def test_strategy_trainer_argument_conflicting_with_user_setting_is_refused():
    with pytest.raises(Refusal, match=r"trainer.accumulate_grad_batches=2 conflicts with strategy gradient_merge"):
        plan_of({"gradient_merge": GradientMergeConfig(k_steps=4)}, TrainerConfig(accumulate_grad_batches=2))
    plan_of({"gradient_merge": GradientMergeConfig(k_steps=4)}, TrainerConfig(accumulate_grad_batches=4))


def test_printed_plan_names_who_asked_for_what():
    text = format_plan(plan_of({"amp": AmpConfig(dtype="bfloat16"), "recompute": RecomputeConfig(checkpoint_shape=[4])},
                                 TrainerConfig()))
    assert "precision: plugins.amp:build_precision(dtype='bfloat16'" in text and "<- amp" in text
    assert "1. [recompute] plugins.recompute:apply_recompute(checkpoints=[], enable_offload=False)  <- recompute" in text
    assert "checkpoint_shape has no effect" in text
    assert "repeated block list" in text


def test_communication_strategies_run_under_ddp_even_in_one_process():
    from runner.strategies.dgc import DGCConfig
    from runner.strategies.fp16_allreduce import FP16AllreduceConfig
    from runner.strategies.lars import LarsConfig

    plan = plan_of({"fp16_allreduce": FP16AllreduceConfig()}, TrainerConfig())
    assert plan.comm_hook.component.target == "plugins.fp16_allreduce:build_hook"
    assert plan.lightning_strategy.component.target == "plugins.ddp:build_ddp"
    with pytest.raises(Refusal, match="lars and dgc both set the optimizer"):
        plan_of({"lars": LarsConfig(), "dgc": DGCConfig()}, TrainerConfig())


def test_sharding_degree_defaults_to_the_ranks_left_and_the_product_must_be_the_world():
    plan = plan_of({"sharding": ShardingConfig(stage=2, dp_degree=2)}, TrainerConfig(devices=4, num_nodes=2))
    layout = plan.lightning_strategy.component.kwargs["layout"]
    assert (layout["dp_replicate"], layout["dp_shard"], layout["tp"]) == (2, 4, 1)
    with pytest.raises(ConfigError, match=r"^strategy.sharding.degree=3: dp_degree x degree x mp_degree x pp_degree = "
                                          r"2 x 3 x 1 x 1 = 6, but the run has 8 process\(es\): set trainer.devices=3, or "
                                          r"degrees whose product is 8$"):
        plan_of({"sharding": ShardingConfig(degree=3, dp_degree=2)}, TrainerConfig(devices=4, num_nodes=2))
    with pytest.raises(ConfigError, match=r"^strategy.sharding.degree=1: .* = 3 x 1 x 1 x 1 = 3, but the run has 2"):
        plan_of({"sharding": ShardingConfig(dp_degree=3)}, TrainerConfig(devices=2))
    with pytest.raises(ConfigError, match=r"^trainer.devices='auto': sharding needs a known process count"):
        plan_of({"sharding": ShardingConfig()}, TrainerConfig(devices="auto"))


def test_sharding_accumulation_is_a_trainer_argument():
    plan = plan_of({"sharding": ShardingConfig(gradient_merge_acc_step=4)}, TrainerConfig(devices=2))
    assert plan.trainer_args["accumulate_grad_batches"] == {"value": 4, "by": "sharding"}


@pytest.mark.parametrize("knobs, batch_size, micro", [({}, 32, 8), ({"micro_batch_size": 4, "accumulate_steps": 8}, 32, 4),
                                                      ({"micro_batch_size": 2}, None, 2)])
def test_pipeline_micro_batch_is_derived_from_the_data_batch(knobs, batch_size, micro):
    plan = plan_of({"pipeline": PipelineConfig(**knobs)}, TrainerConfig(devices=2), batch_size)
    assert plan.lightning_strategy.component.kwargs["micro_batch_size"] == micro


@pytest.mark.parametrize("knobs, batch_size, message", [
    ({"micro_batch_size": 4}, 32, r"^strategy.pipeline.micro_batch_size=4: micro_batch_size x accumulate_steps = "
                                  r"4 x 4 = 16, but data.batch_size=32$"),
    ({"accumulate_steps": 5}, 32, r"^strategy.pipeline.accumulate_steps=5: must divide data.batch_size=32"),
    ({}, None, r"^strategy.pipeline.micro_batch_size: required: the data config has no batch_size"),
])
def test_inconsistent_pipeline_batch_sizes_are_refused_with_the_arithmetic(knobs, batch_size, message):
    with pytest.raises(ConfigError, match=message):
        plan_of({"pipeline": PipelineConfig(**knobs)}, TrainerConfig(devices=2), batch_size)


def test_pipeline_keeps_validation_on_and_refuses_lightning_accumulation():
    plan = plan_of({"pipeline": PipelineConfig()}, TrainerConfig(devices=2), 32)
    assert {arg: claim["value"] for arg, claim in plan.trainer_args.items()} == {"accumulate_grad_batches": 1}
    with pytest.raises(Refusal, match=r"^trainer.accumulate_grad_batches=4 conflicts with strategy pipeline"):
        plan_of({"pipeline": PipelineConfig()}, TrainerConfig(devices=2, accumulate_grad_batches=4), 32)
    with pytest.raises(ConfigError, match=r"^strategy.pipeline.accumulate_steps=1: schedule_mode=1F1B needs >= 2 "
                                          r"micro-batches for 2 stages on 2 processes$"):
        plan_of({"pipeline": PipelineConfig(accumulate_steps=1)}, TrainerConfig(devices=2), 32)
    with pytest.raises(ConfigError, match=r"^trainer.devices=1: pipeline needs >= 2 processes"):
        plan_of({"pipeline": PipelineConfig()}, TrainerConfig(devices=1), 32)


@pytest.mark.parametrize("overrides, fix", [
    (["strategy=[pipeline]"], r"^trainer.devices=1: pipeline needs >= 2 processes \(one per stage\): set trainer.devices=2$"),
    (["experiment=gpt_pipeline_1f1b", "trainer.devices=1"], r"^trainer.devices=1: .*: set trainer.devices=2$"),
    (["strategy=[sharding]", "strategy.sharding.dp_degree=3", "trainer.devices=2"],
     r"= 3 x 1 x 1 x 1 = 3, but the run has 2 process\(es\): set trainer.devices=3, or degrees whose product is 2$"),
    (["experiment=gpt_sharding_hybrid", "trainer.devices=2"], r"= 4, but the run has 2 .*: set trainer.devices=4, or "),
    (["strategy=[sharding]", "strategy.sharding.degree=3", "strategy.sharding.dp_degree=2", "trainer.devices=4",
      "trainer.num_nodes=2"], r"= 6, but the run has 8 process\(es\): set trainer.devices=3, or "),
    (["strategy=[sharding]", "strategy.sharding.dp_degree=3", "trainer.num_nodes=2"],
     r"= 3, but the run has 2 process\(es\): set trainer.devices=3 trainer.num_nodes=1, or "),
    (["strategy=[sharding]", "collective.use_hierarchical_allreduce=true",
      "collective.hierarchical_allreduce_inter_nranks=3", "trainer.devices=2"],
     r"^collective.hierarchical_allreduce_inter_nranks=3: .* must divide the 2 processes: set trainer.devices=3, or "),
], ids=["pipeline", "pipeline_experiment", "sharding_degrees", "hybrid_experiment", "two_nodes", "nodes_that_cannot_split",
        "hierarchical_allreduce"])
def test_a_run_of_the_wrong_process_count_names_the_devices_that_fix_it(spec_for, overrides, fix):
    with pytest.raises(ConfigError, match=fix):
        plan_for(spec_for(*overrides))


@pytest.mark.parametrize("overrides, largest", [
    (["experiment=quickstart", "trainer.devices=2"], 16),  # 2048 samples, 64 a batch: 16 batches a process
    (["experiment=quickstart", "trainer.devices=2", "strategy=[gradient_merge]", "strategy.gradient_merge.k_steps=2"],
     8),  # global batches of 2 x 64 x 2
    (["trainer.devices=4", "data.num_train=100", "data.batch_size=8"], 3),  # global batches of 32: 3, and 4 left out
    (["trainer.limit_train_batches=10"], 10),
    (["trainer.limit_train_batches=0.5", "trainer.devices=2"], 8),
    (["experiment=gpt_pipeline_1f1b"], 64),  # both processes are one pipeline: one data-parallel reader
])
def test_a_validation_interval_is_at_most_the_optimizer_steps_of_an_epoch(spec_for, overrides, largest):
    def check(interval: int, *more: str) -> None:
        spec = spec_for(*overrides, f"trainer.val_check_interval={interval}", *more)
        check_epoch(spec, plan_for(spec))

    check(largest)
    with pytest.raises(ConfigError, match=rf"^trainer.val_check_interval={largest + 1}: more than the {largest} "
                                          rf"optimizer steps .*: at most {largest}, or "):
        check(largest + 1)
    check(largest + 1, "trainer.check_val_every_n_epoch=null")  # counted across epochs
    check(largest + 1, "trainer.limit_val_batches=0")  # no validation


@pytest.mark.parametrize("data, num_train, batch_size, devices", [
    ("classification", 20, 2, 4), ("classification", 13, 2, 3), ("classification", 14, 1, 4),
    ("classification", 100, 8, 4), ("classification", 2047, 64, 3), ("language_model", 20, 2, 4)])
@pytest.mark.parametrize("limit", [1.0, 0.75])
def test_where_the_data_does_not_divide_by_the_processes_an_interval_is_checked_against_what_each_loader_serves(
        spec_for, data, num_train, batch_size, devices, limit):
    """The largest interval allowed is not a formula here but what the built data module's loader
    serves each rank of the world (its global order: every rank reads as many)."""
    overrides = (f"data={data}", f"trainer.devices={devices}", f"data.num_train={num_train}",
                 f"data.batch_size={batch_size}", "data.num_workers=0", f"trainer.limit_train_batches={limit}")
    data = instantiate(spec_for(*overrides).cfg.data)
    data.setup("fit")
    served = set()
    for rank in range(devices):
        data.trainer = on_device(processes=devices)
        data.trainer.distributed_sampler_kwargs = {"num_replicas": devices, "rank": rank}
        served.add(int(len(data.train_dataloader()) * limit))  # as Lightning takes a fraction of the batches
    assert len(served) == 1, served
    largest = served.pop()

    def check(interval: int) -> None:
        spec = spec_for(*overrides, f"trainer.val_check_interval={interval}")
        check_epoch(spec, plan_for(spec))

    check(largest)
    with pytest.raises(ConfigError, match=rf"^trainer.val_check_interval={largest + 1}: more than the {largest} "):
        check(largest + 1)


@pytest.mark.parametrize("overrides, refusal", [
    (["strategy=[sharding]", "collective.use_hierarchical_allreduce=true",
      "collective.hierarchical_allreduce_inter_nranks=4", "trainer.devices=6"],
     r"groups of 4 rank\(s\) .* must divide the 6 processes: set trainer.devices=8, or "),
    (["strategy=[sharding]", "strategy.sharding.dp_degree=4", "trainer.devices=6"],
     r"= 4 x 1 x 1 x 1 = 4, but the run has 6 process\(es\): set trainer.devices=4, or "),
    (["experiment=gpt_pipeline_1f1b", "data.batch_size=30"], r"^strategy.pipeline.accumulate_steps=4: must divide "
                                                             r"data.batch_size=30 into equal micro-batches$"),
], ids=["hierarchical_allreduce", "sharding_degrees", "pipeline_micro_batches"])
def test_degrees_and_batches_that_do_not_divide_by_the_processes_are_refused_naming_what_fits(spec_for, overrides,
                                                                                             refusal):
    with pytest.raises(ConfigError, match=refusal):
        plan_for(spec_for(*overrides))


def test_a_validation_interval_is_left_to_lightning_where_the_data_config_does_not_say_the_epoch(spec_for):
    spec = spec_for("model=causal_lm", "data=tokens", "data.train_bin=a.bin", "data.val_bin=b.bin",
                    "trainer.val_check_interval=100000")
    check_epoch(spec, plan_for(spec))


def test_sharding_with_pipeline_shards_optimizer_states_over_the_pipeline_replicas():
    plan = plan_of({"pipeline": PipelineConfig(), "sharding": ShardingConfig(pp_degree=2)}, TrainerConfig(devices=4), 32)
    assert plan.lightning_strategy.by == "pipeline"
    kwargs = plan.lightning_strategy.component.kwargs
    assert (kwargs["layout"]["dp_shard"], kwargs["shard_optimizer_states"]) == (2, True)
    for knobs, message in [({"stage": 2, "pp_degree": 2}, r"^strategy.sharding.stage=2: with pipeline only stage 1"),
                           ({}, r"^strategy.sharding.pp_degree=1: with pipeline: the processes of one pipeline"),
                           ({"pp_degree": 3}, r"^strategy.sharding.degree=1: .* = 1 x 1 x 1 x 3 = 3, but the run has 4"),
                           ({"pp_degree": 2, "dp_degree": 2}, r"^strategy.sharding.dp_degree=2: with pipeline")]:
        with pytest.raises(ConfigError, match=message):
            plan_of({"sharding": ShardingConfig(**knobs), "pipeline": PipelineConfig()}, TrainerConfig(devices=4), 32)
    with pytest.raises(ConfigError, match=r"^strategy.sharding.pp_degree=2: > 1 needs strategy pipeline too$"):
        plan_of({"sharding": ShardingConfig(pp_degree=2)}, TrainerConfig(devices=4))


def test_a_communication_hook_needs_a_lightning_strategy_that_takes_one():
    from runner.strategies.fp16_allreduce import FP16AllreduceConfig

    for stage, target in [(1, "plugins.sharding:build_zero_stage1"), (3, "plugins.sharding:build_fsdp")]:
        with pytest.raises(Refusal, match=rf"^sharding and fp16_allreduce both own the gradient communication hook: "
                                          rf"sharding's Lightning strategy \({target}\) communicates gradients itself"):
            plan_of({"fp16_allreduce": FP16AllreduceConfig(), "sharding": ShardingConfig(stage=stage)},
                      TrainerConfig(devices=2))


def test_a_transform_asked_for_twice_is_one_claim_naming_both_and_refused_with_other_arguments():
    compile_fast = Contribution(model_transforms=[("compile", Component("x:compile", {"mode": "max-autotune"}))])
    compile_slow = Contribution(model_transforms=[("compile", Component("x:compile", {"mode": "default"}))])
    plan = plan_of({}, TrainerConfig(), lightfleet={"a": lambda run: compile_fast, "b": lambda run: compile_fast})
    assert [(c.by, c.phase, c.component.kwargs) for c in plan.model_transforms] == [
        ("a, b", "compile", {"mode": "max-autotune"})]
    with pytest.raises(Refusal, match=r"^a and b both add x:compile \(compile\) with different arguments; choose one"):
        plan_of({}, TrainerConfig(), lightfleet={"a": lambda run: compile_fast, "b": lambda run: compile_slow})


def test_lightfleets_contributors_see_the_settled_lightning_strategy_and_precision():
    seen = []
    plan_of({"amp": AmpConfig(), "sharding": ShardingConfig(stage=2)}, TrainerConfig(devices=2),
              lightfleet={"a": lambda run: seen.append((run.lightning_strategy, run.precision)) or Contribution()})
    assert seen == [("plugins.sharding:build_fsdp", "plugins.amp:build_precision")]


def test_model_transforms_only_in_declared_phases():
    stray = Contribution(model_transforms=[("quantize", Component("x:y"))])
    with pytest.raises(Refusal, match=r"^strategy a adds a model transform in phase 'quantize'; phases: precision, "):
        plan_of({"a": Claims(stray)}, TrainerConfig())


def test_every_declared_phase_is_used_in_its_order():
    plan = plan_of({"amp": AmpConfig(custom_white_list=["Linear"]), "recompute": RecomputeConfig(),
                      "sharding": ShardingConfig(stage=2, mp_degree=2)}, TrainerConfig(devices=2),
                     lightfleet={"collective": COMPILING.contribute})
    pipelined = plan_of({"pipeline": PipelineConfig()}, TrainerConfig(devices=2), 32)
    assert [c.phase for c in plan.model_transforms] == ["precision", "tensor_parallel", "recompute", "sharding",
                                                        "compile"]
    assert [c.phase for c in pipelined.model_transforms] == ["pipeline"]
    assert set(PHASES) == {c.phase for c in plan.model_transforms + pipelined.model_transforms}


def test_the_saved_plan_reads_back_as_the_same_plan():
    import yaml

    collective = CollectiveConfig(timeout_s=60, execution_strategy=ExecutionStrategyConfig(num_threads=2),
                                  build_strategy=BuildStrategyConfig(fuse_bn_act_ops=True, fuse_all_optimizer_ops=True))
    plan = plan_of({"amp": AmpConfig(custom_black_list=["head"]), "recompute": RecomputeConfig(),
                      "pipeline": PipelineConfig(), "sharding": ShardingConfig(pp_degree=2)}, TrainerConfig(devices=4), 32,
                     lightfleet={"collective": collective.contribute})
    assert plan.lightning_strategy_args and plan.optimizer_transforms and plan.callbacks[0].phase == AFTER_USER
    saved = yaml.safe_load(yaml.safe_dump({"printed": format_plan(plan).splitlines(), **plan.to_dict()}))
    assert Plan.from_dict(saved) == plan


# --------------------------------------------------------------------------- lightfleet's own contributions

RUNNER_CALLBACKS = ["runner.rank.measure:RunMeter", "runner.rank.measure:LastValidation",
                    "runner.rank.preemption:Preemption", "runner.rank.resume:RandomStates",
                    "runner.rank.resume:GlobalPosition", "runner.rank.progress:StepsProgressBar"]
EVERY_COLLECTIVE_MECHANISM = ["trainer.devices=2", "collective.build_strategy.fuse_bn_act_ops=true",
                              "collective.build_strategy.fuse_all_optimizer_ops=true", "collective.fuse_grad_size_in_MB=8",
                              "collective.find_unused_parameters=true", "collective.timeout_s=30",
                              "collective.execution_strategy.num_threads=2", "collective.cudnn_exhaustive_search=true"]


def test_the_plan_names_compile_foreach_ddp_arguments_the_timeout_and_the_runners_callbacks(spec_for):
    """What dry_run=true prints and plan.yaml holds: everything build applies, with who asked."""
    plan = plan_for(spec_for(*EVERY_COLLECTIVE_MECHANISM))
    printed = format_plan(plan).splitlines()
    for line in ["lightning strategy: plugins.ddp:build_ddp()  <- lightfleet",
                 "  bucket_cap_mb=8.0  <- collective", "  find_unused_parameters=True  <- collective",
                 "  timeout_s=30.0  <- collective",
                 "optimizer transforms (in order, after any replacement):",
                 "  plugins.collective:use_foreach()  <- collective",
                 "  1. [compile] plugins.fast_path:compile_model(mode='default')  <- collective",
                 "  benchmark=True  <- collective",
                 "  (the config's callbacks.*)",
                 "  plugins.collective:CollectiveSetup(num_threads=2, gpu_memory_fraction=None, "
                 "cudnn_exhaustive_search=True, sync_batch_norm=False)  <- collective",
                 "  runner.rank.measure:RunMeter(warmup_steps=5)  <- lightfleet",
                 "  runner.rank.preemption:Preemption(stop_on_nonfinite=True)  <- lightfleet",
                 *(f"  {target}()  <- lightfleet" for target in RUNNER_CALLBACKS[1:] if "Preemption" not in target)]:
        assert line in printed, line
    saved = plan.to_dict()
    assert saved["lightning_strategy_args"] == {"bucket_cap_mb": {"value": 8.0, "by": "collective"},
                                                "find_unused_parameters": {"value": True, "by": "collective"},
                                                "timeout_s": {"value": 30.0, "by": "collective"}}
    assert [(c["by"], c["component"]["target"]) for c in saved["optimizer_transforms"]] == [
        ("collective", "plugins.collective:use_foreach")]
    assert [(c["by"], c["phase"], c["component"]["target"]) for c in saved["model_transforms"]] == [
        ("collective", "compile", "plugins.fast_path:compile_model")]
    assert [(c["by"], c["phase"], c["component"]["target"]) for c in saved["callbacks"]] == [
        ("collective", AFTER_USER, "plugins.collective:CollectiveSetup"),
        *(("lightfleet", AFTER_USER, target) for target in RUNNER_CALLBACKS)]


def test_lightfleets_progress_bar_stands_aside_for_the_configs_own_and_for_none(spec_for):
    for overrides in (["trainer.enable_progress_bar=false"], ["callbacks=rich_progress_bar"]):
        targets = [c.component.target for c in plan_for(spec_for(*overrides)).callbacks]
        assert targets == RUNNER_CALLBACKS[:-1], overrides


def test_at_the_defaults_lightfleet_adds_its_callbacks_and_lightfleet_ddp_its_buckets(spec_for):
    alone = plan_for(spec_for())
    assert (alone.lightning_strategy, alone.lightning_strategy_args, alone.model_transforms, alone.optimizer_transforms,
            alone.trainer_args) == (None, {}, [], [], {})
    assert [c.component.target for c in alone.callbacks] == RUNNER_CALLBACKS
    unmeasured = plan_for(spec_for("measure.enabled=false", "measure.warmup_steps=2"))
    assert [c.component.target for c in unmeasured.callbacks] == RUNNER_CALLBACKS[1:]
    guards = {knob: next(c.component.kwargs for c in plan_for(spec_for(*knob)).callbacks
                         if "Preemption" in c.component.target) for knob in ((), ("stop_on_nonfinite=false",))}
    assert guards == {(): {"stop_on_nonfinite": True}, ("stop_on_nonfinite=false",): {"stop_on_nonfinite": False}}
    two = plan_for(spec_for("trainer.devices=2"))
    assert {arg: claim["value"] for arg, claim in two.lightning_strategy_args.items()} == {
        "bucket_cap_mb": 32.0, "find_unused_parameters": False}
    assert plan_for(spec_for("trainer.devices=2", "collective.fuse_all_reduce_ops=false")) \
        .lightning_strategy_args["bucket_cap_mb"]["value"] == 0.001


@pytest.mark.parametrize("strategy", ["sharding", "pipeline"])
def test_the_timeout_reaches_every_lightning_strategy_and_ddp_arguments_only_lightfleets_ddp(spec_for, strategy):
    plan = plan_for(spec_for(f"strategy=[{strategy}]", "trainer.devices=2", "collective.timeout_s=5",
                             "collective.find_unused_parameters=true"))
    assert plan.lightning_strategy.by == strategy
    assert plan.lightning_strategy_args == {"timeout_s": {"value": 5.0, "by": "collective"}}
    # One process has no process group, hence no Lightning strategy to wait in.
    assert plan_for(spec_for("collective.timeout_s=5")).lightning_strategy_args == {}


def test_lightning_strategy_arguments_are_claimed_once():
    timeout = Contribution(lightning_strategy_args={"timeout_s": 2.0})
    own = Contribution(lightning_strategy=Component("x:y", {"timeout_s": 1.0}))
    with pytest.raises(Refusal, match=r"^a and c both set the Lightning strategy's timeout_s; choose one of them$"):
        plan_of({"a": Claims(own)}, TrainerConfig(), lightfleet={"c": Claims(timeout).contribute})
    with pytest.raises(Refusal, match=r"^c sets the Lightning strategy's timeout_s, but the run has none"):
        plan_of({}, TrainerConfig(), lightfleet={"c": Claims(timeout).contribute})


def test_sync_batch_norm_is_a_trainer_argument_on_cuda_and_the_device_is_asked_only_for_it():
    asked = []

    def cuda_available() -> bool:
        asked.append(True)
        return True

    def plan(trainer: TrainerConfig, collective: CollectiveConfig) -> Plan:
        return plan_of({}, trainer, lightfleet={"collective": collective.contribute}, cuda_available=cuda_available)

    # trainer.benchmark set: nothing else asks the device (cudnn.benchmark is settled, see below).
    assert plan(TrainerConfig(benchmark=False), CollectiveConfig()).trainer_args == {} and not asked
    assert plan(TrainerConfig(benchmark=False), CollectiveConfig(sync_batch_norm=True)).trainer_args == {
        "sync_batchnorm": {"value": True, "by": "collective"}} and asked
    on_cpu = plan(TrainerConfig(accelerator="cpu"), CollectiveConfig(sync_batch_norm=True))
    assert on_cpu.trainer_args == {}  # DDP refuses SyncBatchNorm on CPU: the rank says so, once
    assert on_cpu.callbacks[0].component.kwargs["sync_batch_norm"] is True


@pytest.mark.parametrize("cuda, trainer, tuned", [
    (True, {}, True), (False, {}, False), (True, {"accelerator": "cpu"}, False), (True, {"benchmark": False}, False),
    (True, {"deterministic": True}, False), (True, {"deterministic": "warn"}, False), (True, {"benchmark": True}, False)],
    ids=["cuda", "no cuda", "cpu asked", "benchmark=false", "deterministic", "deterministic warn", "benchmark=true"])
def test_a_cuda_run_turns_cudnn_benchmark_on_unless_the_run_settles_it_and_the_plan_says_why(cuda, trainer, tuned):
    # A plain loop on a GPU runs convolutions with cudnn.benchmark (ResNet-50 on an H200: 0.90 without it).
    plan = plan_of({}, TrainerConfig(**trainer), lightfleet={"collective": CollectiveConfig().contribute},
                     cuda_available=lambda: cuda)
    assert ("benchmark" in plan.trainer_args) == tuned
    noted = [note for note in plan.notes if note.startswith("cudnn.benchmark on: a CUDA run")]
    assert len(noted) == tuned
    if tuned:
        assert plan.trainer_args["benchmark"] == {"value": True, "by": "collective"}
        assert "trainer.benchmark=false or trainer.deterministic=true keeps it off" in noted[0]
        assert "note: cudnn.benchmark on: a CUDA run" in format_plan(plan)


@pytest.mark.parametrize("dtype, cuda, noted", [("float16", False, True), ("bfloat16", False, False),
                                                ("float16", True, False)], ids=["float16 cpu", "bfloat16 cpu", "float16 cuda"])
def test_float16_amp_on_a_cpu_is_noted_with_the_way_out(dtype, cuda, noted):
    # Measured: float16 autocast on a CPU without float16 units ran at 0.086x of float32.
    plan = plan_of({"amp": AmpConfig(dtype=dtype)}, TrainerConfig(), cuda_available=lambda: cuda)
    cpu_notes = [note for note in plan.notes if "on a CPU" in note]
    assert len(cpu_notes) == noted
    if noted:
        assert "note: amp with dtype=float16 on a CPU: " in format_plan(plan)
        assert "strategy.amp.dtype=bfloat16" in cpu_notes[0] and "leaving amp out" in cpu_notes[0]


def test_cudnn_exhaustive_search_against_trainer_benchmark_false_is_refused_by_the_plan(spec_for):
    with pytest.raises(ConfigError, match=r"^collective.cudnn_exhaustive_search=True: trainer.benchmark=false says "
                                          r"the opposite; set only one of them$"):
        plan_for(spec_for("collective.cudnn_exhaustive_search=true", "trainer.benchmark=false"))
    for benchmark in ("true", "null"):
        plan = plan_for(spec_for("collective.cudnn_exhaustive_search=true", f"trainer.benchmark={benchmark}"))
        assert plan.trainer_args["benchmark"] == {"value": True, "by": "collective"}


# What each shipped experiment runs, written here once from its file and its purpose: a test that read
# the strategies from the file itself could not fail when the file lost one.
GPT, LM = "runner.models.GPTDecoder", "runner.data.SyntheticLanguageModelData"
MLP, CLASSES = "runner.models.MLPClassifier", "runner.data.SyntheticClassificationData"
SHIPPED = {
    "gpt2_124m": (["amp", "gradient_merge"], "runner.models.causal_lm.CausalLM", "runner.data.tokens.TokenFileData",
                  1, 600000, {"model.d_model": 768, "model.n_layers": 12, "data.seq_len": 1024, "data.batch_size": 12,
                              "strategy.amp.dtype": "bfloat16", "strategy.gradient_merge.k_steps": 40,
                              "fast_path.compile": True, "trainer.gradient_clip_val": 1.0}),
    "gpt_amp_lamb": (["amp", "lamb"], GPT, LM, 1, 100, {"strategy.amp.dtype": "bfloat16",
                                                        "strategy.lamb.lamb_weight_decay": 0.01}),
    "gpt_pipeline_1f1b": (["pipeline"], GPT, LM, 2, 50, {"model.n_layers": 4, "data.batch_size": 32,
                                                         "strategy.pipeline.schedule_mode": "1F1B",
                                                         "strategy.pipeline.accumulate_steps": 4}),
    "gpt_recompute_gradient_merge": (["recompute", "gradient_merge"], GPT, LM, 1, 40,
                                     {"strategy.gradient_merge.k_steps": 4}),
    "gpt_sharding_hybrid": (["sharding"], GPT, LM, 4, 50, {"strategy.sharding.stage": 3, "strategy.sharding.degree": 2,
                                                           "strategy.sharding.dp_degree": 2}),
    "gpt_sharding_stage2": (["amp", "sharding"], GPT, LM, 2, 50, {"strategy.sharding.stage": 2,
                                                                  "strategy.amp.dtype": "bfloat16"}),
    "mlp_ddp_amp": (["amp"], MLP, CLASSES, 2, 100, {"strategy.amp.init_loss_scaling": 1024.0}),
    "mlp_dgc_recompute": (["dgc", "recompute"], MLP, CLASSES, 2, 100, {"strategy.dgc.rampup_begin_step": 10}),
    "mlp_localsgd": (["localsgd"], MLP, CLASSES, 2, 100, {"strategy.localsgd.k_steps": 4}),
    "quickstart": ([], MLP, CLASSES, 1, 60, {"trainer.val_check_interval": 16}),
    "resnet50_fleet_collective": (["amp"], "runner.models.vision.VisionClassifier", "runner.data.images.ImageFolderData",
                                  1, 5000, {"model.arch": "resnet50", "data.image_size": 224,
                                            "strategy.amp.dtype": "float16", "collective.fuse_grad_size_in_MB": 32}),
    "resnet_amp_recompute": (["amp", "recompute"], "runner.models.ResNetClassifier", CLASSES, 1, 60,
                             {"strategy.amp.dtype": "bfloat16"}),
    "resnet_amp_recompute_lars": (["amp", "recompute", "lars"], "runner.models.ResNetClassifier", CLASSES, 1, 100,
                                  {"strategy.lars.lars_coeff": 0.001, "model.optimizer.lr": 4.0}),
}


def test_every_shipped_experiment_has_its_row_in_the_table():
    assert sorted(path.stem for path in EXPERIMENTS_DIR.glob("*.yaml")) == sorted(SHIPPED)


@pytest.mark.parametrize("experiment", sorted(SHIPPED))
def test_every_shipped_experiments_plan_holds_exactly_the_strategies_and_settings_pinned_for_it(spec_for, experiment):
    strategies, model, data, devices, max_steps, settings = SHIPPED[experiment]
    spec = spec_for(f"experiment={experiment}")
    assert sorted(plan_for(spec).strategies) == sorted(strategies)
    pinned = {"name": experiment, "model._target_": model, "data._target_": data, "trainer.devices": devices,
              "trainer.max_steps": max_steps, **settings}
    assert {key: OmegaConf.select(spec.cfg, key) for key in pinned} == pinned
