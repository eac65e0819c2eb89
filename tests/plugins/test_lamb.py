"""plugins.lamb: the foreach LAMB against the formula written one tensor at a time, the
replacement of the user's Adam/AdamW, float16 overflow steps, and a real 2-process DDP run.
The checks shared with test_lars.py live in tests/helpers/optimizer_checks.py."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from tests.helpers.optimizer_checks import CHUNK_SIZES, IGNORE_UNWRAPPED_STEP, PerTensorReference, ReplacedOptimizerMLP
from tests.helpers.optimizer_checks import assert_groups_kept, assert_scheduler_follows, assert_state_dict_round_trips
from tests.helpers.optimizer_checks import blocks_and_rest, fit_float16_with_overflows, recomputed_resnet, run_ddp_fit
from tests.helpers.optimizer_checks import step_both, steps_equal_paddles, two_group_mlp, two_group_scheduler
from plugins.lamb import LAMB, replace_optimizer
from runner.core.errors import ConfigError
from runner.models import GPTDecoder, MLPClassifier
from runner.strategies.lamb import LambConfig


class ReferenceLAMB(PerTensorReference):
    """The LAMB formula in plain Python, one tensor at a time, in float64; per-tensor hyper-
    parameters `lr[i]` and `wd[i]` (0 for excluded tensors, which then take no trust ratio, as
    Paddle's lamb with always_adapt=False)."""

    def __init__(self, params, lr, wd, betas, eps):
        super().__init__(params)
        self.exp_avgs = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params]
        self.steps = [0] * len(self.params)
        self.lr, self.wd, self.betas, self.eps = lr, wd, betas, eps

    def update(self, i, w, g):
        beta1, beta2 = self.betas
        self.steps[i] += 1
        t = self.steps[i]
        self.exp_avgs[i] = beta1 * self.exp_avgs[i] + (1 - beta1) * g
        self.exp_avg_sqs[i] = beta2 * self.exp_avg_sqs[i] + (1 - beta2) * g * g
        m_hat = self.exp_avgs[i] / (1 - beta1 ** t)
        v_hat = self.exp_avg_sqs[i] / (1 - beta2 ** t)
        r = m_hat / (v_hat.sqrt() + self.eps) + self.wd[i] * w
        w_norm, r_norm = w.norm().item(), r.norm().item()
        trust = w_norm / r_norm if self.wd[i] > 0 and w_norm > 0 and r_norm > 0 else 1.0
        return w - self.lr[i] * trust * r

    def state(self, i):
        return {"step": self.steps[i], "exp_avg": self.exp_avgs[i], "exp_avg_sq": self.exp_avg_sqs[i]}


@CHUNK_SIZES
def test_steps_match_the_formula_per_tensor(chunk_numel, monkeypatch):
    setup = two_group_mlp(monkeypatch, chunk_numel, lrs=(0.05, 0.02), weight_decays=(0.01, 0.1),
                          weight_decay_key="lamb_weight_decay")
    model = setup.model
    zero_weight = model.head[1].bias              # ||w|| = 0 at the first step: trust = 1
    zero_both = model.blocks[1].net[3].bias       # zero weight and gradient: ||r|| = 0, trust = 1, no nan
    zero_grad = model.blocks[0].net[3].weight     # ||g|| = 0 but ||w|| > 0: r = wd * w
    frozen = model.stem.bias                      # no gradient: left alone, no state
    with torch.no_grad():
        zero_weight.zero_()
        zero_both.zero_()
    optimizer = LAMB(setup.groups, lr=0.05, betas=(0.8, 0.99), eps=1e-6, lamb_weight_decay=0.01, always_adapt=False)
    reference = ReferenceLAMB(setup.params, lr=setup.lrs, wd=setup.weight_decays, betas=(0.8, 0.99), eps=1e-6)
    frozen_before = frozen.detach().clone()

    step_both(model, optimizer, reference, setup.batch, steps=5, zero=[zero_both, zero_grad], drop=[frozen])

    assert torch.equal(frozen, frozen_before) and not optimizer.state[frozen]
    assert torch.count_nonzero(zero_weight) > 0                # the zero weight did move
    assert torch.count_nonzero(zero_both) == 0                 # nothing to move it, and no nan
    assert all(torch.isfinite(p).all() for p in setup.params)


def test_float64_training_follows_the_formula_to_float64_precision():
    """The bias corrections 1 - beta^t are exact: in float32, 1 - 0.999^t would be off by about
    1e-5 of its value, and float64 parameters would drift from the formula by about 1e-8."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, dtype=torch.float64, generator=generator, requires_grad=True)
              for shape in ((16, 8), (8,), (3, 4, 5))]
    optimizer = LAMB(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8, lamb_weight_decay=0.01, always_adapt=False)
    reference = ReferenceLAMB(params, lr=[0.01] * 3, wd=[0.01] * 3, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(20):
        grads = [torch.randn(p.shape, dtype=torch.float64, generator=generator) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        reference.step(grads)
    for p, expected in zip(params, reference.params):
        torch.testing.assert_close(p.detach(), expected, rtol=1e-13, atol=1e-15)


def test_excluded_names_get_no_weight_decay_also_inside_recomputed_blocks():
    model, params, excluded, batch = recomputed_resnet()
    optimizer = replace_optimizer(torch.optim.Adam(params, lr=0.01, eps=1e-6), model=model, lamb_weight_decay=0.1,
                                  exclude_from_weight_decay=["bias", "bn"], always_adapt=False)
    assert optimizer.param_groups[0]["no_weight_decay"] == excluded
    reference = ReferenceLAMB(params, lr=[0.01] * len(params), wd=[0.0 if e else 0.1 for e in excluded],
                              betas=(0.9, 0.999), eps=1e-6)
    step_both(model, optimizer, reference, batch, steps=3)


@IGNORE_UNWRAPPED_STEP
def test_replacement_keeps_groups_and_the_scheduler_follows():
    model = GPTDecoder()
    blocks, rest = blocks_and_rest(model)
    adamw = torch.optim.AdamW([{"params": blocks, "lr": 3e-3, "name": "blocks"}, {"params": rest, "betas": (0.8, 0.9)}],
                              lr=1e-3, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05)
    scheduler = two_group_scheduler(adamw)

    lamb = replace_optimizer(adamw, model=model, lamb_weight_decay=0.02, exclude_from_weight_decay=["ln", "bias"],
                             always_adapt=False)
    assert_groups_kept(adamw, lamb)
    assert all(group["lamb_weight_decay"] == 0.02 for group in lamb.param_groups)
    assert [(g["betas"], g["eps"]) for g in lamb.param_groups] == [((0.9, 0.98), 1e-7), ((0.8, 0.9), 1e-7)]
    assert lamb.param_groups[0]["name"] == "blocks"
    names = [n for n, _ in model.named_parameters() if n.startswith("blocks.")]
    assert lamb.param_groups[0]["no_weight_decay"] == [".ln" in n or n.endswith("bias") for n in names]

    tokens = torch.randint(64, (4, 33))
    assert_scheduler_follows(scheduler, lamb, model, (tokens[:, :-1], tokens[:, 1:]),
                             expected_lrs=[[1.5e-3, 1e-4], [7.5e-4, 1e-5]])


def test_wrong_base_optimizer_is_refused():
    model = MLPClassifier()
    allowed = (r"lamb needs an Adam-family optimizer \(torch\.optim\.Adam or torch\.optim\.AdamW\); choose one with "
               r"model/optimizer=adam or model/optimizer=adamw")
    knobs = asdict(LambConfig())
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='SGD': {allowed}$"):
        replace_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model, **knobs)
    with pytest.raises(ConfigError, match=rf"^model\.optimizer='Adagrad': {allowed}$"):
        replace_optimizer(torch.optim.Adagrad(model.parameters()), model=model, **knobs)
    assert isinstance(replace_optimizer(torch.optim.Adam(model.parameters()), model=model, **knobs), LAMB)


def test_state_dict_round_trips():
    assert_state_dict_round_trips(
        lambda model: replace_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model=model,
                                        **asdict(LambConfig(exclude_from_weight_decay=["bias"]))),
        blank=lambda params: LAMB(params, lr=1.0, betas=(0.5, 0.5), lamb_weight_decay=1.0, always_adapt=False),
        loaded=lambda state: state["step"].item() == 2)


def test_float16_overflow_steps_leave_params_and_state_untouched():
    model = ReplacedOptimizerMLP(replace_optimizer, lambda params: torch.optim.AdamW(params, lr=0.01),
                                 **asdict(LambConfig(exclude_from_weight_decay=["bias"])))
    optimizer = fit_float16_with_overflows(model)
    assert isinstance(optimizer, LAMB)
    assert {state["step"].item() for state in optimizer.state.values()} == {4.0}  # 6 steps, 2 skipped


@pytest.mark.slow
def test_two_process_ddp_trains_and_ranks_agree(tmp_path):
    ranks = run_ddp_fit("""
        import functools
        from dataclasses import asdict

        import torch

        from tests.helpers.optimizer_checks import fit_ddp_rank
        from plugins.lamb import replace_optimizer
        from runner.strategies.lamb import LambConfig

        fit_ddp_rank(replace_optimizer, functools.partial(torch.optim.AdamW, lr=0.01),
                     **asdict(LambConfig(exclude_from_weight_decay=["bias", "net.0"])))
    """, tmp_path)
    assert [r["optimizer"] for r in ranks] == ["LAMB", "LAMB"]
    assert {s["step"].item() for s in ranks[0]["state"]["state"].values()} == {20.0}


# --------------------------------------------------------------------------- against Paddle 3.3.1


# Fleet's lamb is paddle.optimizer.Lamb (always_adapt=False): an excluded tensor, or every tensor
# when lamb_weight_decay is 0, takes the Adam-style step without the trust ratio.
PADDLE_LAMB = {"decayed": (0.0078125, [], False), "bias_excluded": (0.0078125, ["bias"], False),
               "no_weight_decay": (0.0, [], False), "always_adapt": (0.0078125, ["bias"], True)}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", PADDLE_LAMB)
def test_steps_equal_paddles_lamb(tmp_path, case, dtype):
    weight_decay, excluded, always_adapt = PADDLE_LAMB[case]
    hyper = dict(lr=0.0625, betas=(0.875, 0.9990234375), eps=2.0 ** -20)  # exact in float32, as Paddle's attributes
    steps_equal_paddles(
        tmp_path, "lamb", dtype,
        dict(learning_rate=hyper["lr"], beta1=hyper["betas"][0], beta2=hyper["betas"][1], epsilon=hyper["eps"],
             lamb_weight_decay=weight_decay, always_adapt=always_adapt, excluded=excluded),
        lambda groups: LAMB(groups, **hyper, lamb_weight_decay=weight_decay, always_adapt=always_adapt))
