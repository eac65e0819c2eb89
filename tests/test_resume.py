"""Resume is exact: `lightfleet resume` from a checkpoint taken mid-run continues to the end of the
original run, and every rank ends with the parameters and optimizer state of the uninterrupted
run, bit for bit, with the same losses logged at the same steps.

`resumes_exactly` (tests/helpers/resume.py) is the check; tests/test_combinations.py applies it to
every allowed row of conf/compat.yaml. Here: fp16_allreduce (in no row), plain data parallelism and a single process,
resumed mid-epoch and at an epoch's last batch, and a user's own model (nested blocks, batch norm,
dropout) and data module brought through --config-dir."""
from __future__ import annotations

import textwrap

import pytest
import torch

from tests.helpers.resume import checkpoint_overrides, resumes_exactly
from tests.helpers.user_code import USER_MODEL

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

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

# A user's code, written in the tests so that nothing of lightfleet's is in it: USER_MODEL
# (tests/helpers/user_code.py: nested blocks, batch norm) with dropout in its blocks and an input noise drawn from
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
