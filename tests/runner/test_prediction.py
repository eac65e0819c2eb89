"""The step-time prediction (runner/core/prediction.py) and the device table (conf/devices.yaml):
the table loads whole and its figures are the data sheets'; the model's limits (compute bound, memory
bound, communication bound, the pipeline's bubble); and torchtitan's published runs, predicted from
a report this module writes from the models' sizes alone (docs/rehearse.md cites the runs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import pytest

from runner.core.errors import ConfigError
from runner.core.prediction import COMPUTE_FRACTION, MEMORY_FRACTION, NETWORK_FRACTION, load_devices, predict
from runner.core.world import Layout

A100 = load_devices()["a100"]


def report(flops: float = 0.0, traffic: float = 0.0, collectives: List[Dict] = (), world: int = 8,
           samples: int = 4, tokens: int = None, dtype: str = "bfloat16") -> Dict:
    """A rank report of the contract (docs/rehearse.md), with what a test sets."""
    return {"rank": 0, "world_size": world, "flops": {dtype: flops}, "memory_traffic_bytes": traffic,
            "collectives": list(collectives), "samples_per_step": samples, "tokens_per_step": tokens}


def row(op: str, bytes: float, group_size: int = 8, nodes: int = 1, calls: int = 1) -> Dict:
    return {"op": op, "group_size": group_size, "nodes": nodes, "calls": calls, "bytes": bytes}


# The data sheets' dense peaks and bandwidths, written here apart from the table (sources: docs/rehearse.md).
DATA_SHEETS = {
    "h100": {"memory_gb": 80, "bfloat16": 989.4e12, "memory_bandwidth": 3.35e12},
    "h200": {"memory_gb": 141, "bfloat16": 989.4e12, "memory_bandwidth": 4.8e12},
    "b200": {"memory_gb": 180, "bfloat16": 2.25e15, "memory_bandwidth": 7.7e12},
    "a100": {"memory_gb": 80, "bfloat16": 312e12, "memory_bandwidth": 2.039e12},
    "a100_40gb": {"memory_gb": 40, "bfloat16": 312e12, "memory_bandwidth": 1.555e12},
    "l40s": {"memory_gb": 48, "bfloat16": 362.05e12, "memory_bandwidth": 864e9},
    "v100": {"memory_gb": 32, "float16": 125e12, "memory_bandwidth": 900e9},
    "mi300x": {"memory_gb": 192, "bfloat16": 1307.4e12, "memory_bandwidth": 5.3e12},
}


def test_the_table_loads_every_device_with_every_field_and_the_data_sheets_figures():
    devices = load_devices()
    assert set(devices) == set(DATA_SHEETS)
    for name, sheet in DATA_SHEETS.items():
        device = devices[name]
        assert device.memory_gb == sheet["memory_gb"] and device.memory_bandwidth == sheet["memory_bandwidth"], name
        dtype = "float16" if name == "v100" else "bfloat16"
        assert device.flops[dtype] == sheet[dtype] and device.flops["float32"] > 0, name
        assert device.intra_node_bandwidth > 0 and device.inter_node_bandwidth > 0 and device.gpus_per_node >= 1
    assert "bfloat16" not in devices["v100"].flops  # Volta has no bfloat16 tensor cores: refused, not guessed


@pytest.mark.parametrize("text, message", [
    ("x:\n  memory_gb: 80\n  flops: {bfloat16: 1.0e+12}\n  memory_bandwidth: 1.0e+12\n  intra_node_bandwidth: 1.0e+11\n"
     "  gpus_per_node: 8\n", r"^devices.yaml: x.inter_node_bandwidth: missing; every device has flops, memory_gb"),
    # PyYAML reads an exponent without its sign as text: the table would hold strings, not peaks.
    ("x:\n  memory_gb: 80\n  flops: {bfloat16: 989.4e12}\n  memory_bandwidth: 1.0e+12\n  intra_node_bandwidth: 1.0e+11\n"
     "  inter_node_bandwidth: 1.0e+10\n  gpus_per_node: 8\n",
     r"^devices.yaml: x.flops.bfloat16='989.4e12': must be a number > 0, written like 989.4e\+12$"),
])
def test_a_bad_device_row_names_the_device_and_the_key(tmp_path, text, message):
    (tmp_path / "devices.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_devices(tmp_path / "devices.yaml")


def test_without_collectives_a_step_is_its_compute_and_its_memory_traffic():
    flops, traffic = 3e14, 4e11
    alone = predict(report(flops=flops, traffic=traffic, samples=4, tokens=4096), A100)
    expected = flops / (COMPUTE_FRACTION * 312e12) + traffic / (MEMORY_FRACTION * 2.039e12)
    assert alone.step_s == pytest.approx(expected) and alone.exposed_communication_s == pytest.approx(0)
    assert alone.samples_per_s == pytest.approx(8 * 4 / expected)  # 8 data-parallel ranks
    assert alone.tokens_per_s_per_gpu == pytest.approx(4096 / expected)
    assert alone.mfu == pytest.approx(flops / (312e12 * expected))
    # A float32 step runs at float32's peak, 16 times slower than bfloat16's on an A100.
    assert predict(report(flops=flops, dtype="float32"), A100).step_s == pytest.approx(flops / (COMPUTE_FRACTION * 19.5e12))


def test_huge_collectives_make_the_step_communication_bound_and_nodes_decide_the_links():
    gathered = 1e12  # bytes: a whole model gathered by 64 ranks on 8 nodes, in 100 calls
    rows = [row("all_gather", gathered / 64, group_size=64, nodes=8, calls=100)]
    step = predict(report(flops=1e12, collectives=rows, world=64), A100).step_s
    # 63/64 of the model crosses each rank's links; 8 rings leave each node through its 8 NICs at once.
    assert step == pytest.approx(gathered * 63 / 64 / (8 * 25e9 * NETWORK_FRACTION), rel=1e-3)
    assert predict(report(flops=2e12, collectives=rows, world=64), A100).step_s == pytest.approx(step)
    # One rank per node (a replica group across nodes) sends through one NIC; one node has NVLink.
    across = predict(report(collectives=[row("all_reduce", 1e11, group_size=8, nodes=8)]), A100).step_s
    within = predict(report(collectives=[row("all_reduce", 1e11, group_size=8, nodes=1)]), A100).step_s
    assert across / within == pytest.approx(300e9 / 25e9, rel=1e-3)


def test_the_ring_factors_of_each_collective():
    def seconds(op: str, bytes: float) -> float:
        return predict(report(collectives=[row(op, bytes, group_size=4)], world=4), A100).communication_s[op]
    # An all-reduce is a reduce-scatter and an all-gather: 2(n-1)/n of the tensor.
    assert seconds("all_reduce", 1e11) == pytest.approx(2 * seconds("reduce_scatter", 1e11), rel=1e-3)
    # An all-gather's input is its own shard: gathering 4 shards of 1/4 moves what one reduce-scatter of the whole does.
    assert seconds("all_gather", 1e11 / 4) == pytest.approx(seconds("reduce_scatter", 1e11))
    assert seconds("send", 1e11) == pytest.approx(1e11 / (300e9 * NETWORK_FRACTION), rel=1e-3)
    alone = predict(report(flops=1e12, collectives=[row("all_reduce", 1e11, group_size=1)], world=1), A100)
    assert alone.communication_s == {"all_reduce": 0.0}  # a group of one sends nothing


def test_overlapped_collectives_hide_behind_compute_but_point_to_point_waits():
    compute = predict(report(flops=1e14), A100).step_s
    small = [row("all_gather", 1e8, calls=10), row("reduce_scatter", 1e8, calls=10)]
    hidden = predict(report(flops=1e14, collectives=small), A100)
    first_calls = sum(hidden.communication_s.values()) / 10  # the first gather and the last reduce-scatter
    assert hidden.step_s == pytest.approx(compute + first_calls)
    sends = predict(report(flops=1e14, collectives=[row("send", 1e9), row("recv", 1e9)]), A100)
    assert sends.step_s == pytest.approx(compute + sends.communication_s["send"])  # full duplex: both at once


def test_a_pipeline_waits_for_its_bubble_and_counts_its_replicas():
    flops = 1e14
    stage = report(flops=flops, world=8, samples=16)
    plain = predict(stage, A100).step_s
    four_stages = predict(stage, A100, layout=Layout(dp_shard=2, pp=4), micro_batches=8)
    assert four_stages.bubble_s == pytest.approx(plain * 3 / 8)
    assert four_stages.samples_per_s == pytest.approx(2 * 16 / (plain * 11 / 8))  # 2 pipelines
    interleaved = predict(stage, A100, layout=Layout(dp_shard=2, pp=4), micro_batches=8, vpp_degree=2)
    assert interleaved.bubble_s == pytest.approx(four_stages.bubble_s / 2)


def test_a_small_models_step_is_bounded_by_launching_its_kernels():
    """Eager PyTorch issues a kernel per op, each costing the CPU about 5 us: 1,000 kernels of a
    tiny model take 5 ms however fast the device runs them; a large model's compute hides them."""
    tiny = predict({**report(flops=1e9), "kernels": 1000}, A100)
    assert tiny.step_s == pytest.approx(1000 * 5e-6) and "bound by launching its kernels" in tiny.line()
    large = predict({**report(flops=1e15), "kernels": 1000}, A100)
    assert large.step_s == pytest.approx(1e15 / (312e12 * 0.7)) and "launching" not in large.line()


def test_a_dtype_the_device_lacks_is_one_line():
    with pytest.raises(ConfigError, match=r"^rehearse.device='v100': has no bfloat16 peak in conf/devices.yaml "
                                          r"\(the step computes in bfloat16; it lists float16, float32\)$"):
        predict(report(flops=1e12), load_devices()["v100"])


# Published runs: pytorch/torchtitan docs/performance.md, 64 A100 80 GB (8 nodes), FSDP2, bfloat16.
@dataclass(frozen=True)
class Llama:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int

    @property
    def layer_params(self) -> int:  # attention (q, o; k, v of the kv heads), the SwiGLU's three, two norms
        return 2 * self.dim ** 2 + 2 * self.dim * self.dim // self.heads * self.kv_heads + 3 * self.dim * self.ffn + 2 * self.dim

    @property
    def params(self) -> int:  # untied embedding and output, the final norm
        return 2 * self.vocab * self.dim + self.layers * self.layer_params + self.dim


LLAMA3_8B = Llama(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192)
LLAMA3_70B = Llama(dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192)
LLAMA2_13B = Llama(dim=5120, layers=40, heads=40, kv_heads=40, ffn=13824, vocab=32000, seq=4096)


def model_flops(model: Llama, tokens: int) -> float:
    """torchtitan's MFU numerator: 6 x params per token, and attention's 12 x layers x seq x dim."""
    return (6 * model.params + 12 * model.layers * model.seq * model.dim) * tokens


def torchtitan_report(model: Llama, local_batch: int, recomputed_layers: int, gpus: int = 64, nodes: int = 8) -> Dict:
    """One rank's step under torchtitan's FSDP2 defaults: bfloat16 parameters all-gathered per block in
    the forward and again in the backward (resharded after the forward), float32 gradients
    reduce-scattered; one unit per block and the root. Activation checkpointing runs the checkpointed
    blocks' forward again. Memory traffic: each block's activations (34 x dim bytes a token in 16 bits,
    Korthikanti et al. 2022, no seq x seq matrix under FlashAttention) written and read in the forward
    and backward and their gradients too (4x), once more where recomputed; AdamW's step reads and
    writes 7 float32 tensors of the shard."""
    tokens = local_batch * model.seq
    forward = (2 * model.layer_params + 4 * model.seq * model.dim) * tokens  # one block's matmuls and attention
    units = model.layers + 1
    return {"rank": 0, "world_size": gpus, "flops": {"bfloat16": model_flops(model, tokens) + recomputed_layers * forward},
            "memory_traffic_bytes": 34 * model.dim * tokens * (4 * model.layers + recomputed_layers) + 28 * model.params / gpus,
            "collectives": [row("all_gather", 2 * model.params / gpus * 2, gpus, nodes, calls=2 * units),
                            row("reduce_scatter", 4 * model.params, gpus, nodes, calls=units)],
            "samples_per_step": local_batch, "tokens_per_step": tokens}


@pytest.mark.parametrize("model, local_batch, recomputed, tokens_per_s, mfu", [
    (LLAMA3_8B, 1, LLAMA3_8B.layers // 2, 2904, 0.568),  # selective (every other layer) checkpointing
    (LLAMA3_70B, 1, LLAMA3_70B.layers, 331, 0.517),  # full checkpointing
    (LLAMA2_13B, 2, 0, 2162, 0.611),  # no checkpointing
], ids=["llama3_8b", "llama3_70b", "llama2_13b"])
def test_torchtitans_published_runs_are_predicted_within_25_percent(model, local_batch, recomputed, tokens_per_s, mfu):
    tokens = local_batch * model.seq
    # The report's formula is torchtitan's: at the published tokens/s it gives the published MFU.
    assert model_flops(model, tokens) / (tokens / tokens_per_s) / 312e12 == pytest.approx(mfu, abs=0.001)
    predicted = predict(torchtitan_report(model, local_batch, recomputed), A100, model_flops=model_flops(model, tokens))
    assert predicted.tokens_per_s_per_gpu == pytest.approx(tokens_per_s, rel=0.25)
    assert predicted.tokens_per_s == pytest.approx(64 * predicted.tokens_per_s_per_gpu)
    assert predicted.mfu == pytest.approx(mfu, rel=0.25)
