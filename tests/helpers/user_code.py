"""A user's code for the runs that bring their own (tests/test_hydra_app.py, tests/test_resume.py,
tests/test_readme.py), written in the tests so that nothing of lightfleet's is in it."""
from __future__ import annotations

# A user's model, written here so that nothing of lightfleet's is in it: nested blocks and batch norm.
USER_MODEL = '''
import pytorch_lightning as pl
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())

    def forward(self, x):
        return x + self.body(x)


class UserNet(pl.LightningModule):
    def __init__(self, in_features=32, width=16, classes=4, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Linear(in_features, width)
        self.stages = nn.ModuleList([nn.Sequential(Block(width), Block(width)) for _ in range(2)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
'''
