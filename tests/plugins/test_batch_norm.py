"""Batch norm (a module whose buffers stay float32 while its parameters may not) under amp, float16
and bfloat16: with sharding stages 1-3, a user's models (written here so that nothing of
lightfleet's is in them) trained in 2 processes through the real `lightfleet` command, each run
finishing with a finite loss, its running statistics float32, moved by training and close to a
float32 run's; and in modules of amp's white list."""
from __future__ import annotations

import math
import types
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import yaml

from plugins.amp import apply_precision_lists
from plugins.transforms import ModelContext

# Two users' models: a small conv net on 3x16x16 images (BatchNorm2d in its stem and in nested
# residual blocks) and an MLP with a Linear -> BatchNorm1d stem before LayerNorm blocks. Adam; a
# loss(outputs, targets) and a repeated block list, as strategy pipeline needs.
USER_CODE = '''
import pytorch_lightning as pl
import torch
from torch import nn


class Classifier(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr

    def loss(self, logits, targets):
        return nn.functional.cross_entropy(logits.float(), targets)

    def training_step(self, batch, _):
        loss = self.loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, _):
        self.log("val_loss", self.loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class ConvBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())

    def forward(self, x):
        return x + self.body(x)


class ConvNet(Classifier):
    def __init__(self, channels=8, classes=4, lr=0.01):
        super().__init__(lr)
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU())
        self.blocks = nn.Sequential(ConvBlock(channels), ConvBlock(channels))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class LayerNormBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU())

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class StemNet(Classifier):
    def __init__(self, in_features=32, width=32, classes=4, lr=0.01):
        super().__init__(lr)
        self.stem = nn.Sequential(nn.Linear(in_features, width), nn.BatchNorm1d(width), nn.ReLU())
        self.blocks = nn.ModuleList([LayerNormBlock(width), LayerNormBlock(width)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
'''
# One experiment per model, pairing it with its data.
USER_CONFIGS = {"model/conv_net.yaml": "_target_: bn_user.ConvNet\n",
                "model/stem_net.yaml": "_target_: bn_user.StemNet\n",
                **{f"experiment/{model}.yaml": f"# @package _global_\ndefaults:\n  - override /model: {model}\n"
                                               f"  - override /data: {data}\n"
                   for model, data in (("conv_net", "images"), ("stem_net", "classification"))}}

# 256 samples, 64 a batch, 2 ranks: 2 steps an epoch, so 4 steps validate twice with the statistics
# training left.
QUICK = ("trainer.devices=2", "trainer.max_steps=4", "data.num_train=256", "data.num_val=128",
         "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", "+callbacks.running_stats._target_=tests.helpers.probe.RunningStats")
DTYPES = ("float16", "bfloat16")
# After 4 steps, the running statistics of an amp run against the float32 run's: the inputs of
# batch norm differ by the half formats' rounding (2^-11 float16, 2^-8 bfloat16, relative) carried
# through a few layers and steps.
TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}


@pytest.fixture
def user(tmp_path: Path) -> Path:
    (tmp_path / "bn_user.py").write_text(USER_CODE)
    for name, text in USER_CONFIGS.items():
        (tmp_path / "user" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "user" / name).write_text(text)
    return tmp_path


def train(lightfleet, *overrides: str, multirun: bool = False) -> None:
    done = lightfleet(*["-m"] * multirun, "--config-dir", "user", *QUICK, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]


def jobs(sweep: Path) -> Dict[str, Path]:
    """A multirun's job directories by their overrides, joined by spaces."""
    listed = yaml.safe_load((sweep / "sweep.yaml").read_text())["jobs"]
    return {" ".join(job["overrides"]): sweep / str(number) for number, job in listed.items()}


def finished(run: Path) -> Dict[str, Any]:
    """What every rank of `run` ended with; asserts the loss is finite and each running statistic
    is float32 and moved by training."""
    results = yaml.safe_load((run / "results.yaml").read_text())
    assert results["global_step"] == 4 and math.isfinite(results["train_loss"]), results
    assert math.isfinite(results["val_loss"]), results
    ranks = [torch.load(run / f"running_stats.rank{rank}.pt") for rank in range(2)]
    # Every rank holds the batch norms, but a pipeline's only those of its stages.
    assert any("running_" in name for rank in ranks for name in rank["end"]), run.name
    for rank in ranks:
        running = {name: end for name, end in rank["end"].items() if "running_" in name}
        for name, end in running.items():
            assert end.dtype == torch.float32 and end.isfinite().all(), (run.name, name, end)
            assert not torch.equal(end, rank["start"][name]), (run.name, name, "not updated")
    return {"results": results, "ranks": ranks}


# The MLP in float16, the conv net in bfloat16: each half format meets both batch norms.
HALF_FORMAT = {"stem_net": "float16", "conv_net": "bfloat16"}


@pytest.mark.slow
@pytest.mark.parametrize(("model", "dtype"), HALF_FORMAT.items())
def test_amp_sharding_stages_keep_float32_running_stats(lightfleet, user, model, dtype):
    """Stages 1-3 under amp (one multirun of 3 jobs), against float32 stage 3."""
    train(lightfleet, f"experiment={model}", "strategy=[amp,sharding]", "strategy.sharding.stage=1,2,3",
          f"strategy.amp.dtype={dtype}", "paths.sweep_dir=amp", multirun=True)
    train(lightfleet, f"experiment={model}", "strategy=[sharding]", "strategy.sharding.stage=3", "paths.output_dir=fp32")
    reference = finished(user / "fp32")
    runs = jobs(user / "amp")
    assert len(runs) == 3
    for overrides, run in runs.items():
        amp = finished(run)
        # Rank 0's: its statistics follow its own batches alike under DDP (stage 1 sends rank
        # 0's buffers to the others before each forward) and FSDP (each rank keeps its own).
        for name, expected in reference["ranks"][0]["end"].items():
            assert torch.allclose(amp["ranks"][0]["end"][name], expected, rtol=TOLERANCE[dtype],
                                  atol=TOLERANCE[dtype]), (overrides, name)
        assert amp["results"]["train_loss"] == pytest.approx(reference["results"]["train_loss"], rel=TOLERANCE[dtype])

@pytest.mark.slow
@pytest.mark.parametrize(("model", "dtype"), HALF_FORMAT.items())
def test_amp_with_recompute_and_pipeline_keeps_float32_running_stats(lightfleet, user, model, dtype):
    train(lightfleet, f"experiment={model}", "strategy=[amp,recompute],[amp,pipeline]",
          f"strategy.amp.dtype=choice({dtype})", "paths.sweep_dir=amp", multirun=True)
    runs = jobs(user / "amp")
    assert len(runs) == 2
    for run in runs.values():
        finished(run)


def user_model(name: str) -> torch.nn.Module:
    """One of the user's models, in this process."""
    module = types.ModuleType("bn_user")
    exec(USER_CODE, module.__dict__)
    return getattr(module, name)()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model", "white_list", "inputs"), [("StemNet", ["BatchNorm1d"], (8, 32)),
                                                              ("ConvNet", ["blocks.*"], (8, 3, 16, 16))])
def test_white_listed_batch_norm_keeps_float32_weights_and_statistics(dtype, model, white_list, inputs):
    """amp's white list runs a module in the half dtype: a batch norm in it takes half inputs beside
    its float32 weights and running statistics, which it updates, and its weights get gradients."""
    model = user_model(model)
    apply_precision_lists(model, ModelContext(model), dtype, custom_white_list=white_list, custom_black_list=[])
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    outputs = []
    for norm in norms:
        norm.register_forward_hook(lambda module, args, output: outputs.append(output.dtype))
    with torch.autocast("cpu", dtype=getattr(torch, dtype)):
        model.loss(model(torch.randn(*inputs)), torch.randint(0, 4, (inputs[0],))).backward()
    assert outputs == [getattr(torch, dtype)] * len(norms)
    for norm in norms:
        assert norm.running_mean.dtype == norm.running_var.dtype == norm.weight.dtype == torch.float32
        assert norm.num_batches_tracked == 1 and norm.running_var.ne(1).all()
        assert norm.weight.grad is not None and norm.weight.grad.isfinite().all()
