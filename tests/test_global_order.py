"""lightfleet's global order in real runs (runner/data/order.py; issue 41): the same samples at
every optimizer step whatever the number of processes, read from every rank by
tests/helpers/probe.py:SampleIds. The rule itself, for every built-in data module and in process:
tests/runner/test_data.py."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.helpers.probe import samples_per_step
from tests.helpers.user_code import USER_DATA, USER_DATA_CONF

pytestmark = pytest.mark.slow  # every test here trains in processes of its own

SAMPLE_IDS = "+callbacks.ids._target_=tests.helpers.probe.SampleIds"
QUIET = ("trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")


def test_1001_samples_train_the_same_global_batches_on_2_processes_and_on_1(lightfleet, tmp_path):
    """Issue 41: DistributedSampler padded 1,001 samples to 1,002 on 2 processes (a last step of
    2 x 53 with a duplicate; 105 alone on 1 process at batch 128). On the global order, both runs
    train 7 steps of G = 128 distinct samples, the same ones at every step, and the last 105 of
    the epoch's order sit it out."""
    runs = {"two": ["trainer.devices=2"], "one": ["trainer.devices=1", "trainer.accumulate_grad_batches=2"]}
    for run, overrides in runs.items():
        done = lightfleet("data.num_train=1001", "data.batch_size=64", "trainer.max_epochs=1", f"paths.output_dir={run}",
                          SAMPLE_IDS, *QUIET, *overrides)
        assert done.returncode == 0, done.stderr[-3000:]
    two, one = (samples_per_step(tmp_path / run) for run in runs)
    assert sorted(two) == list(range(7)) and all(sum(step.values()) == 128 for step in two.values())
    assert one == two
    trained = sum(two.values(), Counter())
    assert len(trained) == sum(trained.values()) == 7 * 128  # no sample twice


def test_a_user_data_module_with_the_one_line_resumes_on_another_number_of_processes(lightfleet, tmp_path):
    """A user's data module whose train_dataloader takes `sampler=global_order(self.trainer,
    dataset, B)` (tests/helpers/user_code.py): 1,001 samples, 2 processes x 32, 15 steps an epoch;
    stopped at step 12 (mid-epoch) and resumed on 1 process accumulating 2 batches, every step
    from 12 to 19, across the epoch's end, trains on the samples of the uninterrupted run."""
    (tmp_path / "user_data.py").write_text(USER_DATA)
    (tmp_path / "user" / "data").mkdir(parents=True)
    (tmp_path / "user" / "data" / "user_data.yaml").write_text(USER_DATA_CONF)
    full = lightfleet("--config-dir", "user", "data=user_data", "trainer.devices=2", "trainer.max_steps=20",
                      "+callbacks.model_checkpoint.every_n_train_steps=6", "+callbacks.model_checkpoint.save_top_k=-1",
                      "paths.output_dir=full", SAMPLE_IDS, *QUIET)
    assert full.returncode == 0, full.stderr[-3000:]
    (middle,) = (tmp_path / "full" / "checkpoints").glob("*-step=12.ckpt")
    assert torch.load(middle, weights_only=False)["lightfleet"]["data"] == {
        "order": "global", "epoch": 0, "epoch_finished": False, "steps_in_epoch": 12, "samples": 12 * 64}
    resumed = lightfleet("resume", "full", f"ckpt_path='{middle}'", "trainer.devices=1",
                         "trainer.accumulate_grad_batches=2", "paths.output_dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    uninterrupted = samples_per_step(tmp_path / "full")
    assert sorted(uninterrupted) == list(range(20)) and all(sum(step.values()) == 64 for step in uninterrupted.values())
    assert samples_per_step(tmp_path / "resumed") == {step: ids for step, ids in uninterrupted.items() if step >= 12}
