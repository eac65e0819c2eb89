"""`python -m pytest -m gpu`: the CUDA paths through the real command, on a machine with an NVIDIA
GPU (skipped without one). The rest of the suite trains on the CPU on purpose, wherever it runs:
tests/conftest.py hides the GPUs from it unless `-m gpu` selects these tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import yaml

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ONE_GPU = ("trainer.accelerator=gpu", "trainer.devices=1", "trainer.max_steps=20", "trainer.enable_progress_bar=false",
           "paths.output_dir=run", "+callbacks.probe._target_=tests.helpers.probe.CudaProbe")


def trained(lightfleet, tmp_path: Path, *overrides: str) -> Dict[str, Any]:
    done = lightfleet(*ONE_GPU, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    return {"probe": json.loads((run / "probe.json").read_text()),
            "results": yaml.safe_load((run / "results.yaml").read_text())}


def test_sharding_stage_3_trains_over_nccl_and_reports_cuda_memory(lightfleet, tmp_path):
    run = trained(lightfleet, tmp_path, "strategy=[sharding]", "strategy.sharding.stage=3")
    assert run["probe"]["device"].startswith("cuda") and run["probe"]["backend"] == "nccl"
    results = run["results"]
    assert results["device"] == torch.cuda.get_device_name(0)
    assert 0 < results["peak_memory_mb"] <= results["peak_reserved_mb"]
    assert results["train_loss"] == results["train_loss"]  # not NaN


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over nccl needs 2 GPUs")
def test_ddp_over_nccl_in_two_processes(lightfleet, tmp_path):
    run = trained(lightfleet, tmp_path, "trainer.devices=2")
    assert run["probe"]["backend"] == "nccl" and run["results"]["world_size"] == 2


def test_float16_amp_uses_the_real_grad_scaler_and_backs_off_on_overflow(lightfleet, tmp_path):
    # 2^40 overflows float16 gradients: the scaler halves the scale after every 2 overflowing steps.
    run = trained(lightfleet, tmp_path, "strategy=[amp]", "strategy.amp.init_loss_scaling=1099511627776")
    probe = run["probe"]
    assert probe["forward_dtypes"] == ["torch.float16"]
    assert "torch.amp.grad_scaler.GradScaler" in probe["scaler"] and probe["scaler"][0] == "plugins.amp.FleetGradScaler"
    assert probe["scale"] < 2.0 ** 40


def test_bf16_autocast_and_mfu_against_the_gpus_bf16_peak(lightfleet, tmp_path):
    run = trained(lightfleet, tmp_path, "strategy=[amp]", "strategy.amp.dtype=bfloat16", "model=gpt",
                  "data=language_model")
    assert run["probe"]["forward_dtypes"] == ["torch.bfloat16"] and run["probe"]["scale"] in (None, 1.0)
    results = run["results"]
    if results["peak_flops_per_device"] is not None:  # a GPU in Lightning's table or ours
        assert 0 < results["mfu"] < 1


def test_cudnn_benchmark_and_the_memory_fraction_apply(lightfleet, tmp_path):
    run = trained(lightfleet, tmp_path, "model=resnet", "data=images", "collective.cudnn_exhaustive_search=true",
                  "collective.gpu_memory_fraction=0.5")
    assert run["probe"]["cudnn_benchmark"] is True and run["probe"]["memory_fraction"] == 0.5


def test_a_convolution_run_takes_the_data_path_of_a_plain_loop(lightfleet, tmp_path):
    # Pinned batches from loader workers, channels-last inputs, cudnn.benchmark without being asked,
    # and figures that tell the truth: the loader keeps up, the device hardly idles between batches.
    run = trained(lightfleet, tmp_path, "model=resnet", "data=images", "data.input_shape=[3,64,64]",
                  "data.batch_size=128", "strategy=[amp]")
    probe, results = run["probe"], run["results"]
    assert probe["cudnn_benchmark"] is True and probe["channels_last_inputs"] == [True]
    assert probe["loader"]["pin_memory"] is True and probe["loader"]["num_workers"] >= 1
    assert results["device_idle_fraction"] is not None
    assert results["data_wait_fraction"] < 0.5  # loader time inside the fetch: not the host blocked on the device


def test_no_micro_batch_synchronises_the_device_only_logging_steps_do(lightfleet, tmp_path):
    # CUDA's own sync debug mode besides the aten ops (tests/test_runs.py counts those on a CPU).
    from tests.helpers.probe import reads_off_logging_steps

    k, every = 4, 5
    with_bar = [override for override in ONE_GPU if not override.startswith("trainer.enable_progress_bar")]
    done = lightfleet(*with_bar, "model=gpt", "data=language_model", "strategy=[amp,gradient_merge]",
                      "strategy.amp.dtype=bfloat16", f"strategy.gradient_merge.k_steps={k}",
                      f"trainer.log_every_n_steps={every}",
                      "+callbacks.syncs._target_=tests.helpers.probe.SynchronisingCalls")
    assert done.returncode == 0, done.stderr[-3000:]
    windows = json.loads((tmp_path / "run" / "syncs.json").read_text())
    assert reads_off_logging_steps(windows, k, every) == {}


FAST_PATH_PROBE = "+callbacks.fast_path._target_=tests.helpers.probe.FastPathProbe"
BF16_GPT = ("model=gpt", "data=language_model", "strategy=[amp]", "strategy.amp.dtype=bfloat16")


def fast_path_seen(tmp_path: Path) -> Dict[str, Any]:
    return json.loads((tmp_path / "run" / "fast_path.rank0.json").read_text())


def test_the_fast_paths_defaults_fuse_the_optimizer_and_flash_attention_runs(lightfleet, tmp_path):
    trained(lightfleet, tmp_path, *BF16_GPT, FAST_PATH_PROBE, "fast_path.attention=flash")
    seen = fast_path_seen(tmp_path)
    assert (seen["optimizer"], seen["fused"]) == ("AdamW", [True])  # fast_path.fused_optimizer=auto
    assert seen["attention"] == {"_scaled_dot_product_flash_attention": 2,
                                 "_scaled_dot_product_flash_attention_backward": 2}


def test_a_compiled_model_trains_in_bf16(lightfleet, tmp_path):
    run = trained(lightfleet, tmp_path, *BF16_GPT, FAST_PATH_PROBE, "+callbacks.fast_path.count_attention=false",
                  "fast_path.compile=true")
    seen = fast_path_seen(tmp_path)
    assert seen["compiled"] is True and seen["dynamo_graphs"] >= 1 and seen["fused"] == [True]
    assert run["results"]["train_loss"] == run["results"]["train_loss"]  # not NaN
