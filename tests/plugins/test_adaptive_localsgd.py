"""adaptive_localsgd in real 2-process DDP training (gloo): after begin_step the parameters are
averaged with a period k recomputed at every averaging from the loss averaged over the ranks and
the learning rate, k = ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps)) in [1, 16].

Direction: the formula shrinks k as the loss falls at a constant learning rate, and grows it when
the learning rate decays faster than the loss falls; both runs below train on a fast-falling loss.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.distributed import load_ranks, run_two_ranks
from plugins.adaptive_localsgd import AdaptiveModelAveraging, next_k_steps

BEGIN_STEP = 2
MAX_STEPS = 60
RUNS = {  # name: (init_k_steps, per-step learning-rate decay)
    "constant_lr": (4, 1.0),
    "decaying_lr": (2, 0.88),
}

SCRIPT = """
import pytorch_lightning as pl
import torch

from tests.helpers.distributed import AllReduceSpy, Record, fit, save
from plugins.adaptive_localsgd import AdaptiveModelAveraging
from plugins.localsgd import build_hook
from runner.models import MLPClassifier


class DecayingLR(MLPClassifier):
    def __init__(self, gamma):
        super().__init__()
        self.gamma = gamma

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Period(pl.Callback):  # the period after every step
    def __init__(self, averaging):
        self.averaging, self.k_steps = averaging, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.k_steps.append(self.averaging.k_steps)


class Local(pl.Callback):  # listed before the averaging: this rank's parameters after its own optimizer step
    def __init__(self):
        self.params = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append(torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone())


spy = AllReduceSpy()
for name, (init_k_steps, gamma) in RUNS.items():  # one trainer after the other in the same 2 processes
    averaging = AdaptiveModelAveraging(init_k_steps=init_k_steps, begin_step=BEGIN_STEP)
    local, period, record = Local(), Period(averaging), Record(spy)
    trainer = fit(lambda: build_hook(begin_step=BEGIN_STEP), [local, averaging, period, record],
                  max_steps=MAX_STEPS, model=DecayingLR(gamma), batch_size=64)
    save(name, {"steps": record.steps, "local": local.params, "k_steps": period.k_steps,
                "state": averaging.state_dict(), "logged_k": float(trainer.callback_metrics["localsgd_k"])})
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Both runs in one 2-process launch (starting the processes is the slow part)."""
    tmp_path = tmp_path_factory.mktemp("adaptive_localsgd")
    script = SCRIPT
    for name in ("RUNS", "BEGIN_STEP", "MAX_STEPS"):
        script = script.replace(name, repr(globals()[name]))
    run_two_ranks(script, tmp_path)
    return tmp_path


def replay(ranks, init_k_steps: int):
    """The schedule recomputed from both ranks' recorded losses and learning rates: per step, the
    period after it and whether it averaged."""
    k, loss0, lr0, next_average = init_k_steps, None, None, None
    periods, averaged = [], []
    for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        assert s0["lr"] == s1["lr"]
        loss, lr = (s0["loss"] + s1["loss"]) / 2, s0["lr"]
        averaged.append(s0["step"] == next_average)
        if s0["step"] == BEGIN_STEP:
            loss0, lr0, next_average = loss, lr, BEGIN_STEP + k
        elif averaged[-1]:
            k = min(max(math.ceil(math.sqrt(lr0 * loss / (lr * loss0) * init_k_steps)), 1), 16)
            next_average = s0["step"] + k
        periods.append(k)
    return periods, averaged, (loss0, lr0, next_average)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_period_follows_the_formula_and_parameters_are_averaged_then(name, run_dir):
    init_k_steps, _ = RUNS[name]
    ranks = load_ranks(run_dir, name)
    periods, averaged, (loss0, lr0, next_average) = replay(ranks, init_k_steps)
    assert sum(averaged) >= 4
    for rank in ranks:
        assert rank["k_steps"] == periods
        assert rank["logged_k"] == periods[-1]
        state = dict(rank["state"])
        assert len(state.pop("replicas")) == 2  # every rank's own parameters, for a resume
        assert state == {"syncs": sum(averaged), "k_steps": periods[-1], "loss0": loss0, "lr0": lr0,
                         "next_average_step": next_average}
    for s0, s1, averages in zip(ranks[0]["steps"], ranks[1]["steps"], averaged, strict=True):
        step, calls = s0["step"], s0["all_reduce_calls"]
        assert calls == s1["all_reduce_calls"]
        if step < BEGIN_STEP:  # synchronous gradients
            assert torch.equal(s0["params"], s1["params"]) and calls >= 1
        elif step == BEGIN_STEP:  # synchronous gradients + the reference loss
            assert torch.equal(s0["params"], s1["params"]) and calls >= 2
        elif averages:  # the parameters and the loss
            assert torch.equal(s0["params"], s1["params"]) and calls == 2, step
        else:  # local
            assert (s0["params"] - s1["params"]).abs().max() > 1e-5 and calls == 0, step


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_averaging_gives_every_rank_the_mean_of_the_ranks_local_steps(name, run_dir):
    """Witness of the averaging itself: each rank's parameters after its own optimizer step
    (recorded before the averaging callback ran), averaged here in plain PyTorch."""
    init_k_steps, _ = RUNS[name]
    ranks = load_ranks(run_dir, name)
    _, averaged = replay(ranks, init_k_steps)[:2]
    for index, averages in enumerate(averaged):
        local = [rank["local"][index] for rank in ranks]
        after = [rank["steps"][index]["params"] for rank in ranks]
        step = ranks[0]["steps"][index]["step"]
        if averages:
            # the ranks stepped apart, so the mean is neither rank's parameters nor their maximum
            assert (local[0] - local[1]).abs().max() > 1e-4, step
            mean = (local[0] + local[1]) / 2
            for params in after:
                torch.testing.assert_close(params, mean, rtol=0, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        else:  # nothing between the optimizer step and the end of the batch changed the parameters
            for params, own in zip(after, local):
                assert torch.equal(params, own), step


def losses_and_periods(run_dir, name):
    ranks = load_ranks(run_dir, name)
    losses = [(s0["loss"] + s1["loss"]) / 2 for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]
    return losses, ranks[0]["k_steps"]


@pytest.mark.slow
def test_period_shrinks_as_the_loss_falls_at_a_constant_learning_rate(run_dir):
    init_k_steps, _ = RUNS["constant_lr"]
    losses, periods = losses_and_periods(run_dir, "constant_lr")
    assert max(losses[BEGIN_STEP:]) < losses[BEGIN_STEP - 1]  # below loss0 at every later step
    assert min(losses) < 0.25 * losses[BEGIN_STEP - 1]  # and far below
    first_average = BEGIN_STEP + init_k_steps  # 1-based step; periods[i] is the one after step i + 1
    assert set(periods[:first_average - 1]) == {init_k_steps}
    # loss < loss0 caps k at ceil(sqrt(init_k_steps)) = 2 < init_k_steps; it reaches 1 when loss < loss0 / 4.
    assert max(periods[first_average - 1:]) == 2
    assert min(periods) == 1


@pytest.mark.slow
def test_period_grows_when_the_learning_rate_decays_faster_than_the_loss_falls(run_dir):
    init_k_steps, _ = RUNS["decaying_lr"]
    losses, periods = losses_and_periods(run_dir, "decaying_lr")
    assert min(losses) < 0.25 * losses[BEGIN_STEP - 1]  # the loss fell a lot, the learning rate more
    assert periods == sorted(periods)  # non-decreasing
    assert periods[-1] == 16 > init_k_steps  # up to the cap


def test_a_learning_rate_decayed_to_zero_gives_the_longest_period():
    """The last step of a cosine decay to 0 (model=vision's default) divided by zero before."""
    assert next_k_steps(lr0=0.1, loss0=2.0, lr=0.0, loss=1.0, init_k_steps=4) == 16
    assert next_k_steps(lr0=0.1, loss0=0.0, lr=0.1, loss=0.0, init_k_steps=4) == 16
    assert next_k_steps(lr0=0.1, loss0=2.0, lr=0.1, loss=0.5, init_k_steps=4) == 1  # sqrt(1) rounds up to 1


def test_state_round_trips_through_a_checkpoint():
    averaging = AdaptiveModelAveraging(init_k_steps=3, begin_step=5)
    averaging.syncs, averaging.k_steps, averaging.next_average_step = 7, 9, 42
    averaging.loss0, averaging.lr0 = 1.25, 0.1
    restored = AdaptiveModelAveraging(init_k_steps=3, begin_step=5)
    restored.load_state_dict(averaging.state_dict())
    assert restored.state_dict() == averaging.state_dict() == {
        "syncs": 7, "k_steps": 9, "loss0": 1.25, "lr0": 0.1, "next_average_step": 42}
