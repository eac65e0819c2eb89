"""Every run measures itself (runner/rank/measure.py): figures checked against independent ones — the
samples the data and the step count imply, the test's own clock, torch's FLOP counter, and a
wider model's memory."""
from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.plugins.precision import MixedPrecision
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.probe import attention_in_plain_matmuls
from runner.data import SyntheticClassificationData, SyntheticLanguageModelData
from runner.models import GPTDecoder, MLPClassifier
from runner.rank import measure
from runner.rank.measure import RankFigures, RunMeter, peak_flops, percentile

STEPS = 30
QUIET = ("trainer.enable_progress_bar=false", "trainer.log_every_n_steps=5", f"trainer.max_steps={STEPS}")


def results(run: Path) -> dict:
    return yaml.safe_load((run / "results.yaml").read_text())


@pytest.mark.slow
def test_single_process_figures_agree_with_the_steps_and_the_clock(lightfleet, tmp_path):
    started = time.time()
    done = lightfleet("model=gpt", "data=language_model", "paths.output_dir=run", "measure.warmup_steps=3", *QUIET)
    elapsed = time.time() - started
    assert done.returncode == 0, done.stderr[-3000:]
    figures = results(tmp_path / "run")
    batch, seq_len = 32, 32  # conf/data/language_model.yaml
    assert figures["samples_seen"] == STEPS * batch and figures["global_batch"] == batch
    assert figures["warmup_steps"] == 3 and figures["measured_steps"] == STEPS - 3
    # The whole command, timed by the test, took longer than what the run says it spent.
    assert 0 < figures["startup_s"] < figures["wall_s"] <= elapsed
    assert figures["train_s"] < figures["wall_s"]
    assert figures["samples_per_s"] >= figures["samples_seen"] / elapsed
    # Throughput and step times describe the same steps: the mean step (a global batch at that
    # rate) is at least half the median (half the steps take the median or longer), and the
    # measured steps fit in the training time.
    mean_step = batch / figures["samples_per_s"]
    assert mean_step >= figures["step_time_median_s"] / 2
    assert figures["measured_steps"] * mean_step <= figures["train_s"]
    assert figures["step_time_median_s"] <= figures["step_time_p90_s"]
    assert figures["tokens_per_s"] == pytest.approx(figures["samples_per_s"] * seq_len)
    assert figures["mfu"] is None and figures["device"].startswith("cpu")  # no peak FLOP/s for CPUs
    assert figures["peak_memory_mb"] > 50 and figures["by_rank"]["peak_memory_mb"] == [figures["peak_memory_mb"]]
    # Logged over time too: the CSV logger has the throughput column.
    with open(tmp_path / "run" / "csv" / "metrics.csv") as metrics:
        logged = [float(row["tokens_per_s"]) for row in csv.DictReader(metrics) if row.get("tokens_per_s")]
    assert len(logged) >= STEPS // 5 - 1 and all(value > 0 for value in logged)
    assert "samples/s" in done.stdout and "peak memory" in done.stdout  # the end summary


@pytest.mark.slow
def test_two_replicas_count_both_and_a_pipeline_counts_its_batch_once(lightfleet, tmp_path):
    done = lightfleet("experiment=mlp_ddp_amp", "paths.output_dir=ddp", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp = results(tmp_path / "ddp")
    batch = yaml.safe_load((tmp_path / "ddp" / "config.yaml").read_text())["data"]["batch_size"]
    assert ddp["world_size"] == ddp["data_parallel_size"] == 2 and ddp["global_batch"] == 2 * batch
    assert ddp["samples_seen"] == STEPS * 2 * batch and len(ddp["by_rank"]["peak_memory_mb"]) == 2
    mean_step = 2 * batch / ddp["samples_per_s"]  # the global batch at the job's rate
    assert ddp["step_time_median_s"] / 2 <= mean_step and ddp["measured_steps"] * mean_step <= ddp["train_s"]

    done = lightfleet("experiment=gpt_pipeline_1f1b", "paths.output_dir=pipe", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    pipe = results(tmp_path / "pipe")
    batch = yaml.safe_load((tmp_path / "pipe" / "config.yaml").read_text())["data"]["batch_size"]
    assert pipe["world_size"] == 2 and pipe["data_parallel_size"] == 1  # both stages read the same batches
    assert pipe["samples_seen"] == STEPS * batch


@pytest.mark.slow
def test_a_model_twice_as_wide_reports_more_peak_memory(lightfleet, tmp_path):
    peaks = {}
    for width in (1024, 2048):
        done = lightfleet(f"model.hidden_dim={width}", f"paths.output_dir=w{width}", *QUIET)
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[width] = results(tmp_path / f"w{width}")["peak_memory_mb"]
    # 3 blocks of two square layers: parameters, gradients and momentum grow by 3 x 4 x 6.3M floats.
    assert peaks[2048] - peaks[1024] > 100


@pytest.mark.slow
def test_switched_off_the_run_records_no_figures(lightfleet, tmp_path):
    done = lightfleet("measure.enabled=false", "paths.output_dir=run", *QUIET)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "samples_per_s" not in results(tmp_path / "run")


def test_gpt_flops_per_token_matches_torchs_flop_counter(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attention_in_plain_matmuls)
    model = GPTDecoder(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)
    tokens = torch.randint(64, (1, 32))
    with FlopCounterMode(display=False) as counter:
        model.loss(model(tokens), tokens).backward()
    # torch counts matrix products (attention's in full, as the formula does); the formula also
    # counts biases and norms as weights: under 2% more here.
    assert model.flops_per_token * 32 == pytest.approx(counter.get_total_flops(), rel=0.03)


def test_percentile_is_the_nearest_rank():
    assert percentile([], 0.9) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(v) for v in range(1, 11)], 0.9) == 9.0


def test_summary_counts_replicas_once_over_the_slowest_rank_and_mfu_is_the_formula():
    meter = RunMeter(warmup_steps=1)
    meter.tokens_per_sample, meter.flops_per_sample, meter.peak_flops = 128, 6e9, 1e12
    meter.data_parallel_size, meter.step_samples, meter.device = 2, [8, 8, 8], torch.device("cpu")
    # Ranks 0 and 1 read the same samples (a 2-stage pipeline), as do 2 and 3: two replicas.
    # Each waits 0.01 s a step for its batches, rank 1 also 0.09 s more in its second step.
    ranks = [RankFigures(replica, 24, 16, [0.1, 0.1 + 0.1 * rank], [0.01, 0.01 + 0.09 * (rank == 1)], 0.0,
                         100.0 + rank, None)
             for rank, replica in enumerate([0, 0, 1, 1])]
    summary = meter._summarize(ranks)
    slowest = 0.1 + 0.4  # rank 3's two measured steps
    assert summary["samples_per_s"] == pytest.approx((16 + 16) / slowest)
    assert summary["tokens_per_s"] == pytest.approx(32 / slowest * 128)
    assert summary["mfu"] == pytest.approx(6e9 * 32 / slowest / (1e12 * 4))  # model FLOP/s over 4 devices' peak
    assert summary["samples_seen"] == 48 and summary["peak_memory_mb"] == 103.0 and summary["global_batch"] == 16
    assert summary["data_wait_fraction"] == pytest.approx(0.11 / 0.3) and summary["data_wait_s"] == pytest.approx(0.055)


@pytest.mark.parametrize("name, dtype, flops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),  # Lightning's table
    ("NVIDIA H200", torch.bfloat16, 989.4e12),  # ours: Lightning's names only H200 SXM1/NVL1 variants
    ("NVIDIA L40S", torch.float16, 362.05e12),  # ours: Lightning would read it as an L4
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
])
def test_peak_flops_by_gpu_name_and_dtype(monkeypatch, name, dtype, flops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == pytest.approx(flops)
    assert peak_flops(torch.device("cpu"), dtype) is None


# float16 autocast on CPU as strategy=[amp] asks for it (Lightning's "16-mixed" string means bf16 on CPUs).
@pytest.mark.parametrize("precision, dtype", [({"precision": "bf16-mixed"}, torch.bfloat16),
                                              ({"precision": "32-true"}, torch.float32),
                                              ({"plugins": [MixedPrecision("16-mixed", "cpu")]}, torch.float16)],
                         ids=["bf16", "float32", "float16"])
def test_mfu_is_taken_against_the_peak_of_the_dtype_the_run_computes_in(monkeypatch, tmp_path, precision, dtype):
    # A device table of the test's own (CPUs have none in torch's or Lightning's): a peak per dtype.
    peaks = {torch.bfloat16: 4e12, torch.float16: 3e12, torch.float32: 1e12}
    monkeypatch.setattr(measure, "peak_flops", lambda device, computes_in: peaks[computes_in])
    meter = RunMeter(warmup_steps=1)
    model = MLPClassifier()
    model.flops_per_sample = 1e6
    trainer = pl.Trainer(accelerator="cpu", devices=1, **precision, max_steps=3, callbacks=[meter],
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, SyntheticClassificationData())
    assert meter.summary["peak_flops_per_device"] == peaks[dtype]
    assert meter.summary["mfu"] == pytest.approx(1e6 * meter.summary["samples_per_s"] / peaks[dtype])


SLOW_DATA = '''
import time

from torch.utils.data import Dataset

from tests.helpers.probe import attention_in_plain_matmuls
from runner.data import SyntheticClassificationData, SyntheticLanguageModelData


class Slow(Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(0.01)  # a slow disk or decoder: 80 ms a batch of 8
        return self.dataset[index]


class SlowData(SyntheticClassificationData):
    def make_datasets(self, generator):
        train, val, test = super().make_datasets(generator)
        return Slow(train), val, test
'''


@pytest.mark.slow
def test_a_slow_loader_raises_the_wait_for_data_and_the_summary_says_so(lightfleet, tmp_path):
    (tmp_path / "slow_data.py").write_text(SLOW_DATA)
    (tmp_path / "user" / "data").mkdir(parents=True)
    (tmp_path / "user" / "data" / "slow.yaml").write_text("_target_: slow_data.SlowData\nbatch_size: 8\nnum_workers: 0\n")
    fractions = {}
    for data in ("classification", "slow"):
        done = lightfleet("--config-dir", "user", f"data={data}", "data.batch_size=8",
                          f"paths.output_dir={data}", *QUIET)
        assert done.returncode == 0, done.stderr[-3000:]
        measured = results(tmp_path / data)
        fractions[data] = measured["data_wait_fraction"]
        assert f"waiting for data {fractions[data]:.0%} of the step time" in done.stdout
        noted = "lightfleet: note: the input does not keep up" in done.stdout
        assert noted == (fractions[data] > 0.1 and measured["data_wait_s"] >= 0.001)  # a loader's own cost is no note
    # A loaded machine slows the steps too, so the rise is asserted, not a level.
    assert fractions["slow"] > max(0.2, 3 * fractions["classification"])
    assert "(data.num_workers, now 0)" in done.stdout  # the knob that helps, for the slow data


def test_the_summary_names_the_step_of_an_earlier_validation():
    from runner.command.job import summary_line

    ran = {"global_step": 60, "train_loss": 0.2, "val_loss": 0.304, "val_step": 30}
    assert summary_line(ran, 5.0).endswith("train_loss 0.2, val_loss 0.304 (at step 30)")
    assert summary_line({**ran, "val_step": 60}, 5.0).endswith("val_loss 0.304")


class BlocksAfterTheFetch(pl.Callback):
    """What a GPU's host does when something synchronises after the batch is in hand (a `.item()`
    for the progress bar, whose hooks run after the meter's): it blocks between two fetches."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.02)


class SlowItems(torch.utils.data.Dataset):
    """A slow disk or decoder: every item takes 5 ms to read."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(0.005)
        return self.dataset[index]


class SlowData(SyntheticClassificationData):
    def make_datasets(self, generator):
        train, val, test = super().make_datasets(generator)
        return SlowItems(train), val, test


@pytest.mark.parametrize("data, blocking, loads", [(SyntheticClassificationData, True, False), (SlowData, False, True)],
                         ids=["a hook blocks after the fetch", "the loader is slow"])
def test_waiting_for_data_is_the_loaders_own_time_not_time_blocked_after_the_fetch(tmp_path, data, blocking, loads):
    meter = RunMeter(warmup_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, accumulate_grad_batches=2, limit_val_batches=0,
                         callbacks=[meter, *([BlocksAfterTheFetch()] if blocking else [])], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(MLPClassifier(), data(batch_size=4))
    summary = meter.summary
    # Two micro-batches a step, each 20 ms blocked after its fetch, or 4 items x 5 ms in its fetch.
    assert summary["step_time_median_s"] >= 0.04
    if loads:
        assert summary["data_wait_s"] >= 0.04 and summary["data_wait_fraction"] > 0.5
    else:
        assert summary["data_wait_s"] < 0.01 and summary["data_wait_fraction"] < 0.1
    assert summary["device_idle_fraction"] is None  # a CPU: the host's clock is the device's


@pytest.mark.parametrize("seq_len", [8, 32])
def test_tokens_flops_and_mfu_of_a_language_model_follow_the_sequence_length(monkeypatch, tmp_path, seq_len):
    # A device table of the test's own: 1 TFLOP/s. A sample is seq_len tokens, each the model's FLOPs a token.
    monkeypatch.setattr(measure, "peak_flops", lambda device, computes_in: 1e12)
    meter = RunMeter(warmup_steps=1)
    model = GPTDecoder(vocab_size=64, seq_len=seq_len, d_model=32, n_heads=2, n_layers=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[meter], limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, SyntheticLanguageModelData(seq_len=seq_len, num_train=64, batch_size=8, num_workers=0))
    summary = meter.summary
    assert summary["tokens_per_sample"] == seq_len
    assert summary["flops_per_sample"] == model.flops_per_token * seq_len
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * seq_len)
    assert summary["mfu"] == pytest.approx(model.flops_per_token * seq_len * summary["samples_per_s"] / 1e12)


def test_an_evaluation_and_a_sanity_check_measure_nothing_and_fail_nothing(tmp_path):
    # `lightfleet eval` validates without training, and fit's sanity check validates before it:
    # the meter, which measures training, has nothing to pause there.
    meter = RunMeter(warmup_steps=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, num_sanity_val_steps=1, limit_val_batches=1,
                         callbacks=[meter], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    model, data = MLPClassifier(), SyntheticClassificationData(batch_size=8)
    trainer.validate(model, data, verbose=False)
    assert meter.summary == {}
    trainer.fit(model, data)
    assert meter.summary["measured_steps"] == 1
