"""Resume is exact: `lightfleet resume` from a checkpoint taken mid-run continues to the end of the
original run, and every rank ends with the parameters and optimizer state of the uninterrupted
run, bit for bit, with the same losses logged at the same steps.

`resumes_exactly` is the check; tests/test_combinations.py applies it to every allowed row of
conf/compat.yaml. Here: fp16_allreduce (in no row), plain data parallelism and a single process,
resumed mid-epoch and at an epoch's last batch, and a user's own model (nested blocks, batch norm,
dropout) and data module brought through --config-dir."""
from __future__ import annotations

import csv
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch

from test_hydra_app import USER_MODEL

pytestmark = pytest.mark.slow  # every test here trains in processes of its own


# What the uninterrupted run adds: every rank's final state, and a checkpoint every `step` steps.
def checkpoint_overrides(step: int) -> list:
    return ["+callbacks.final._target_=probe.FinalState", f"+callbacks.model_checkpoint.every_n_train_steps={step}",
            "+callbacks.model_checkpoint.save_top_k=-1"]


def losses(run: Path) -> dict:
    rows = csv.DictReader((run / "csv" / "metrics.csv").open())
    return {int(r["step"]): r["train_loss"] for r in rows if r["train_loss"]}


def resumes_exactly(lightfleet: Callable, tmp_path: Path, full: str, step: int) -> None:
    """Resume run directory `full` (made with `checkpoint_overrides(step)`) from its checkpoint at
    `step` and compare the end of both runs."""
    (middle,) = (tmp_path / full / "checkpoints").glob(f"*-step={step}.ckpt")
    resumed = lightfleet("resume", full, f"ckpt_path='{middle}'", "paths.output_dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_end(tmp_path / full, tmp_path / "resumed", step)


def assert_same_end(full: Path, resumed: Path, step: int) -> None:
    """Every rank of run `resumed` (resumed at `step`) ended exactly as run `full`, which was never
    interrupted, and logged the same losses from `step` on."""
    ranks = sorted(path.name for path in full.glob("final.rank*.pt"))
    assert ranks and ranks == sorted(path.name for path in resumed.glob("final.rank*.pt"))
    for name in ranks:
        expected, got = (torch.load(run / name, weights_only=False) for run in (full, resumed))
        assert got["global_step"] == expected["global_step"] > step
        assert got["parameters"].keys() == expected["parameters"].keys()
        for key, value in expected["parameters"].items():
            assert torch.equal(got["parameters"][key], value), f"{name}: {key} differs after resume"
        assert len(got["optimizer"]) == len(expected["optimizer"])
        for mine, reference in zip(got["optimizer"], expected["optimizer"]):
            for key, value in reference.items():
                same = torch.equal(mine[key], value) if isinstance(value, torch.Tensor) else mine[key] == value
                assert same, f"{name}: optimizer state {key} differs after resume"
    assert losses(resumed) == {logged: loss for logged, loss in losses(full).items() if logged >= step}


# 512 samples, 64 a batch: 4 batches an epoch on each of 2 replicas (8 alone), so step 10 is in
# the middle of an epoch and step 8 ends one (Lightning then resumes at the next epoch).
STEPS = 20
CASES = {
    "fp16_allreduce": (["strategy=[fp16_allreduce]", "trainer.devices=2"], 10),
    "ddp": (["trainer.devices=2"], 10),
    "ddp_epoch_end": (["trainer.devices=2"], 8),
    "single": (["trainer.devices=1"], 10),
    # Dropout and the noise draw from every rank's generators; the user's loader shuffles with its own.
    "user_model": (["--config-dir", "user", "model=user_net", "trainer.devices=2"], 10),
    "user_model_and_data": (["--config-dir", "user", "model=user_net", "data=user_data", "trainer.devices=1"], 10),
}

# A user's code, written in the tests so that nothing of lightfleet's is in it: test_hydra_app's
# model (nested blocks, batch norm) with dropout in its blocks and an input noise drawn from
# numpy's and Python's generators, and a data module of the user's.
BLOCK_BODY = "nn.BatchNorm1d(width), nn.ReLU())"
STEP_BODY = "x, y = batch\n        loss = "
assert USER_MODEL.count(BLOCK_BODY) == USER_MODEL.count(STEP_BODY) == 1
USER_CODE = "import random\n\nimport numpy\n" + USER_MODEL.replace(
    BLOCK_BODY, "nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.3))").replace(
    STEP_BODY, "x, y = batch\n        x = x * (1 + 0.1 * numpy.random.rand() + 0.1 * random.random())\n        loss = "
) + textwrap.dedent('''

    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader


    class UserData(pl.LightningDataModule):
        def __init__(self, num_train=1024):
            super().__init__()
            self.num_train = num_train

        def train_dataloader(self):
            inputs = torch.randn(self.num_train, 32, generator=torch.Generator().manual_seed(1))
            return StatefulDataLoader(TensorDataset(inputs, (inputs[:, 0] > 0).long()), batch_size=64, shuffle=True)
    ''')
USER_CONFIGS = {"model/user_net.yaml": "_target_: user_code.UserNet\n",
                "data/user_data.yaml": "_target_: user_code.UserData\nnum_train: 1024\n"}


@pytest.mark.parametrize("case", CASES)
def test_resume_ends_bit_for_bit_where_the_uninterrupted_run_ends(case, lightfleet, tmp_path):
    (tmp_path / "user_code.py").write_text(USER_CODE)
    for name, text in USER_CONFIGS.items():
        (tmp_path / "user" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "user" / name).write_text(text)
    extra, step = CASES[case]
    full = lightfleet(*extra, "data.num_train=512", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1",
                      "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                      "paths.output_dir=full", *checkpoint_overrides(step))
    assert full.returncode == 0, full.stderr[-3000:]
    resumes_exactly(lightfleet, tmp_path, "full", step)
