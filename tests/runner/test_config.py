"""Schema checks: typos, wrong types and out-of-range values are refused, naming key and value."""
from __future__ import annotations

import inspect

import pytest

from runner.core.errors import ConfigError
from runner.config.schema import TrainerConfig


def test_defaults_compose(spec_for):
    spec = spec_for()
    assert spec.strategies == {}
    assert spec.trainer.devices == 1
    assert spec.cfg.model._target_ == "runner.models.MLPClassifier"


def test_strategy_knobs_keep_fleet_defaults_and_take_overrides(spec_for):
    spec = spec_for("strategy=[amp,gradient_merge]", "strategy.amp.init_loss_scaling=128")
    amp, merge = spec.strategies["amp"], spec.strategies["gradient_merge"]
    assert (amp.init_loss_scaling, amp.incr_every_n_steps, amp.decr_every_n_nan_or_inf) == (128.0, 1000, 2)
    assert (amp.incr_ratio, amp.decr_ratio, amp.use_dynamic_loss_scaling) == (2.0, 0.5, True)
    assert (merge.k_steps, merge.avg) == (1, True)
    assert list(spec.strategies) == ["amp", "gradient_merge"]


@pytest.mark.parametrize("overrides, message", [
    (["strategy=[amp]", "strategy.amp.init_los_scaling=1"],
     r"^strategy.amp.init_los_scaling: strategy.amp has no key 'init_los_scaling' \(did you mean init_loss_scaling\?\)$"),
    (["trainer.max_step=3"], r"trainer.max_step: trainer has no key 'max_step' \(did you mean max_steps"),
    (["strategy=[amp]", "strategy.amp.incr_ratio=1.0"], r"^strategy.amp.incr_ratio=1.0: must be > 1$"),
    (["strategy=[amp]", "strategy.amp.decr_ratio=1.5"], r"^strategy.amp.decr_ratio=1.5: must be in \(0, 1\)$"),
    (["strategy=[amp]", "strategy.amp.dtype=flot16"], r"dtype='flot16': allowed: float16, bfloat16 \(did you mean float16"),
    (["strategy=[amp]", "strategy.amp.incr_ratio=abc"], r"^strategy.amp.incr_ratio='abc': .*Float"),
    (["strategy=[gradient_merge]", "strategy.gradient_merge.k_steps=0"], r"k_steps=0: must be >= 1$"),
    (["strategy=[recompute]", "strategy.recompute.enable_offload=maybe"], r"enable_offload='maybe'"),
    (["strategy=[dgc]", "strategy.dgc.rampup_step=0"], r"^strategy.dgc.rampup_step=0: must be >= 1$"),
    (["strategy=[dgc]", "strategy.dgc.rampup_begin_step=-1"], r"^strategy.dgc.rampup_begin_step=-1: must be >= 0$"),
    (["strategy=[dgc]", "strategy.dgc.sparsity=[0.5,1.0]"], r"^strategy.dgc.sparsity=\[0.5, 1.0\]: a non-empty list"),
    (["strategy=[fp16_allreduce]", "strategy.fp16_allreduce.dtype=fp8"], r"^strategy.fp16_allreduce.dtype='fp8': allowed"),
    (["strategy=[lars]", "strategy.lars.lars_coeff=0"], r"^strategy.lars.lars_coeff=0.0: must be > 0$"),
    (["strategy=[localsgd]", "strategy.localsgd.k_steps=0"], r"^strategy.localsgd.k_steps=0: must be >= 1$"),
    (["strategy=[sharding]", "strategy.sharding.stage=4"], r"^strategy.sharding.stage=4: allowed: 1, 2, 3$"),
    (["strategy=[sharding]", "strategy.sharding.pp_degree=0"], r"^strategy.sharding.pp_degree=0: must be >= 1$"),
    (["strategy=[sharding]", "strategy.sharding.mp_degree=2"], r"^strategy.sharding.mp_degree=2: tensor parallelism needs stage 2 or 3"),
    (["strategy=[sharding]", "strategy.sharding.optimize_offload=true"], r"optimize_offload=True: offload needs stage 2 or 3"),
    (["strategy=[pipeline]", "strategy.pipeline.schedule_mode=1f1b"], r"schedule_mode='1f1b': allowed: 1F1B, GPipe, Interleaved1F1B, ZBVZeroBubble \(did you mean 1F1B"),
    (["strategy=[pipeline]", "strategy.pipeline.schedule_mode=Interleaved1F1B"], r"^strategy.pipeline.vpp_degree=1: schedule_mode=Interleaved1F1B needs >= 2$"),
    (["strategy=[pipeline]", "strategy.pipeline.accumulate_steps=0"], r"^strategy.pipeline.accumulate_steps=0: must be >= 1$"),
    (["model=mlpp"], r"^model='mlpp': no such option; choose from: causal_lm, gpt, mlp, resnet, vision \(did you mean mlp\?\)$"),
    (["experiment=quikstart"], r"experiment='quikstart'.*did you mean quickstart"),
])
def test_bad_input_is_one_line_naming_key_and_value(spec_for, overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        spec_for(*overrides)
    assert "\n" not in str(error.value)


def test_knob_of_unselected_strategy_is_an_error(spec_for):
    with pytest.raises(ConfigError, match="strategy.amp"):
        spec_for("strategy.amp.init_loss_scaling=1")


def test_auto_composes_with_its_knobs(spec_for):
    assert spec_for("strategy=[auto]", "strategy.auto.mode=rules").strategies["auto"].mode == "rules"
    with pytest.raises(ConfigError, match="strategy.auto.mode"):
        spec_for("strategy=[auto]", "strategy.auto.mode=guess")


def test_trainer_schema_covers_lightning_trainer():
    """Every Trainer argument is a knob except those the plan and config groups own; lightfleet's own
    trainer knobs (max_restarts) are the rest."""
    import pytorch_lightning as pl

    from runner.config.schema import LIGHTFLEET_TRAINER_KNOBS

    owned = {"self", "strategy", "precision", "plugins", "callbacks", "logger", "default_root_dir"}
    lightning = set(inspect.signature(pl.Trainer.__init__).parameters) - owned
    assert lightning == set(TrainerConfig.__dataclass_fields__) - set(LIGHTFLEET_TRAINER_KNOBS)
    assert not lightning & set(LIGHTFLEET_TRAINER_KNOBS)


def test_knob_reference_is_current():
    """docs/knobs.md is generated from the schema: regenerate with `python -m runner.config.knobs > docs/knobs.md`."""
    from tests.helpers.commands import PROJECT_ROOT
    from runner.config.knobs import render

    assert (PROJECT_ROOT / "docs" / "knobs.md").read_text() == render()


def test_no_checkpointing_leaves_the_checkpoint_callback_out(spec_for):
    assert "model_checkpoint" in spec_for().cfg.callbacks
    assert "model_checkpoint" not in spec_for("trainer.enable_checkpointing=false").cfg.callbacks
    assert "model_checkpoint" in spec_for("trainer.enable_checkpointing=true").cfg.callbacks
