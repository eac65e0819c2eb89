"""The collective traffic a real run counts (measure.traffic=true, plugins/traffic.py): real
2-process runs of the command over gloo (4 for hybrid sharding), one per strategy row, whose
traffic/rank<R>.jsonl must equal, step by step, what each strategy sends by a formula written
here from the model's parameter sizes (docs/rehearse.md, "Collective traffic, counted in real runs")."""
from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import post_localSGD_hook

from plugins import fp16_allreduce, localsgd, traffic
from runner.core.plan import Plan
from runner.models import MLPClassifier
from tests.helpers.traffic import MODEL, STEPS, W, traffic_of  # noqa: F401 (a fixture)

PARAMS = [p for p in MLPClassifier(**MODEL).parameters()]
N = sum(p.numel() for p in PARAMS)  # the model's parameters, all float32
FLOAT = 4


def padded_shard(world: int) -> int:
    """Elements of one rank's FSDP2 shard: every parameter split along dim 0, padded to a multiple of `world`."""
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in PARAMS)


def dgc_message(sparsity: float) -> int:
    """DGC's bytes per step: per parameter its ceil(numel (1 - sparsity)) (at least 1) largest
    values (float32) and as many int32 positions."""
    sent = sum(max(1, math.ceil(round(p.numel() * (1 - sparsity), 6))) for p in PARAMS)
    return sent * (FLOAT + 4)


def sent(record: dict) -> Dict[str, tuple]:
    """A step's rows as op -> (group_size, bytes)."""
    rows = record["collectives"]
    assert len({row["op"] for row in rows}) == len(rows), rows  # one group size per op in these runs
    return {row["op"]: (row["group_size"], row["bytes"]) for row in rows}


def every_step(ranks: List[List[dict]], expected) -> None:
    """Every rank recorded STEPS optimizer steps, step s sending `expected(rank, s)`."""
    for rank, records in enumerate(ranks):
        assert [record["step"] for record in records] == list(range(1, STEPS + 1))
        for record in records:
            assert all(row["nodes"] == 1 for row in record["collectives"])
            assert sent(record) == expected(rank, record["step"]), (rank, record)


# --------------------------------------------------------------------------- data parallel


@pytest.mark.slow
def test_ddp_all_reduces_every_gradient_once_per_optimizer_step(traffic_of):
    # Two micro-batches a step: DDP all-reduces at the last one only.
    every_step(traffic_of("ddp"), lambda rank, step: {"all_reduce": (W, N * FLOAT)})


@pytest.mark.slow
def test_fp16_allreduce_sends_half_the_bytes(traffic_of):
    every_step(traffic_of("fp16_allreduce"), lambda rank, step: {"all_reduce": (W, N * 2)})


@pytest.mark.slow
def test_dgc_all_reduces_densely_then_gathers_values_and_positions(traffic_of):
    def expected(rank, step):
        return {"all_reduce": (W, N * FLOAT)} if step <= 1 else {"all_gather": (W, dgc_message(0.99))}

    every_step(traffic_of("dgc"), expected)


@pytest.mark.slow
def test_localsgd_averages_the_parameters_every_k_steps(traffic_of):
    # Gradients all-reduced until begin_step; after it, the parameters every k_steps (steps 3, 5, ...).
    def expected(rank, step):
        return {"all_reduce": (W, N * FLOAT)} if step == 1 or (step - 1) % 2 == 0 else {}

    every_step(traffic_of("localsgd"), expected)


@pytest.mark.slow
def test_adaptive_localsgd_averages_the_parameters_and_the_loss(traffic_of):
    # Step 1 (begin_step): gradients, and the loss (one float64) that sets the first period;
    # after it, at each averaging, the parameters and the loss that sets the next period.
    ranks = traffic_of("adaptive_localsgd")
    for records in ranks:
        assert sent(records[0]) == {"all_reduce": (W, N * FLOAT + 8)}
        assert all(sent(record) in ({}, {"all_reduce": (W, N * FLOAT + 8)}) for record in records[1:])
        assert any(sent(record) for record in records[1:])
    assert ranks[0] == ranks[1]


# --------------------------------------------------------------------------- sharding


@pytest.mark.slow
def test_zero_stage1_all_reduces_gradients_and_broadcasts_every_parameter(traffic_of):
    # Each parameter's owner broadcasts it after its step; every rank takes part in every broadcast.
    every_step(traffic_of("zero1"), lambda rank, step: {"all_reduce": (W, N * FLOAT),
                                                        "broadcast": (W, N * FLOAT)})


@pytest.mark.slow
def test_fsdp_stage3_gathers_padded_shards_twice_a_micro_batch_and_reduce_scatters_once_a_step(traffic_of):
    shard = padded_shard(W) * FLOAT
    assert shard * W > N * FLOAT  # the head's 5 rows are padded to 6
    # 2 micro-batches a step, each gathering in forward and in backward; gradients reduced at the last.
    every_step(traffic_of("zero3"), lambda rank, step: {"all_gather": (W, 2 * 2 * shard),
                                                        "reduce_scatter": (W, W * shard)})


@pytest.mark.slow
def test_fsdp_under_amp_gathers_in_bfloat16_and_reduces_in_float32(traffic_of):
    shard = padded_shard(W)
    every_step(traffic_of("zero3_amp"), lambda rank, step: {"all_gather": (W, 2 * shard * 2),
                                                            "reduce_scatter": (W, W * shard * FLOAT)})


@pytest.mark.slow
def test_fsdp_stage2_gathers_padded_shards_once(traffic_of):
    shard = padded_shard(W) * FLOAT
    every_step(traffic_of("zero2"), lambda rank, step: {"all_gather": (W, shard), "reduce_scatter": (W, W * shard)})


@pytest.mark.slow
def test_hybrid_sharding_all_reduces_the_shards_over_the_replicas(traffic_of):
    # 4 processes: sharding groups of 2, replicated twice.
    shard = padded_shard(2) * FLOAT
    ranks = traffic_of("hybrid")
    assert len(ranks) == 4
    every_step(ranks, lambda rank, step: {"all_gather": (2, 2 * shard), "reduce_scatter": (2, 2 * shard),
                                          "all_reduce": (2, shard)})


# --------------------------------------------------------------------------- pipeline


@pytest.mark.slow
def test_pipeline_sends_the_activations_and_their_gradients_across_the_cut(traffic_of):
    # 4 micro-batches of 16 samples; the cut lies between two residual blocks: [16, hidden] each way.
    crossing = 4 * 16 * MODEL["hidden_dim"] * FLOAT
    # Forward: rank 0 sends activations, rank 1 receives them; backward: their gradients go back.
    # The mean loss goes from the last stage to the pipeline (one float32).
    every_step(traffic_of("pipeline"), lambda rank, step: {"send": (W, crossing), "recv": (W, crossing),
                                                           "broadcast": (W, FLOAT)})


# --------------------------------------------------------------------------- off


def test_counting_is_off_unless_asked_and_then_torch_hooks_are_its_own(spec_for):
    from runner.command.planning import plan_for

    def recorders(*overrides: str) -> List[str]:
        plan: Plan = plan_for(spec_for(*overrides))
        return [claim.component.target for claim in plan.callbacks if "traffic" in claim.component.target]

    assert recorders() == []
    assert recorders("measure.traffic=true") == ["plugins.traffic:TrafficRecorder"]
    assert not traffic.counting()
    assert fp16_allreduce.build_hook("float16")[1] is fp16_compress_hook
    assert localsgd.build_hook(begin_step=1)[1] is post_localSGD_hook
    traffic.count("all_reduce", torch.ones(3))  # off: nothing kept, nothing asked of torch.distributed
    assert traffic.take(1) == []


@pytest.mark.slow
def test_pipeline_replicas_all_reduce_and_broadcast_their_stage_parameters(traffic_of):
    # 4 processes: 2 pipelines of 2 stages (ranks 0, 1 and 2, 3); each stage's replicas all-reduce
    # its gradients (DDP) and broadcast its parameters after ZeRO's sharded step; the two stages
    # together hold the model.
    crossing = 4 * 16 * MODEL["hidden_dim"] * FLOAT
    ranks = traffic_of("pipeline_replicas")
    assert len(ranks) == 4
    stage_bytes = []
    for records in ranks[:2]:
        assert [record["step"] for record in records] == list(range(1, STEPS + 1))
        mine = sent(records[0])["all_reduce"]
        stage_bytes.append(mine[1])
        every_step([records], lambda rank, step: {"all_reduce": mine, "send": (W, crossing), "recv": (W, crossing),
                                                  "broadcast": (W, mine[1] + FLOAT)})  # and the loss
    assert sum(stage_bytes) == N * FLOAT and all(stage_bytes)
    assert ranks[2:] == ranks[:2]  # the other pipeline sends the same
