"""fp16_allreduce in real 2-process DDP training (gloo): the gradients every rank steps with are
the float32 average of the ranks' local gradients up to 16-bit rounding, carried in 16 bits,
and half the bytes of a float32 all-reduce go over the wire."""
from __future__ import annotations

import pytest
import torch

from distributed import load_ranks, run_two_ranks

STEPS = 3

SCRIPT = """
import sys

import pytorch_lightning as pl
import torch

from distributed import AllReduceSpy, Record, fit, save
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
dense_bytes = []  # per bucket: what DDP's own float32 all-reduce of it would send


def counting_hook_factory():
    state, hook = build_hook(dtype=sys.argv[2])

    def counting_hook(state, bucket):
        dense_bytes.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return hook(state, bucket)

    return state, counting_hook


gradients, record = Gradients(), Record(spy)
trainer = fit(counting_hook_factory, [gradients, record], max_steps=STEPS)
save("record", {"gradients": gradients.steps, "steps": record.steps, "dense_bytes": sum(dense_bytes),
                "state": trainer.strategy.comm_hook_state})
""".replace("STEPS", str(STEPS))

# Unit roundoff of each wire type: one rounding when casting a rank's gradient, one when summing.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gradients_are_averaged_in_16_bits_with_half_the_bytes(dtype, tmp_path):
    run_two_ranks(SCRIPT.replace("sys.argv[2]", repr(dtype)), tmp_path)
    ranks = load_ranks(tmp_path)
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
            # Within the roundoff of casting each local gradient and of their 16-bit sum (+ float16
            # subnormals' absolute spacing, 2^-24).
            bound = 2 * UNIT_ROUNDOFF[dtype] * (l0.abs() + l1.abs()) / 2 + 2.0 ** -23
            assert ((r0 - mean).abs() <= bound).all(), (r0 - mean).abs().max()
    for rank in ranks:
        steps = rank["steps"]
        assert [s["all_reduce_calls"] > 0 for s in steps] == [True] * STEPS
        # Everything all-reduced during training is 16-bit gradients: half of float32's bytes.
        assert sum(s["all_reduce_bytes"] for s in steps) / rank["dense_bytes"] == 0.5
