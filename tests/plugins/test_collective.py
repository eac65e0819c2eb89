"""collective.*: each Fleet knob reaches the PyTorch mechanism that carries it out, seen from inside
real `lightfleet` runs (CPU, gloo, 2 processes where distributed) by `CollectiveProbe`, a callback
(tests/helpers/probe.py) put in from the command line; knobs this device cannot apply give one info line; a bad value, or
one against a trainer argument, is exit 2 with nothing made; a Fleet file's collective fields
import as collective.* and train. tests/runner/test_plan.py checks what the knobs add to the plan;
the op-fusion flags' compile is the fast path's (tests/plugins/test_fast_path.py runs it)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from runner.core.errors import ConfigError
from tests.helpers.probe import HANG_STARTED

STEPS = ["trainer.max_steps=3", "trainer.enable_progress_bar=false", "paths.output_dir=run"]
PROBE = "+callbacks.probe._target_=tests.helpers.probe.CollectiveProbe"
TWO_RANKS = "trainer.devices=2"
BIG_MLP = "model.hidden_dim=512"  # about 6 MB of gradients: several 1 MB buckets


def probed(lightfleet, tmp_path: Path, *overrides: str, accelerator: str = "cpu") -> Dict[str, Any]:
    """Run lightfleet with the probe; what rank 0 saw, and the run's output as `_out`."""
    done = lightfleet(*overrides, *STEPS, PROBE, f"trainer.accelerator={accelerator}")
    assert done.returncode == 0, done.stderr
    seen = json.loads((tmp_path / "run" / "probe.rank0.json").read_text())
    return {**seen, "_out": done.stdout + done.stderr}


@pytest.mark.slow
def test_fuse_grad_size_sets_the_ddp_buckets(lightfleet, tmp_path):
    small = probed(lightfleet, tmp_path, TWO_RANKS, BIG_MLP, "collective.fuse_grad_size_in_MB=1")
    (tmp_path / "run").rename(tmp_path / "small")
    large = probed(lightfleet, tmp_path, TWO_RANKS, BIG_MLP)
    assert (small["bucket_cap_bytes"], large["bucket_cap_bytes"]) == (1 << 20, 32 << 20)
    assert large["buckets"] == 1 and small["buckets"] >= 5  # about 6 MB of gradients
    assert all(int(size) <= (1 << 20) + (1 << 16) for size in small["bucket_sizes"].split(", ")[:-1])


@pytest.mark.slow
def test_ddp_threads_foreach_and_cpu_only_knobs(lightfleet, tmp_path):
    seen = probed(lightfleet, tmp_path, TWO_RANKS, "collective.find_unused_parameters=true",
                  "collective.execution_strategy.num_threads=2", "collective.build_strategy.fuse_all_optimizer_ops=true",
                  "collective.cudnn_exhaustive_search=true", "collective.gpu_memory_fraction=0.5",
                  "collective.use_hierarchical_allreduce=true")
    assert seen["find_unused_parameters"] is True and seen["threads"] == 2 and seen["foreach"] is True
    out = seen["_out"]
    assert out.count("lightfleet: collective.cudnn_exhaustive_search: cuDNN runs on CUDA only; no effect on cpu") == 1
    assert out.count("lightfleet: collective.gpu_memory_fraction: applies to CUDA memory only; no effect on cpu") == 1
    build = (tmp_path / "run" / "build.yaml").read_text()
    assert "collective.use_hierarchical_allreduce=True -> no effect: DDP has no two-level allreduce" in build
    assert "collective.find_unused_parameters=True -> DDP find_unused_parameters" in build


@pytest.mark.slow
def test_sync_batch_norm_is_an_info_line_on_cpu(lightfleet, tmp_path):
    """DDP refuses SyncBatchNorm on CPU; on CUDA the knob is Lightning's sync_batchnorm=True."""
    seen = probed(lightfleet, tmp_path, TWO_RANKS, "model=resnet", "data=images", "collective.sync_batch_norm=true")
    assert seen["sync_batch_norm"] is False
    assert seen["_out"].count("lightfleet: collective.sync_batch_norm: DDP runs SyncBatchNorm on GPUs only; "
                              "no effect on cpu") == 1


class Block(nn.Module):
    """Not lightfleet's: a convolution block with batch norm, nested twice below."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)


def test_sync_batch_norm_on_cuda_converts_every_nested_batch_norm(spec_for):
    """What a CUDA run builds (runnable on CPU: the conversion needs no GPU, only SyncBatchNorm's
    forward does): the knob's Trainer argument in the plan, and the layer sync of lightfleet's DDP
    with it converting every batch norm of a model that is not ours."""
    from runner.rank.build import lightning_strategy
    from runner.command.planning import plan_for

    plan = plan_for(spec_for("collective.sync_batch_norm=true", TWO_RANKS, "trainer.accelerator=gpu",
                             "trainer.benchmark=false"))  # the run settles cudnn.benchmark: the plan sets no other trainer argument
    args = {arg: claim["value"] for arg, claim in plan.trainer_args.items()}
    assert args == {"sync_batchnorm": True} and plan.trainer_args["sync_batchnorm"]["by"] == "collective"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=lightning_strategy(plan), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **args)
    model = trainer.strategy._layer_sync.apply(nn.Sequential(Block(), nn.Sequential(Block(), nn.BatchNorm1d(4))))
    norms = [type(module) for module in model.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    assert norms == [nn.SyncBatchNorm] * 3


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm needs 2 CUDA devices")
def test_sync_batch_norm_converts_the_model_on_cuda(lightfleet, tmp_path):
    seen = probed(lightfleet, tmp_path, TWO_RANKS, "model=resnet", "data=images", "collective.sync_batch_norm=true",
                  accelerator="gpu")
    assert seen["sync_batch_norm"] is True


HIERARCHICAL = ["collective.use_hierarchical_allreduce=true", "strategy=[sharding]", "strategy.sharding.stage=2"]


@pytest.mark.parametrize("overrides, mesh", [
    (["trainer.devices=2", "trainer.num_nodes=2"], {"dp_replicate": 2, "dp_shard": 2}),  # a node's processes
    (["trainer.devices=4", "collective.hierarchical_allreduce_inter_nranks=2"], {"dp_replicate": 2, "dp_shard": 2}),
    (["trainer.devices=4", "collective.hierarchical_allreduce_inter_nranks=4"], {"dp_replicate": 1, "dp_shard": 4}),
])
def test_hierarchical_allreduce_is_hybrid_sharding_of_inner_groups(spec_for, overrides, mesh):
    from runner.command.planning import plan_for

    plan = plan_for(spec_for(*HIERARCHICAL, *overrides))
    layout = plan.lightning_strategy.component.kwargs["layout"]
    assert {name: layout[name] for name in mesh} == mesh


def test_hierarchical_allreduce_against_other_degrees_is_one_line(spec_for):
    with pytest.raises(ConfigError, match=r"^strategy.sharding.dp_degree=4: collective.use_hierarchical_allreduce "
                                          r"sets it to 2; set one of them$"):
        spec_for(*HIERARCHICAL, "trainer.devices=4", "collective.hierarchical_allreduce_inter_nranks=2",
                 "strategy.sharding.dp_degree=4")
    with pytest.raises(ConfigError, match=r"^collective.hierarchical_allreduce_inter_nranks=3: sharding groups of 3"):
        spec_for(*HIERARCHICAL, "trainer.devices=4", "collective.hierarchical_allreduce_inter_nranks=3")


@pytest.mark.slow
def test_a_rank_that_hangs_ends_the_run_at_the_timeout_naming_the_other_rank(lightfleet, tmp_path):
    done = lightfleet(*STEPS, TWO_RANKS, "trainer.max_steps=6", "collective.timeout_s=3",
                      "+callbacks.hang._target_=tests.helpers.probe.HangingRank")
    # From the hang, not from the command's start: start-up on a busy machine is no hang.
    assert time.time() - float((tmp_path / "run" / HANG_STARTED).read_text()) < 45
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lightfleet: run failed: rank 0: ") and "timed out" in last.lower(), last
    assert "collective.timeout_s=3.0 -> the process group's timeout" in (tmp_path / "run" / "build.yaml").read_text()


def test_a_bad_value_is_one_line_and_exit_2(lightfleet):
    done = lightfleet(*STEPS, "collective.fuse_grad_size_in_MB=-1")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["lightfleet: error: collective.fuse_grad_size_in_MB=-1.0: must be > 0"]
    done = lightfleet(*STEPS, "collective.sync_batch_norm=maybe")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr


def test_cudnn_search_against_trainer_benchmark_false_is_refused_before_anything_is_made(lightfleet, tmp_path):
    done = lightfleet(*STEPS, "collective.cudnn_exhaustive_search=true", "trainer.benchmark=false")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["lightfleet: error: collective.cudnn_exhaustive_search=True: "
                                        "trainer.benchmark=false says the opposite; set only one of them"]
    assert list(tmp_path.iterdir()) == []


FLEET_FILE = """\
fuse_grad_size_in_MB: 16
sync_batch_norm: true
execution_strategy {
  num_threads: 2
}
"""


@pytest.mark.slow
def test_a_fleet_files_collective_fields_import_and_train(lightfleet, tmp_path):
    (tmp_path / "fleet.prototxt").write_text(FLEET_FILE)
    done = lightfleet("import-fleet", "fleet.prototxt", "-o", "cfg/experiment/fleet.yaml")
    assert done.returncode == 0, done.stderr
    assert "not mapped" not in done.stderr
    seen = probed(lightfleet, tmp_path, "--config-dir", "cfg", "experiment=fleet", TWO_RANKS)
    assert (seen["bucket_cap_bytes"], seen["threads"]) == (16 << 20, 2)
