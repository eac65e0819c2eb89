"""Gradient merge in real Lightning training: each SGD update equals -lr times the merged gradient."""
from __future__ import annotations

import copy
import functools

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from plugins.gradient_merge import GradientSum
from probe import Knob, WiringCase
from runner.models import MLPClassifier

LR = 0.1
MICRO_BATCH = 8


class RecordSteps(pl.Callback):
    """The parameters right before and right after every optimizer step."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before.append([p.detach().clone() for p in pl_module.parameters()])

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if len(self.after) < len(self.before):  # this batch ended with an optimizer step
            self.after.append([p.detach().clone() for p in pl_module.parameters()])


def big_batch_gradient(model: MLPClassifier, parameters: list[torch.Tensor], inputs, targets) -> list[torch.Tensor]:
    """Plain PyTorch: gradient of the mean cross-entropy over all the given samples at `parameters`."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p, value in zip(model.parameters(), parameters, strict=True):
            p.copy_(value)
    F.cross_entropy(model(inputs), targets).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("k_steps, avg, num_micro_batches", [
    (4, True, 8),
    (4, False, 8),
    # The epoch's last window holds 1 micro-batch; Lightning still divides its loss by k.
    (3, True, 4),
    (3, False, 4),
])
def test_update_is_minus_lr_times_merged_gradient(k_steps, avg, num_micro_batches, tmp_path):
    torch.manual_seed(0)
    model = MLPClassifier(optimizer=functools.partial(torch.optim.SGD, lr=LR))  # no momentum: update = -lr * grad
    reference = copy.deepcopy(model)
    inputs, targets = torch.randn(num_micro_batches * MICRO_BATCH, 32), torch.randint(4, (num_micro_batches * MICRO_BATCH,))
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=MICRO_BATCH, shuffle=False)
    recorder = RecordSteps()
    callbacks = [recorder] if avg else [GradientSum(k_steps), recorder]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=k_steps,
                         callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, train_dataloaders=loader)

    windows = [range(start, min(start + k_steps, num_micro_batches)) for start in range(0, num_micro_batches, k_steps)]
    assert len(recorder.after) == len(windows)
    for window, before, after in zip(windows, recorder.before, recorder.after, strict=True):
        samples = slice(window.start * MICRO_BATCH, window.stop * MICRO_BATCH)
        gradient = big_batch_gradient(reference, before, inputs[samples], targets[samples])
        # sum: the sum of the micro-batch mean gradients, i.e. len(window) x the big batch's;
        # avg: that sum / k (the big batch's mean gradient when the window is full).
        scale = len(window) / k_steps if avg else len(window)
        for old, new, grad in zip(before, after, gradient, strict=True):
            torch.testing.assert_close(new - old, -LR * scale * grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("avg", [True, False])
def test_through_the_runner_the_merged_gradient_is_the_big_batch_mean_or_the_sum(avg, lightfleet, tmp_path):
    """`strategy=[gradient_merge]` on the command line, 4 micro-batches of 8: the first step's
    gradient is the gradient of the 32 samples' mean loss (avg), or 4 times it (the sum)."""
    done = lightfleet("strategy=[gradient_merge]", "strategy.gradient_merge.k_steps=4",
                      f"strategy.gradient_merge.avg={str(avg).lower()}", "data.batch_size=8", "trainer.max_steps=1",
                      "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
                      "paths.output_dir=run",
                      "+callbacks.first_step._target_=probe.FirstStep")
    assert done.returncode == 0, done.stderr[-3000:]
    record = torch.load(tmp_path / "run" / "first_step.pt", weights_only=False)
    assert len(record["batches"]) == 4
    inputs, targets = (torch.cat(tensors) for tensors in zip(*record["batches"]))
    model = MLPClassifier(input_dim=32, hidden_dim=64, num_blocks=3, num_classes=4)  # conf/model/mlp.yaml
    gradient = big_batch_gradient(model, list(record["initial"].values()), inputs, targets)
    for (name, grad), expected in zip(record["grads"].items(), gradient, strict=True):
        torch.testing.assert_close(grad, (1 if avg else 4) * expected, atol=1e-6, rtol=1e-5, msg=name)


# --------------------------------------------------------------------------- wiring (tests/test_wiring.py)


WIRING = [WiringCase({
    "k_steps": Knob(3, lambda trainer, model: trainer.accumulate_grad_batches),
    # Summing: GradientSum multiplies Lightning's averaged gradient back by k_steps.
    "avg": Knob(False, lambda trainer, model: not any(isinstance(c, GradientSum) and c.k_steps == 3
                                                     for c in trainer.callbacks)),
})]


# --------------------------------------------------------------------------- in every combination row (tests/test_combinations.py)


ROW = ["strategy.gradient_merge.k_steps=2"]


def row_effect(ranks):
    """One optimizer step per two batches."""
    for rank in ranks:
        assert [state["global_step"] for state in rank["states"]] == [i // 2 for i in range(len(rank["states"]))]
