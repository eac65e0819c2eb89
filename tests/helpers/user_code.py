"""A user's code for the runs that bring their own (tests/test_hydra_app.py, tests/test_resume.py,
tests/test_readme.py, tests/test_wheel.py, tests/test_global_order.py), written in the tests so that
nothing of lightfleet's is in it but the one documented line a data module takes to resume on any
number of processes."""
from __future__ import annotations

from pathlib import Path

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

# A user's data module with lightfleet's one line (docs/guide.md, "Your own LightningModule and
# DataModule"): its training order is lightfleet's global order, so it resumes on any number of processes.
USER_DATA = '''
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.data import global_order


class UserData(pl.LightningDataModule):
    def __init__(self, num_train=1001, batch_size=32):
        super().__init__()
        self.num_train, self.batch_size = num_train, batch_size

    def train_dataloader(self):
        inputs = torch.randn(self.num_train, 32, generator=torch.Generator().manual_seed(1))
        dataset = TensorDataset(inputs, (inputs[:, 0] > 0).long())
        return DataLoader(dataset, batch_size=self.batch_size,
                          sampler=global_order(self.trainer, dataset, self.batch_size))
'''

# USER_DATA's config in the user's config directory (data/user_data.yaml), with USER_DATA in user_data.py.
USER_DATA_CONF = "_target_: user_data.UserData\n"

# USER_MODEL's config in the user's config directory (model/user_net.yaml), with USER_MODEL in user_model.py.
USER_NET = "_target_: user_model.UserNet\nwidth: 16\n"


def shadowing_packages(folder: Path, *names: str) -> None:
    """Packages of the user's in `folder` named as lightfleet's (plugins, runner), each failing on
    import: run from `folder`, lightfleet must import its own."""
    for name in names:
        message = f"the user's own {name}/ was imported"
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(f"raise ImportError({message!r})\n")
