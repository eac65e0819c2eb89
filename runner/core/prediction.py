"""The step time of a rehearsed rank on a named device, from the rank's report (issue 42's contract:
per optimizer step, its FLOPs by dtype, the bytes its ops read and write, its collectives' payload
bytes per op and group, its samples and tokens) and the device table (conf/devices.yaml).

The model, its figures and its known errors: docs/rehearse.md, "Predicting the step time".
Pure Python: `lightfleet rehearse` and auto's rehearse mode predict without importing torch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import yaml

from runner.core.errors import ConfigError
from runner.core.paths import CONF_DIR
from runner.core.world import Layout

DEVICES_FILE = CONF_DIR / "devices.yaml"
NUMBERS = ("memory_gb", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "gpus_per_node")
FIELDS = ("flops", *NUMBERS)

# What a step reaches of the data sheets' peaks. Compute: large bf16 GEMMs reach about 80% of an
# A100's or H100's dense peak and FlashAttention-2 50-73%; torchtitan's Llama 3 runs on A100s
# executed 66% (8B) and 69% (70B) of peak, recompute included. Memory: streaming kernels reach
# 80-90% of HBM bandwidth. Network: nccl-tests' bus bandwidth reaches about 80% of the links'.
COMPUTE_FRACTION = 0.7
MEMORY_FRACTION = 0.8
NETWORK_FRACTION = 0.8
# Eager PyTorch's CPU time to dispatch one op and launch its kernel (profiles of small models on
# A100s and H100s: 4 to 10 us an op): a step's kernels cannot start faster than the CPU issues
# them, which bounds a small model's step from below. torch.compile's fused kernels issue fewer.
LAUNCH_S = 5e-6
# One collective call's fixed cost (NCCL's small-message latency at a few nodes: tens of microseconds).
CALL_LATENCY_S = 20e-6

# Issued per block or bucket on a stream of their own while the step computes: FSDP prefetches the
# next block's all-gather, reduce-scatters a block's gradients during the next block's backward, and
# DDP all-reduces gradient buckets during the backward. Everything else (pipeline send/recv,
# broadcasts, all-to-all) waits for or is waited on by the compute around it.
OVERLAPPED = ("all_gather", "reduce_scatter", "all_reduce")
POINT_TO_POINT = ("send", "recv")


@dataclass(frozen=True)
class Device:
    """One row of conf/devices.yaml: peaks per dtype (FLOP/s) and bandwidths (bytes/s, per direction)."""

    name: str
    flops: Mapping[str, float]
    memory_gb: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    gpus_per_node: int

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ConfigError("rehearse.device", self.name, f"has no {dtype} peak in conf/devices.yaml (the step "
                                                             f"computes in {dtype}; it lists {', '.join(self.flops)})")
        return self.flops[dtype]


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@functools.lru_cache(maxsize=None)
def load_devices(path: Path = DEVICES_FILE) -> Dict[str, Device]:
    """The device table, every device checked to have every field, each a number > 0."""
    table = yaml.safe_load(path.read_text()) or {}
    devices = {}
    for name, row in table.items():
        where = f"{path.name}: {name}"
        row = row if isinstance(row, dict) else {}
        for key in FIELDS:
            if key not in row:
                raise ConfigError(f"{where}.{key}", None, f"missing; every device has {', '.join(FIELDS)}")
        numbers = {**{key: row[key] for key in NUMBERS}, **{f"flops.{dtype}": peak for dtype, peak in row["flops"].items()}}
        for key, value in numbers.items():
            if not _positive(value):  # PyYAML reads 1.5e12 as text: it needs 1.5e+12
                raise ConfigError(f"{where}.{key}", value, "must be a number > 0, written like 989.4e+12")
        if not row["flops"]:
            raise ConfigError(f"{where}.flops", None, "lists no dtype's peak")
        devices[name] = Device(name=name, **{key: row[key] for key in FIELDS})
    return devices


def link_bandwidth(device: Device, group_size: int, nodes: int) -> float:
    """Bytes/s each rank of a group sends at in a ring collective: NVLink within a node. Across nodes,
    NCCL runs one ring per GPU of a node side by side, each leaving the node through its own NIC,
    so a group with k ranks on each node sends through k NICs at once (nccl-tests' bus bandwidth
    between DGX nodes is about 8 NICs' worth), never faster than NVLink inside the node."""
    if nodes <= 1:
        return device.intra_node_bandwidth
    return min(device.intra_node_bandwidth, max(1.0, group_size / nodes) * device.inter_node_bandwidth)


def wire_factor(op: str, group_size: int) -> float:
    """Bytes a rank puts on the wire per byte of the tensor it passes in (the report's `bytes`), for
    ring algorithms (NCCL's trees move the same bytes): an all-gather's input is its own shard, of
    which n - 1 pass each link ((n-1)/n of the gathered tensor); a reduce-scatter or all-to-all
    sends (n-1)/n of its input; an all-reduce is both, 2(n-1)/n; point to point sends it once."""
    n = group_size
    return {"all_gather": n - 1, "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
            "all_reduce": 2 * (n - 1) / n}.get(op, 1.0)


def collective_seconds(row: Mapping[str, Any], device: Device) -> float:
    """One report row (op, group_size, nodes, calls, bytes) as seconds on `device`, alone on its links
    (a group of one sends nothing)."""
    if row["group_size"] <= 1:
        return 0.0
    wire = row["bytes"] * wire_factor(row["op"], row["group_size"])
    return row["calls"] * CALL_LATENCY_S + wire / (link_bandwidth(device, row["group_size"], row["nodes"]) * NETWORK_FRACTION)


@dataclass(frozen=True)
class Prediction:
    """One optimizer step of one rank on a device: its time, its parts (seconds) and what it gives."""

    device: str
    step_s: float
    compute_s: float  # the FLOPs at COMPUTE_FRACTION of each dtype's peak
    memory_s: float  # the bytes ops read and write at MEMORY_FRACTION of the memory bandwidth
    communication_s: Dict[str, float]  # per op, each alone on the links
    exposed_communication_s: float  # what the step waits for: overlapped ops' first call, point to point, the rest
    bubble_s: float  # a pipeline stage idle while the others fill and drain
    launch_s: float  # the CPU issuing the step's kernels (LAUNCH_S each): the step is never shorter
    samples_per_s: float  # all ranks together
    samples_per_s_per_gpu: float
    tokens_per_s: Optional[float]  # None: not a sequence model
    tokens_per_s_per_gpu: Optional[float]
    mfu: float  # model FLOPs / (peak x step time)

    def line(self) -> str:
        comm = ", ".join(f"{op} {seconds:.3g}" for op, seconds in self.communication_s.items()) or "none"
        rate = (f"{self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU ({self.tokens_per_s:,.0f} in all)"
                if self.tokens_per_s is not None else
                f"{self.samples_per_s_per_gpu:,.1f} samples/s per GPU ({self.samples_per_s:,.1f} in all)")
        bound = f"bound by launching its kernels, {self.launch_s:.3g} s; the device's part: " if (
            self.launch_s >= self.step_s) else ""
        return (f"{self.device}: step {self.step_s:.3g} s ({bound}compute {self.compute_s:.3g} + memory {self.memory_s:.3g}"
                f" + exposed communication {self.exposed_communication_s:.3g} + bubble {self.bubble_s:.3g}; "
                f"communication alone: {comm}) | {rate} | MFU {self.mfu:.1%}")


def pipeline_bubble(stages: int, micro_batches: int, vpp_degree: int = 1) -> float:
    """The idle share of a pipeline stage's busy time: (stages - 1) fill-and-drain slots over
    micro_batches slots of work, each slot 1/vpp_degree as long with interleaved stages."""
    return (stages - 1) / (vpp_degree * micro_batches)


def predict(report: Mapping[str, Any], device: Device, layout: Optional[Layout] = None, micro_batches: int = 1,
            vpp_degree: int = 1, model_flops: Optional[float] = None) -> Prediction:
    """The step time of the rank `report` describes, on `device`. `layout` (default: every rank data
    parallel) gives the pipeline's stages and the data-parallel size the totals count; `micro_batches`
    and `vpp_degree` the pipeline schedule's. `model_flops`: this rank's FLOPs a step without
    recompute, for MFU (default: the report's FLOPs, recompute included)."""
    layout = layout or Layout(dp_shard=report["world_size"])
    flops = {dtype: count for dtype, count in report["flops"].items() if count}
    compute_s = sum(count / (device.peak(dtype) * COMPUTE_FRACTION) for dtype, count in flops.items())
    memory_s = report["memory_traffic_bytes"] / (device.memory_bandwidth * MEMORY_FRACTION)
    busy_s = compute_s + memory_s

    communication_s: Dict[str, float] = {}
    first_calls_s = 0.0  # an overlapped op's first call has nothing before it to hide behind
    for row in report["collectives"]:
        seconds = collective_seconds(row, device)
        communication_s[row["op"]] = communication_s.get(row["op"], 0.0) + seconds
        if row["op"] in OVERLAPPED and row["calls"]:
            first_calls_s += seconds / row["calls"]
    overlapped_s = sum(communication_s.get(op, 0.0) for op in OVERLAPPED)
    # Links are full duplex: a stage's sends and receives run at once.
    serial_s = (max((communication_s.get(op, 0.0) for op in POINT_TO_POINT), default=0.0)
                + sum(s for op, s in communication_s.items() if op not in OVERLAPPED + POINT_TO_POINT))
    bubble_s = busy_s * pipeline_bubble(layout.pp, micro_batches, vpp_degree)
    device_s = max(busy_s, overlapped_s - first_calls_s) + first_calls_s + serial_s + bubble_s
    launch_s = report.get("kernels", 0) * LAUNCH_S
    step_s = max(device_s, launch_s)  # where the CPU issues kernels slower than they run, the GPU waits

    world = report["world_size"]
    samples_per_s = report["samples_per_step"] * layout.data_parallel_size / step_s
    tokens = report.get("tokens_per_step")
    tokens_per_s = None if tokens is None else tokens * layout.data_parallel_size / step_s
    main_dtype = max(flops, key=flops.get) if flops else None
    mfu = 0.0 if main_dtype is None else (model_flops or sum(flops.values())) / (device.peak(main_dtype) * step_s)
    return Prediction(device=device.name, step_s=step_s, compute_s=compute_s, memory_s=memory_s,
                      communication_s=communication_s, exposed_communication_s=device_s - busy_s - bubble_s,
                      bubble_s=bubble_s, launch_s=launch_s,
                      samples_per_s=samples_per_s, samples_per_s_per_gpu=samples_per_s / world,
                      tokens_per_s=tokens_per_s, tokens_per_s_per_gpu=None if tokens_per_s is None else tokens_per_s / world,
                      mfu=mfu)
