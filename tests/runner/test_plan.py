"""The plan: slots, phase order, conflicts, and its printed form."""
from __future__ import annotations

import dataclasses

import pytest

from runner.errors import Refusal
from runner.plan import Component, Contribution, format_plan, make_plan
from runner.schema import AmpConfig, GradientMergeConfig, RecomputeConfig, TrainerConfig


@dataclasses.dataclass
class Claims:
    """A stand-in strategy schema whose contribution is given directly."""
    contribution: Contribution

    def contribute(self) -> Contribution:
        return self.contribution


def test_each_strategy_fills_its_slots():
    plan = make_plan({"amp": AmpConfig(custom_black_list=["LayerNorm"]), "recompute": RecomputeConfig(),
                      "gradient_merge": GradientMergeConfig(k_steps=4, avg=False)}, TrainerConfig())
    assert plan.precision.by == "amp" and plan.precision.component.target == "plugins.amp:build_precision"
    assert plan.precision.component.kwargs["init_loss_scaling"] == 32768.0
    assert [(c.by, c.phase) for c in plan.model_transforms] == [("amp", "precision"), ("recompute", "recompute")]
    assert plan.trainer_args == {"accumulate_grad_batches": {"value": 4, "by": "gradient_merge"}}
    assert [(c.by, c.component.target) for c in plan.callbacks] == [("gradient_merge", "plugins.gradient_merge:GradientSum")]
    assert plan.lightning_strategy is None and plan.world["world_size"] == 1


def test_transforms_follow_phase_order_not_selection_order():
    plan = make_plan({"recompute": RecomputeConfig(), "amp": AmpConfig(custom_white_list=["Linear"])}, TrainerConfig())
    assert [c.phase for c in plan.model_transforms] == ["precision", "recompute"]


def test_several_processes_get_ddp():
    plan = make_plan({}, TrainerConfig(devices=2, num_nodes=2))
    assert plan.world == {"devices": 2, "num_nodes": 2, "world_size": 4}
    assert plan.lightning_strategy.component.target == "plugins.ddp:build_ddp"


def test_two_claims_on_one_exclusive_slot_are_refused_even_if_the_table_forgot():
    precision = Contribution(precision=Component("x:y"))
    with pytest.raises(Refusal, match="a and b both set the precision"):
        make_plan({"a": Claims(precision), "b": Claims(precision)}, TrainerConfig())


def test_strategy_trainer_argument_conflicting_with_user_setting_is_refused():
    with pytest.raises(Refusal, match=r"trainer.accumulate_grad_batches=2 conflicts with strategy gradient_merge"):
        make_plan({"gradient_merge": GradientMergeConfig(k_steps=4)}, TrainerConfig(accumulate_grad_batches=2))
    make_plan({"gradient_merge": GradientMergeConfig(k_steps=4)}, TrainerConfig(accumulate_grad_batches=4))


def test_printed_plan_names_who_asked_for_what():
    text = format_plan(make_plan({"amp": AmpConfig(dtype="bfloat16"), "recompute": RecomputeConfig(checkpoint_shape=[4])},
                                 TrainerConfig()))
    assert "precision: plugins.amp:build_precision(dtype='bfloat16'" in text and "<- amp" in text
    assert "1. [recompute] plugins.recompute:apply_recompute(checkpoints=[], enable_offload=False)  <- recompute" in text
    assert "checkpoint_shape has no effect" in text
    assert "repeated block list" in text


def test_communication_strategies_run_under_ddp_even_in_one_process():
    from runner.schema import DGCConfig, FP16AllreduceConfig, LarsConfig

    plan = make_plan({"fp16_allreduce": FP16AllreduceConfig()}, TrainerConfig())
    assert plan.comm_hook.component.target == "plugins.fp16_allreduce:build_hook"
    assert plan.lightning_strategy.component.target == "plugins.ddp:build_ddp"
    with pytest.raises(Refusal, match="lars and dgc both set the optimizer"):
        make_plan({"lars": LarsConfig(), "dgc": DGCConfig()}, TrainerConfig())
