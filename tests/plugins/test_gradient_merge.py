"""Gradient merge in real Lightning training: each SGD update equals -lr times the merged gradient,
and the parameters follow Fleet's own gradient merge (Paddle 3.3.1, tests/paddle/gradient_merge.py)."""
from __future__ import annotations

import copy
import functools
import json
from typing import Dict, Tuple

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from tests.helpers.paddle_reference import run_paddle
from plugins.gradient_merge import GradientSum
from runner.core.contribution import RunShape
from runner.core.world import World
from runner.models import ClassifierModule, MLPClassifier
from runner.strategies.gradient_merge import GradientMergeConfig

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


# --------------------------------------------------------------------------- Paddle as the reference


class LinearClassifier(ClassifierModule):
    """One linear layer under lightfleet's classifier loss (mean cross-entropy): the model that
    tests/paddle/gradient_merge.py builds in Paddle."""

    def __init__(self, in_features: int, num_classes: int, optimizer) -> None:
        super().__init__(optimizer)
        self.linear = nn.Linear(in_features, num_classes)

    @override
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs)


# 12 micro-batches: whole windows for k = 3 and 4 (Paddle carries a partial window over to the
# next epoch, Lightning steps on it at the epoch's end: docs/strategies.md).
PADDLE_RUNS = [(4, True), (4, False), (3, True), (3, False)]
PADDLE_MICRO_BATCHES = 12
IN_FEATURES, NUM_CLASSES = 5, 3


@pytest.fixture(scope="module")
def paddle_merge(tmp_path_factory) -> Tuple[Dict[str, np.ndarray], Dict[Tuple[int, bool], Dict[str, np.ndarray]]]:
    """The case (initial `weight` and `bias`, micro-batches `inputs` and `targets`) and, per
    (k_steps, avg) of PADDLE_RUNS and parameter name, Fleet's values before the first and after
    each micro-batch, [N + 1, ...]; parameters in torch's layout. One Paddle run."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((NUM_CLASSES, IN_FEATURES)).astype(np.float32)
    case = {"weight": weight, "bias": rng.standard_normal(NUM_CLASSES).astype(np.float32),
            "inputs": rng.standard_normal((PADDLE_MICRO_BATCHES, MICRO_BATCH, IN_FEATURES)).astype(np.float32),
            "targets": rng.integers(NUM_CLASSES, size=(PADDLE_MICRO_BATCHES, MICRO_BATCH))}
    folder = tmp_path_factory.mktemp("paddle_gradient_merge")
    np.savez(folder / "case.npz", lr=LR, runs=json.dumps([{"k_steps": k, "avg": avg} for k, avg in PADDLE_RUNS]),
             **{**case, "weight": weight.T})  # Paddle's linear weight is [in, out]
    run_paddle("gradient_merge", str(folder / "case.npz"), str(folder / "paddle.npz"))
    result = np.load(folder / "paddle.npz")
    histories = {run: {"linear.weight": np.concatenate([weight[None], result[f"{i}/weight"].transpose(0, 2, 1)]),
                       "linear.bias": np.concatenate([case["bias"][None], result[f"{i}/bias"]])}
                 for i, run in enumerate(PADDLE_RUNS)}
    return case, histories


@pytest.mark.parametrize("k_steps, avg", PADDLE_RUNS)
def test_parameters_follow_fleets_gradient_merge(k_steps, avg, paddle_merge, tmp_path):
    """Same linear classifier, initial parameters, micro-batches and SGD learning rate: after each
    merged step ours equal Fleet's (avg=false sums the k gradients and keeps the learning rate)."""
    case, histories = paddle_merge
    model = LinearClassifier(IN_FEATURES, NUM_CLASSES, optimizer=functools.partial(torch.optim.SGD, lr=LR))
    with torch.no_grad():
        model.linear.weight.copy_(torch.from_numpy(case["weight"]))
        model.linear.bias.copy_(torch.from_numpy(case["bias"]))
    samples = TensorDataset(torch.from_numpy(case["inputs"]).flatten(0, 1), torch.from_numpy(case["targets"]).flatten())
    # The trainer arguments and callbacks that strategy=[gradient_merge] contributes.
    contribution = GradientMergeConfig(k_steps=k_steps, avg=avg).contribute(RunShape(World(1, 1, 1)))
    recorder = RecordSteps()
    callbacks = [component.load()(**component.kwargs) for component in contribution.callbacks] + [recorder]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, **contribution.trainer_args)
    trainer.fit(model, train_dataloaders=DataLoader(samples, batch_size=MICRO_BATCH, shuffle=False))

    names = [name for name, _ in model.named_parameters()]
    for name, history in histories[(k_steps, avg)].items():
        # Fleet steps on the last micro-batch of each window of k, as Lightning does.
        assert [not np.array_equal(history[m + 1], history[m]) for m in range(PADDLE_MICRO_BATCHES)] \
            == [(m + 1) % k_steps == 0 for m in range(PADDLE_MICRO_BATCHES)], name
    assert len(recorder.after) == PADDLE_MICRO_BATCHES // k_steps
    for step, after in enumerate(recorder.after):
        for name, ours in zip(names, after, strict=True):
            fleets = torch.from_numpy(histories[(k_steps, avg)][name][(step + 1) * k_steps])
            torch.testing.assert_close(ours, fleets, rtol=1e-6, atol=1e-7, msg=f"{name} after step {step}")


@pytest.mark.slow
@pytest.mark.parametrize("avg", [True, False])
def test_through_the_runner_the_merged_gradient_is_the_big_batch_mean_or_the_sum(avg, lightfleet, tmp_path):
    """`strategy=[gradient_merge]` on the command line, 4 micro-batches of 8: the first step's
    gradient is the gradient of the 32 samples' mean loss (avg), or 4 times it (the sum)."""
    done = lightfleet("strategy=[gradient_merge]", "strategy.gradient_merge.k_steps=4",
                      f"strategy.gradient_merge.avg={str(avg).lower()}", "data.batch_size=8", "trainer.max_steps=1",
                      "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
                      "paths.output_dir=run",
                      "+callbacks.first_step._target_=tests.helpers.probe.FirstStep")
    assert done.returncode == 0, done.stderr[-3000:]
    record = torch.load(tmp_path / "run" / "first_step.pt", weights_only=False)
    assert len(record["batches"]) == 4
    inputs, targets = (torch.cat(tensors) for tensors in zip(*record["batches"]))
    model = MLPClassifier(input_dim=32, hidden_dim=64, num_blocks=3, num_classes=4)  # conf/model/mlp.yaml
    gradient = big_batch_gradient(model, list(record["initial"].values()), inputs, targets)
    for (name, grad), expected in zip(record["grads"].items(), gradient, strict=True):
        torch.testing.assert_close(grad, (1 if avg else 4) * expected, atol=1e-6, rtol=1e-5, msg=name)
