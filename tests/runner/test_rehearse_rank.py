"""A rehearsed rank (runner/rank/rehearse.py), run as the command runs it: `python -m
runner.rank.rehearse RUN_DIR --rank R ...` over a run directory holding config.yaml and plan.yaml,
one fresh process per rank. Its parts against what real 1- and 2-process runs hold
(bench/auto_memory.py's PeakMemory); ZeRO stage 3's share of the model at 8 ranks against the
flat-shard formula; a tensor-parallel degree the model cannot take refused in one line, as a
rank of the real run refuses it; the first and last pipeline stages told apart."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import pytest

from runner.config.checks import validate
from runner.config.compose import compose_config
from tests.helpers.rehearsal import rehearse, zero_partition

pytestmark = pytest.mark.slow

GPT = ["model=gpt", "data=language_model"]
QUIET = ["logger=none", "callbacks=none", "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", "trainer.limit_val_batches=0", "trainer.max_steps=1"]


def gpt_parameter_shapes() -> List[Tuple[int, ...]]:
    """The built-in GPT's parameters (conf/model/gpt.yaml's sizes), built on the meta device."""
    import torch
    from hydra.utils import instantiate

    spec = validate(compose_config(GPT))
    with torch.device("meta"):
        model = instantiate(spec.cfg.model, _convert_="all")
    return [tuple(p.shape) for p in model.parameters()]


def test_stage3_at_8_ranks_holds_an_eighth_of_the_model(tmp_path):
    done, report = rehearse(tmp_path / "run", [*GPT, *QUIET, "strategy=[sharding]", "strategy.sharding.stage=3",
                                               "trainer.devices=8"], rank=0)
    assert done.returncode == 0, done.stderr[-3000:]
    # FSDP2's flat shards: dim 0 cut in 8 (rank 0 holds a whole chunk), AdamW's two float32 moments
    # and a step count per parameter.
    shapes = gpt_parameter_shapes()
    shard = sum(math.ceil(shape[0] / 8) * math.prod(shape[1:]) * 4 for shape in shapes)
    whole = sum(math.prod(shape) * 4 for shape in shapes)
    assert report["memory"]["optimizer_states"] == 2 * shard + 4 * len(shapes)
    assert abs(shard / whole - 1 / 8) < 0.01
    assert report["world_size"] == 8 and report["kind"] == "dp_shard 8"
    gathers = {row["op"]: row for row in report["collectives"]}
    assert gathers["all_gather"]["bytes"] == 2 * shard  # one unit: gathered for forward, again for backward
    assert gathers["reduce_scatter"]["bytes"] == 8 * shard  # every rank's whole gradient, reduced into its shard


def test_a_tensor_parallel_degree_the_model_cannot_take_fails_in_one_line(tmp_path):
    # 4 heads over 8 tensor-parallel ranks: the plan allows the degrees, the model's split does not.
    done, report = rehearse(tmp_path / "run", [*GPT, *QUIET, "strategy=[sharding]", "strategy.sharding.stage=3",
                                               "strategy.sharding.mp_degree=8", "trainer.devices=8"], rank=0)
    assert done.returncode == 2 and report is None
    assert done.stderr.strip().splitlines() == [
        "lightfleet: error: strategy.sharding.mp_degree=8: blocks.0.attn has 4 attention heads (64 features / "
        "head_dim 16), not divisible by 8 tensor-parallel ranks"]


def test_the_first_and_last_pipeline_stages_differ(tmp_path):
    overrides = [*GPT, *QUIET, "strategy=[pipeline]", "model.n_layers=4", "trainer.devices=4"]
    reports = {}
    for rank in (0, 3):
        done, reports[rank] = rehearse(tmp_path / "run", overrides, rank=rank)
        assert done.returncode == 0, done.stderr[-3000:]
    first, last = reports[0], reports[3]
    assert (first["kind"], last["kind"]) == ("pipeline stage 0 of 4 (first)", "pipeline stage 3 of 4 (last)")
    # conf/data/language_model.yaml: 32 samples of 32 tokens a batch, the pipeline's 4 micro-batches of 8;
    # a stage hands on float32 activations of the model's width (64) per micro-batch, and gets their gradients back.
    activation = 8 * 32 * 64 * 4
    sent = {report["rank"]: {row["op"]: (row["calls"], row["bytes"]) for row in report["collectives"]}
            for report in (first, last)}
    assert sent[0]["send"] == sent[0]["recv"] == sent[3]["send"] == sent[3]["recv"] == (4, 4 * activation)
    assert first["memory"]["parameters"] != last["memory"]["parameters"]
    assert first["tokens_per_step"] == last["tokens_per_step"] == 32 * 32


# (model of bench/auto_memory.py, processes, strategies with their knobs) rehearsed and run for real.
AGAINST_REAL_RUNS = [
    ("gpt", 1, {}),
    ("mlp", 2, {}),
    ("gpt", 2, {}),
    ("gpt", 2, {"sharding": {"stage": 3}}),
    ("gpt", 2, {"amp": {"dtype": "bfloat16"}, "recompute": {}}),
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Dict[Tuple[str, int], List[Dict[str, Any]]]:
    """What each rank of the real runs held, by kind (bench/auto_memory.py's PeakMemory: the busiest
    rank's peaks over the first step), the runs of one model and world size in one set of ranks."""
    from bench.auto_memory import measure

    found: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
    for model, world_size, strategies in AGAINST_REAL_RUNS:
        found.setdefault((model, world_size), []).append({"label": str(strategies), "strategies": strategies,
                                                          "batch_size": 0, "micro_batch": 0})
    for (model, world_size), listed in found.items():
        measure(model, world_size, listed, tmp_path_factory.mktemp(f"{model}{world_size}"))
    return found


@pytest.mark.parametrize("model, world_size, strategies", AGAINST_REAL_RUNS,
                         ids=[f"{m}x{w}-{'+'.join(s) or 'plain'}" for m, w, s in AGAINST_REAL_RUNS])
def test_rehearsed_parts_are_what_real_runs_hold(tmp_path, measured, model, world_size, strategies):
    from bench.auto_memory import KINDS, MODELS, QUIET, overrides

    real = next(entry["measured"] for entry in measured[(model, world_size)] if entry["strategies"] == strategies)
    quiet = [override for override in QUIET if "PeakMemory" not in override]
    done, report = rehearse(tmp_path / "run", [*MODELS[model], f"trainer.devices={world_size}", *quiet,
                                               *overrides(strategies)], rank=0)
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = {kind: report["memory"][kind] / real[kind] for kind in KINDS}
    # Measured: parameters, gradients and optimizer states to the byte but AdamW's step counts (4 bytes
    # each) and FSDP2's gathered parameters (its padding); activations within 4% (MemTracker counts
    # what forward makes and holds, PeakMemory what autograd saves).
    assert all(abs(ratio - 1) <= 0.15 for ratio in ratios.values()), ratios


# Rows of conf/compat.yaml that hold every strategy between them, each with the settings under
# which its members act (tests/helpers/strategies.py) and its own (after them), and the collectives
# the rehearsed step must show.
COVERING_ROWS = [
    (["amp", "gradient_merge", "recompute"], [], {"all_reduce"}),
    (["dgc", "recompute"], ["model/optimizer=sgd"], {"all_gather"}),  # the sparse exchange: values and indices
    (["amp", "localsgd"], ["strategy.localsgd.begin_step=3"], {"all_reduce"}),  # still synchronous at step 2
    (["adaptive_localsgd", "amp"], [], set()),  # local steps: it averages at its period's steps only
    (["amp", "lars", "recompute"], ["model/optimizer=sgd"], {"all_reduce"}),
    (["amp", "lamb", "sharding"], ["strategy.sharding.stage=2"],  # LAMB's norms of whole tensors: all-reduced
     {"all_gather", "reduce_scatter", "all_reduce"}),
    (["fp16_allreduce", "lamb"], [], {"all_reduce"}),
    (["amp", "pipeline", "sharding"], ["trainer.devices=4", "strategy.sharding.stage=1",
                                       "strategy.sharding.pp_degree=2"], {"send", "recv", "all_reduce", "broadcast"}),
]


def test_the_covering_rows_hold_every_strategy():
    from runner.config.compat import load_table
    from runner.strategies import schemas

    table = load_table()
    assert all(any(set(row) <= set(allowed) for allowed in table.allowed) for row, _, _ in COVERING_ROWS)
    assert {name for row, _, _ in COVERING_ROWS for name in row} == set(schemas()) - set(table.alone)


@pytest.mark.parametrize("row, settings, collectives", COVERING_ROWS, ids=["+".join(r) for r, _, _ in COVERING_ROWS])
def test_every_strategy_builds_and_steps_in_a_fake_world(tmp_path, row, settings, collectives):
    from tests.helpers.strategies import STRATEGIES

    devices = [] if any(s.startswith("trainer.devices=") for s in settings) else ["trainer.devices=2"]
    done, report = rehearse(tmp_path / "run", [*GPT, *QUIET, f"strategy=[{','.join(row)}]", *devices,
                                               *(o for name in row for o in STRATEGIES[name].row), *settings], rank=0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {r["op"] for r in report["collectives"]} == collectives
    assert all(report["memory"][part] > 0 for part in ("parameters", "gradients", "activations"))
    assert report["flops"] and report["memory_traffic_bytes"] > 0


def test_zero_stage1_names_the_rank_holding_the_most_optimizer_state(tmp_path):
    import torch
    from hydra.utils import instantiate

    world = 64
    overrides = [*GPT, *QUIET, "strategy=[sharding]", "strategy.sharding.stage=1", f"trainer.devices={world}"]
    spec = validate(compose_config(overrides))
    with torch.device("meta"):
        optimizer = instantiate(spec.cfg.model, _convert_="all").configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    held, counts = zero_partition(optimizer.param_groups, world)
    heaviest = held.index(max(held))
    done, report = rehearse(tmp_path / "run", overrides, rank=heaviest)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["heaviest_rank"] == heaviest
    # AdamW's two float32 moments and a step count per parameter.
    assert report["memory"]["optimizer_states"] == 2 * 4 * held[heaviest] + 4 * counts[heaviest]


def test_offloaded_shards_are_host_memory(tmp_path):
    done, report = rehearse(tmp_path / "run", [*GPT, *QUIET, "strategy=[sharding]", "strategy.sharding.stage=3",
                                               "strategy.sharding.optimize_offload=true", "trainer.devices=4"], rank=0)
    assert done.returncode == 0, done.stderr[-3000:]
    shapes = gpt_parameter_shapes()
    shard = sum(math.ceil(shape[0] / 4) * math.prod(shape[1:]) * 4 for shape in shapes)
    # The parameters' shards, their gradients' and AdamW's moments and step counts, in host memory.
    assert report["memory"]["host"] == shard + shard + 2 * shard + 4 * len(shapes)
    assert report["memory"]["optimizer_states"] == 0
    assert "sharding" in report["formula"]


def test_a_rank_outside_the_world_is_refused_in_one_line(tmp_path):
    done, report = rehearse(tmp_path / "run", [*GPT, *QUIET, "trainer.devices=2"], rank=2)
    assert done.returncode == 2 and report is None
    assert done.stderr.strip().splitlines() == ["lightfleet: error: --rank=2: a rank of the run's 2 processes (0 to 1)"]


def test_accumulated_micro_batches_count_as_many_as_the_plan_runs(tmp_path):
    reports = {}
    for k_steps in (1, 6):  # 6: the middle four run once and count four times
        done, reports[k_steps] = rehearse(tmp_path / f"k{k_steps}", [*GPT, *QUIET, "strategy=[gradient_merge]",
                                                                     f"strategy.gradient_merge.k_steps={k_steps}"], rank=0)
        assert done.returncode == 0, done.stderr[-3000:]
    one, six = reports[1], reports[6]
    assert six["flops"] == {dtype: 6 * flops for dtype, flops in one["flops"].items()}  # matmuls: forward and backward
    assert six["samples_per_step"] == 6 * one["samples_per_step"]
    # One micro-batch's activations at a time (give or take the loss's logits-sized gradient, which the
    # tracker counts as an activation or a temporary by when it is made).
    assert abs(six["memory"]["activations"] / one["memory"]["activations"] - 1) < 0.05
    assert "gradient_merge" in six["formula"] and not six["collectives"]


def test_a_long_synthetic_sequence_is_made_on_real_tensors(tmp_path):
    """The data module's setup runs on real tensors: data=language_model draws its tokens an op a
    position, which on fake tensors took minutes (150 s of a 70B-wide rank's 164 s at 8,192 tokens)
    whatever the model. A tiny model's rank on sequences of 8,192 tokens costs about the CPU time of
    one on 32 (on fake tensors: some 20 s more on this machine)."""
    import resource

    def cpu_seconds(seq_len: int) -> float:
        sizes = [f"data.seq_len={seq_len}", f"model.seq_len={seq_len}", "data.batch_size=1", "data.num_train=2",
                 "data.num_val=2", "data.num_test=2"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done, report = rehearse(tmp_path / str(seq_len), [*GPT, *QUIET, *sizes], rank=0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert done.returncode == 0, done.stderr[-3000:]
        assert report["tokens_per_step"] == seq_len
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    short, long = cpu_seconds(32), cpu_seconds(8192)
    assert long - short < 10, f"32 tokens: {short:.1f} s of CPU, 8,192: {long:.1f} s: the data made on fake tensors?"
