"""The real runs whose collective traffic tests count (measure.traffic=true, plugins/traffic.py):
tests/plugins/test_traffic.py checks them against formulas, tests/runner/test_rehearse_traffic.py
against the rehearsal of the same configs."""
from __future__ import annotations

import json
from typing import Dict, List

import pytest

W = 2  # processes of every run but hybrid sharding's
CLASSES = 5  # the head's rows: 5 split over 2 ranks pads FSDP's shards
MODEL = dict(input_dim=32, hidden_dim=64, num_blocks=4, num_classes=CLASSES)
COMMON = ["trainer.devices=2", "trainer.enable_progress_bar=false", "measure.traffic=true", "callbacks=none",
          *(f"model.{key}={value}" for key, value in MODEL.items()), f"data.num_classes={CLASSES}"]
STEPS = 4
# Each row: the command line's strategies and knobs.
ROWS = {
    "ddp": ["trainer.accumulate_grad_batches=2"],
    "fp16_allreduce": ["strategy=[fp16_allreduce]"],
    "dgc": ["strategy=[dgc]", "strategy.dgc.rampup_begin_step=1", "strategy.dgc.sparsity=[0.99]"],
    "localsgd": ["strategy=[localsgd]", "strategy.localsgd.begin_step=1", "strategy.localsgd.k_steps=2"],
    "adaptive_localsgd": ["strategy=[adaptive_localsgd]", "strategy.adaptive_localsgd.begin_step=1",
                          "strategy.adaptive_localsgd.init_k_steps=1"],
    "zero1": ["strategy=[sharding]", "strategy.sharding.stage=1"],
    "zero2": ["strategy=[sharding]", "strategy.sharding.stage=2", "strategy.sharding.segment_broadcast_MB=0.01"],
    "zero3": ["strategy=[sharding]", "strategy.sharding.stage=3", "strategy.sharding.segment_broadcast_MB=0.01",
              "strategy.sharding.gradient_merge_acc_step=2"],
    "zero3_amp": ["strategy=[amp,sharding]", "strategy.sharding.stage=3", "strategy.amp.dtype=bfloat16"],
    "hybrid": ["strategy=[sharding]", "strategy.sharding.stage=3", "strategy.sharding.dp_degree=2",
               "trainer.devices=4"],
    "pipeline": ["strategy=[pipeline]", "strategy.pipeline.accumulate_steps=4", "data.batch_size=64"],
    "pipeline_replicas": ["strategy=[pipeline,sharding]", "strategy.sharding.pp_degree=2", "trainer.devices=4",
                          "strategy.pipeline.accumulate_steps=4", "data.batch_size=64"],
}


@pytest.fixture(scope="module")
def traffic_of(tmp_path_factory, lightfleet_in):
    """traffic_of(row) -> each rank's records, in rank order: the row's run, made at its first use."""
    where = tmp_path_factory.mktemp("traffic")
    done: Dict[str, List[List[dict]]] = {}

    def run(row: str) -> List[List[dict]]:
        if row not in done:
            result = lightfleet_in(where, *COMMON, *ROWS[row], f"trainer.max_steps={STEPS}", f"paths.output_dir={row}")
            assert result.returncode == 0, result.stderr[-3000:]
            files = sorted((where / row / "traffic").glob("rank*.jsonl"), key=lambda f: int(f.stem[4:]))
            done[row] = [[json.loads(line) for line in f.read_text().splitlines()] for f in files]
        return done[row]

    return run
