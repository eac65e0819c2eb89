"""localsgd in real 2-process DDP training (gloo): synchronous data parallelism until begin_step,
then local SGD steps with the parameters averaged over the ranks every k_steps; the number of
all-reduce calls drops by k."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import load_ranks, run_two_ranks

BEGIN_STEP = 3
LOCAL_STEPS = 16  # after begin_step: a multiple of every k below
K_STEPS = (1, 4)
LR = 0.1  # plain SGD (fit's default): a local step is exactly params - LR * local gradient

SCRIPT = """
from tests.helpers.distributed import AllReduceSpy, Record, fit, save
from plugins.localsgd import ModelAveraging, build_hook

spy = AllReduceSpy()
for k_steps in K_STEPS:  # one trainer after the other in the same 2 processes
    averaging, record = ModelAveraging(k_steps=k_steps, begin_step=BEGIN_STEP), Record(spy)
    trainer = fit(lambda: build_hook(begin_step=BEGIN_STEP), [averaging, record], max_steps=BEGIN_STEP + LOCAL_STEPS,
                  lr=LR)
    save(f"k{k_steps}", {"initial": record.initial_params, "steps": record.steps, "syncs": averaging.syncs,
                         "logged_syncs": float(trainer.callback_metrics["localsgd_syncs"])})
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Every k trained in one 2-process launch (starting the processes is the slow part)."""
    tmp_path = tmp_path_factory.mktemp("localsgd")
    script = SCRIPT
    for name in ("K_STEPS", "BEGIN_STEP", "LOCAL_STEPS", "LR"):
        script = script.replace(name, repr(globals()[name]))
    run_two_ranks(script, tmp_path)
    return tmp_path


def averages_after(step: int, k_steps: int) -> bool:
    """Fleet's schedule: k local steps after begin_step, then an averaging, and so on."""
    return step > BEGIN_STEP and (step - BEGIN_STEP) % k_steps == 0


@pytest.mark.slow
@pytest.mark.parametrize("k_steps", K_STEPS)
def test_synchronous_until_begin_step_then_averaged_every_k_steps(k_steps, run_dir):
    ranks = load_ranks(run_dir, f"k{k_steps}")
    assert torch.equal(ranks[0]["initial"], ranks[1]["initial"])
    before = [rank["initial"] for rank in ranks]
    for index in range(BEGIN_STEP + LOCAL_STEPS):
        (s0, s1) = steps = [rank["steps"][index] for rank in ranks]
        step = s0["step"]
        assert step == s1["step"] == index + 1
        local = [b - LR * s["grad"] for b, s in zip(before, steps)]  # each rank's own SGD step
        if step <= BEGIN_STEP:  # synchronous: one averaged gradient, identical parameters
            assert torch.equal(s0["grad"], s1["grad"]), step
            assert torch.equal(s0["params"], s1["params"]), step
            assert s0["all_reduce_calls"] >= 1, step  # the gradient buckets
        elif averages_after(step, k_steps):  # the mean of the ranks' local steps
            assert not torch.equal(s0["grad"], s1["grad"]), step
            assert torch.equal(s0["params"], s1["params"]), step
            torch.testing.assert_close(s0["params"], (local[0] + local[1]) / 2)
            assert s0["all_reduce_calls"] == 1, step  # the parameters, flattened into one tensor
        else:  # purely local: own gradient, own parameters, no communication
            assert not torch.equal(s0["grad"], s1["grad"]), step
            assert (s0["params"] - s1["params"]).abs().max() > 1e-4, step
            for s, expected in zip(steps, local):
                torch.testing.assert_close(s["params"], expected)
            assert s0["all_reduce_calls"] == 0, step
        assert s0["all_reduce_calls"] == s1["all_reduce_calls"]
        before = [s["params"] for s in steps]
    for rank in ranks:
        assert rank["syncs"] == rank["logged_syncs"] == LOCAL_STEPS // k_steps


@pytest.mark.slow
def test_all_reduce_calls_drop_by_k(run_dir):
    def calls(k_steps: int, local: bool) -> int:
        steps = load_ranks(run_dir, f"k{k_steps}")[0]["steps"]
        return sum(s["all_reduce_calls"] for s in steps if (s["step"] > BEGIN_STEP) == local)

    k_small, k_large = K_STEPS
    assert calls(k_small, local=False) == calls(k_large, local=False) > 0  # the synchronous steps
    assert calls(k_small, local=True) == LOCAL_STEPS
    assert calls(k_small, local=True) / calls(k_large, local=True) == k_large / k_small
