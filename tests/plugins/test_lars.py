"""plugins.lars: the foreach LARS against the formula written one tensor at a time, the
replacement of the user's momentum SGD, float16 overflow steps, and a real 2-process DDP run.
The checks shared with test_lamb.py live in tests/helpers/optimizer_checks.py."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from tests.helpers.optimizer_checks import CHUNK_SIZES, IGNORE_UNWRAPPED_STEP, PerTensorReference, ReplacedOptimizerMLP
from tests.helpers.optimizer_checks import assert_groups_kept, assert_scheduler_follows, assert_state_dict_round_trips
from tests.helpers.optimizer_checks import blocks_and_rest, fit_float16_with_overflows, recomputed_resnet, run_ddp_fit
from tests.helpers.optimizer_checks import step_both, steps_equal_paddles, two_group_mlp, two_group_scheduler
from plugins.lars import LARS, replace_optimizer
from runner.core.errors import ConfigError
from runner.models import MLPClassifier
from runner.strategies.lars import LarsConfig


class ReferenceLARS(PerTensorReference):
    """The LARS formula in plain Python, one tensor at a time, in float64; per-tensor hyper-
    parameters `lr[i]` and `wd[i]` (0 for excluded tensors, which then take plain momentum-SGD
    steps, as Paddle's lars_momentum)."""

    def __init__(self, params, lr, wd, momentum, lars_coeff, epsilon):
        super().__init__(params)
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.lr, self.wd = lr, wd
        self.momentum, self.lars_coeff, self.epsilon = momentum, lars_coeff, epsilon

    def update(self, i, w, g):
        w_norm, g_norm = w.norm().item(), g.norm().item()
        if self.wd[i] > 0 and w_norm > 0 and g_norm > 0:
            local_lr = self.lr[i] * self.lars_coeff * w_norm / (g_norm + self.wd[i] * w_norm + self.epsilon)
        else:
            local_lr = self.lr[i]
        self.buffers[i] = self.momentum * self.buffers[i] + local_lr * (g + self.wd[i] * w)
        return w - self.buffers[i]

    def state(self, i):
        return {"momentum_buffer": self.buffers[i]}


@CHUNK_SIZES
def test_steps_match_the_formula_per_tensor(chunk_numel, monkeypatch):
    setup = two_group_mlp(monkeypatch, chunk_numel, lrs=(0.5, 0.2), weight_decays=(0.01, 0.05),
                          weight_decay_key="lars_weight_decay")
    model = setup.model
    with torch.no_grad():
        model.head[1].bias.zero_()               # ||w|| = 0 at the first step: local_lr = lr
    zero_grad = [model.blocks[1].net[3].bias]    # ||g|| = 0 at every step: local_lr = lr
    frozen = [model.stem.bias]                   # no gradient: left alone, no state
    optimizer = LARS(setup.groups, lr=0.5, momentum=0.9, lars_coeff=0.02, lars_weight_decay=0.01, epsilon=1e-4)
    reference = ReferenceLARS(setup.params, lr=setup.lrs, wd=setup.weight_decays, momentum=0.9, lars_coeff=0.02,
                              epsilon=1e-4)
    frozen_before = frozen[0].detach().clone()

    step_both(model, optimizer, reference, setup.batch, steps=5, zero=zero_grad, drop=frozen)

    assert torch.equal(frozen[0], frozen_before) and not optimizer.state[frozen[0]]
    assert torch.count_nonzero(model.head[1].bias) > 0  # the zero weight did move


def test_excluded_names_get_no_weight_decay_also_inside_recomputed_blocks():
    model, params, excluded, batch = recomputed_resnet()
    knobs = LarsConfig(lars_coeff=0.02, lars_weight_decay=0.05, exclude_from_weight_decay=["bias", "bn"])
    optimizer = replace_optimizer(torch.optim.SGD(params, lr=0.4, momentum=0.9), model=model, **asdict(knobs))
    assert optimizer.param_groups[0]["no_weight_decay"] == excluded
    reference = ReferenceLARS(params, lr=[0.4] * len(params), wd=[0.0 if e else 0.05 for e in excluded],
                              momentum=0.9, lars_coeff=0.02, epsilon=knobs.epsilon)
    step_both(model, optimizer, reference, batch, steps=3)


@IGNORE_UNWRAPPED_STEP
def test_replacement_keeps_groups_and_the_scheduler_follows():
    model = MLPClassifier()
    blocks, rest = blocks_and_rest(model)
    sgd = torch.optim.SGD([{"params": blocks, "lr": 0.05, "name": "blocks"}, {"params": rest, "momentum": 0.8}],
                          lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = two_group_scheduler(sgd)

    knobs = LarsConfig(lars_coeff=0.01, exclude_from_weight_decay=["bias"])
    lars = replace_optimizer(sgd, model=model, **asdict(knobs))
    assert_groups_kept(sgd, lars)
    for group in lars.param_groups:
        assert (group["lars_coeff"], group["lars_weight_decay"], group["epsilon"]) == \
            (0.01, knobs.lars_weight_decay, knobs.epsilon)
    assert [g["momentum"] for g in lars.param_groups] == [0.9, 0.8]
    assert lars.param_groups[0]["name"] == "blocks"

    assert_scheduler_follows(scheduler, lars, model, (torch.randn(16, 32), torch.randint(4, (16,))),
                             expected_lrs=[[0.025, 0.01], [0.0125, 0.001]])


def test_wrong_base_optimizer_is_refused():
    model = MLPClassifier()
    allowed = r"lars needs momentum SGD \(torch\.optim\.SGD with momentum > 0\); choose it with model/optimizer=sgd"
    knobs = asdict(LarsConfig())
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='Adam': {allowed}$"):
        replace_optimizer(torch.optim.Adam(model.parameters()), model=model, **knobs)
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='SGD': {allowed}$"):
        replace_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **knobs)
    with pytest.raises(ConfigError, match="model.optimizer='SGD'"):  # one group without momentum is enough
        replace_optimizer(torch.optim.SGD([{"params": model.stem.parameters(), "momentum": 0.0},
                                           {"params": model.head.parameters()}], lr=0.1, momentum=0.9), model=model,
                          **knobs)


def test_state_dict_round_trips():
    assert_state_dict_round_trips(
        lambda model: replace_optimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model=model,
                                        **asdict(LarsConfig(lars_coeff=0.02, exclude_from_weight_decay=["bias"]))),
        blank=lambda params: LARS(params, lr=1.0, momentum=0.1, lars_coeff=1.0, lars_weight_decay=1.0, epsilon=1.0),
        loaded=lambda state: "momentum_buffer" in state)


def test_float16_overflow_steps_leave_params_and_state_untouched():
    model = ReplacedOptimizerMLP(replace_optimizer, **asdict(LarsConfig(lars_coeff=0.05,
                                                                       exclude_from_weight_decay=["bias"])))
    assert isinstance(fit_float16_with_overflows(model), LARS)


@pytest.mark.slow
def test_two_process_ddp_trains_and_ranks_agree(tmp_path):
    ranks = run_ddp_fit("""
        from dataclasses import asdict

        from tests.helpers.optimizer_checks import fit_ddp_rank
        from plugins.lars import replace_optimizer
        from runner.strategies.lars import LarsConfig

        # the MLP's default optimizer: SGD(lr=0.1, momentum=0.9)
        fit_ddp_rank(replace_optimizer,
                     **asdict(LarsConfig(lars_coeff=0.05, exclude_from_weight_decay=["bias", "net.0"])))
    """, tmp_path)
    assert [r["optimizer"] for r in ranks] == ["LARS", "LARS"]
    assert len(ranks[0]["state"]["state"]) == len(ranks[0]["params"])  # a momentum buffer for every parameter


# --------------------------------------------------------------------------- against Paddle 3.3.1


# Fleet's lars is Paddle's LarsMomentumOptimizer: an excluded tensor (its lars_weight_decay is 0),
# or every tensor when lars_weight_decay is 0, takes plain momentum-SGD steps.
PADDLE_LARS = {"decayed": (2.0 ** -11, []), "bias_excluded": (2.0 ** -11, ["bias"]), "no_weight_decay": (0.0, [])}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", PADDLE_LARS)
def test_steps_equal_paddles_lars(tmp_path, case, dtype):
    weight_decay, excluded = PADDLE_LARS[case]
    hyper = dict(lr=0.125, momentum=0.875, lars_coeff=2.0 ** -10, epsilon=2.0 ** -20)  # exact in float32
    steps_equal_paddles(
        tmp_path, "lars", dtype,
        dict(learning_rate=hyper["lr"], momentum=hyper["momentum"], lars_coeff=hyper["lars_coeff"],
             epsilon=hyper["epsilon"], lars_weight_decay=weight_decay, excluded=excluded),
        lambda groups: LARS(groups, **hyper, lars_weight_decay=weight_decay))
