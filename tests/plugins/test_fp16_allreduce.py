"""fp16_allreduce in real 2-process DDP training (gloo): the gradients every rank steps with are
the float32 average of the ranks' local gradients up to 16-bit rounding, carried in 16 bits,
and half the bytes of a float32 all-reduce go over the wire."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import load_ranks, run_two_ranks

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

STEPS = 3

SCRIPT = """
import pytorch_lightning as pl
import torch

from tests.helpers.distributed import AllReduceSpy, Record, fit, save
from plugins.fp16_allreduce import build_hook

class Gradients(pl.Callback):
    # This rank's local gradients (tensor hooks run before DDP's all-reduce) and the ones the
    # optimizer steps with, at every step.
    def __init__(self):
        self.local, self.steps = {}, []

    def on_train_start(self, trainer, pl_module):
        for index, param in enumerate(pl_module.parameters()):
            param.register_hook(lambda grad, index=index: self.local.__setitem__(index, grad.detach().clone()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = list(pl_module.parameters())
        self.steps.append({"local": [self.local[i] for i in range(len(params))],
                           "reduced": [p.grad.detach().clone() for p in params]})


spy = AllReduceSpy()
for dtype in DTYPES:  # one trainer after the other in the same 2 processes
    gradients, record = Gradients(), Record(spy)
    trainer = fit(lambda: build_hook(dtype=dtype), [gradients, record], max_steps=STEPS)
    save(dtype, {"gradients": gradients.steps, "steps": record.steps, "state": trainer.strategy.comm_hook_state,
                 # what DDP's own float32 all-reduce sends per step: every parameter's gradient
                 "dense_bytes": sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters())})
"""

# Unit roundoff of each wire type: one rounding when casting a rank's gradient, one when summing.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Both wire types trained in one 2-process launch (starting the processes is the slow part)."""
    tmp_path = tmp_path_factory.mktemp("fp16_allreduce")
    run_two_ranks(SCRIPT.replace("STEPS", str(STEPS)).replace("DTYPES", repr(list(UNIT_ROUNDOFF))), tmp_path)
    return tmp_path


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_gradients_are_averaged_in_16_bits_with_half_the_bytes(dtype, run_dir):
    ranks = load_ranks(run_dir, dtype)
    wire = getattr(torch, dtype)
    for rank in ranks:
        assert rank["state"] is None  # the hook reduces over the default (world) group
        assert len(rank["gradients"]) == STEPS
    for step in range(STEPS):
        local = [rank["gradients"][step]["local"] for rank in ranks]
        reduced = [rank["gradients"][step]["reduced"] for rank in ranks]
        for l0, l1, r0, r1 in zip(*local, *reduced, strict=True):
            assert r0.dtype == torch.float32 and torch.equal(r0, r1)  # restored to float32, same on both ranks
            assert not torch.equal(l0, l1)  # the ranks saw different data: there was something to average
            assert torch.equal(r0.to(wire).float(), r0)  # every value went through the 16-bit wire type
            mean = (l0 + l1) / 2
            # Within the roundoff of casting each local gradient and of their 16-bit sum (near zero:
            # two roundings at float16's subnormal spacing, 2^-24).
            bound = 2 * UNIT_ROUNDOFF[dtype] * (l0.abs() + l1.abs()) / 2 + 2.0 ** -23
            assert ((r0 - mean).abs() <= bound).all(), (r0 - mean).abs().max()
    for rank in ranks:
        steps = rank["steps"]
        assert [s["all_reduce_calls"] > 0 for s in steps] == [True] * STEPS
        # Everything all-reduced at a step is the 16-bit gradients: half of float32's bytes.
        assert [s["all_reduce_bytes"] / rank["dense_bytes"] for s in steps] == [0.5] * STEPS
