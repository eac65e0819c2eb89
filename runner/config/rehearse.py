"""`lightfleet rehearse`'s knobs (`rehearse.*`) and its pure rules: the device rehearsed for (a
name of conf/devices.yaml, or a memory of its own), the reserve beside the measured peak, the
kinds of rank a layout holds, the fits verdict and what would make a rank fit. Each knob is
documented by the string under it (docs/knobs.md); docs/rehearse.md says why the reserve's
figures are what they are. Pure: no torch (runner/command/rehearse.py runs the ranks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

from runner.core.errors import ConfigError, require
from runner.core.prediction import load_devices
from runner.core.world import Layout

KEY = "rehearse."
GIB = 2**30
REHEARSED_ACCELERATORS = ("auto", "gpu", "cuda", "cpu")  # auto: the cluster's GPUs
MEMORY_PARTS = ("parameters", "gradients", "optimizer_states", "activations")  # what the console line shows


@dataclass
class RehearseConfig:
    """`lightfleet rehearse`: every kind of rank of the run built and stepped on fake tensors in a
    fake process group of the run's size, on this machine, and each one's peak memory plus a reserve
    held against the device's memory (docs/rehearse.md). A run ignores these knobs."""

    device: str = "h100"
    """The GPU the run is meant for, a name of conf/devices.yaml (h100, h200, a100): its memory is
    what each rank must fit in."""
    device_memory_gb: Optional[float] = None
    """The memory of one device in GiB, in place of the table's (a 40 GB A100: 40; a GPU kept
    partly for something else); with trainer.accelerator=cpu, each process's share of the host's."""
    steps: int = 2
    """Optimizer steps each rank rehearses (>= 2: optimizers make their state in the first; the
    last is measured)."""
    at_once: int = 2
    """Rank kinds rehearsed at the same time, each a process of its own."""
    reserve_context_gb: float = 1.0
    """GiB a CUDA process holds outside the tensors it allocates: the CUDA context, its kernels and
    the cuBLAS and cuDNN workspaces (0 with trainer.accelerator=cpu)."""
    reserve_nccl_gb: float = 1.0
    """GiB NCCL holds for its communication buffers in a process of a run of several (0 for one
    process and on CPU, where gloo's buffers are host memory)."""
    reserve_fragmentation: float = 0.10
    """Fraction of the peak that torch's caching allocator holds beyond the live tensors (blocks
    split and cached between steps)."""

    def __post_init__(self) -> None:
        devices = load_devices()
        require(self.device in devices, KEY + "device", self.device, f"allowed: {', '.join(devices)} "
                f"(conf/devices.yaml), or rehearse.device_memory_gb for another", tuple(devices))
        require(self.device_memory_gb is None or self.device_memory_gb > 0, KEY + "device_memory_gb",
                self.device_memory_gb, "must be > 0 GiB (or null: the device's, from conf/devices.yaml)")
        require(self.steps >= 2, KEY + "steps", self.steps, "must be >= 2: optimizers make their state in the "
                "first step, so the last one is measured")
        require(self.at_once >= 1, KEY + "at_once", self.at_once, "must be >= 1")
        for name in ("reserve_context_gb", "reserve_nccl_gb"):
            require(getattr(self, name) >= 0, KEY + name, getattr(self, name), "must be >= 0 GiB")
        require(0 <= self.reserve_fragmentation < 1, KEY + "reserve_fragmentation", self.reserve_fragmentation,
                "must be in [0, 1): a fraction of the peak")

    def target(self, accelerator: str) -> "Target":
        """The device each rank is rehearsed for: CUDA unless the run asks for the CPU
        (trainer.accelerator=cpu), whose memory per process only the user can say."""
        require(accelerator in REHEARSED_ACCELERATORS, "trainer.accelerator", accelerator,
                f"a rehearsal is of a run on CUDA devices or CPUs: {', '.join(REHEARSED_ACCELERATORS)}")
        device_type = "cpu" if accelerator == "cpu" else "cuda"
        if device_type == "cpu":
            require(self.device_memory_gb is not None, KEY + "device_memory_gb", None,
                    "a run with trainer.accelerator=cpu is rehearsed against the host memory one process may "
                    "use: give it in GiB (e.g. rehearse.device_memory_gb=16)")
            return Target("cpu", self.device_memory_gb, device_type)
        memory = self.device_memory_gb if self.device_memory_gb is not None else load_devices()[self.device].memory_gb
        return Target(self.device, memory, device_type)

    def memory_key(self) -> str:
        """The knob that set the memory, as the verdict names it."""
        if self.device_memory_gb is not None:
            return f"{KEY}device_memory_gb={self.device_memory_gb:g}"
        return f"{KEY}device={self.device}"

    def reserve(self, peak: int, device_type: str, world_size: int) -> Dict[str, int]:
        """The bytes beyond the measured peak a rank needs, by part."""
        on_cuda = device_type == "cuda"
        return {"cuda_context": int(self.reserve_context_gb * GIB) if on_cuda else 0,
                "nccl": int(self.reserve_nccl_gb * GIB) if on_cuda and world_size > 1 else 0,
                "fragmentation": int(self.reserve_fragmentation * peak)}


@dataclass(frozen=True)
class Target:
    name: str  # a device of conf/devices.yaml, or cpu
    memory_gb: float
    device_type: str  # cuda or cpu: the rules the ranks emulate

    @property
    def memory(self) -> int:
        return int(self.memory_gb * GIB)


@dataclass(frozen=True)
class RankKind:
    """One rank standing for the ranks alike in memory and traffic."""

    rank: int
    words: str  # what sets it apart: "pipeline stage 1 of 4 (middle), dp_shard 32"


def rank_kinds(layout: Layout, sharding_stage: Optional[int] = None) -> List[RankKind]:
    """The ranks that differ: the first, a middle and the last stage of a pipeline, each at
    coordinate 0 of the other dimensions (the ranks of one sharding, tensor-parallel or replica
    group hold equal parts; ZeRO stage 1's whole tensors are the exception, which a rank's report
    names as its heaviest_rank: `heaviest`)."""
    places = sorted({0, min(1, layout.pp - 1), layout.pp - 1})
    return [RankKind(place * layout.tp, describe(place * layout.tp, layout, sharding_stage)) for place in places]


def heaviest(report: Mapping[str, Any], known: Sequence[int], layout: Layout,
             sharding_stage: Optional[int] = None) -> Optional[RankKind]:
    """The rank holding the most model state, where a report names one not rehearsed yet."""
    rank = report.get("heaviest_rank")
    if rank is None or rank in known:
        return None
    return RankKind(rank, f"{describe(rank, layout, sharding_stage)}: the most model state")


def describe(rank: int, layout: Layout, sharding_stage: Optional[int]) -> str:
    """What rank `rank` is: its pipeline stage, the sharding stage, the layout's degrees."""
    words = []
    if layout.pp > 1:
        place = layout.coordinates(rank)["pp"]
        position = "first" if place == 0 else "last" if place == layout.pp - 1 else "middle"
        words.append(f"pipeline stage {place} of {layout.pp} ({position})")
    words += [f"sharding stage {sharding_stage}"] if sharding_stage else []
    words += [f"{dim} {size}" for dim, size in layout.to_dict().items() if size > 1 and dim != "pp"]
    return ", ".join(words) or "one process"


@dataclass(frozen=True)
class Verdict:
    """One rank kind's peak and reserve against the device's memory."""

    kind: RankKind
    peak: int  # bytes: the step's peak, or the checkpoint save's where higher
    at_checkpoint: bool
    reserve: Dict[str, int]
    memory: int

    @property
    def needs(self) -> int:
        return self.peak + sum(self.reserve.values())

    @property
    def fits(self) -> bool:
        return self.needs <= self.memory


def verdict(kind: RankKind, report: Mapping[str, Any], knobs: RehearseConfig, target: Target) -> Verdict:
    memory = report["memory"]
    step, checkpoint = memory["step_peak"], memory.get("checkpoint_peak") or 0
    peak = max(step, checkpoint)
    return Verdict(kind, peak, checkpoint > step, knobs.reserve(peak, target.device_type, report["world_size"]),
                   target.memory)


def to_fit(report: Mapping[str, Any], strategies: Sequence[str], knobs: Mapping[str, Any], allowed,
           world: Mapping[str, Any], batch_size: Optional[int]) -> List[str]:
    """What the plan does not do yet that would shrink the rank: more sharding (a higher stage: one
    the pipeline does not take) and
    more processes for the model states, recompute and a smaller micro-batch for the activations,
    the larger part's first. `knobs`: the selected strategies' knobs by name; `allowed(names)`:
    whether the table allows that selection."""
    def selection(name: str) -> str:
        return f"'strategy=[{','.join([*strategies, name])}]'"

    stage = knobs["sharding"].stage if "sharding" in knobs else 0
    states, activations = [], []
    if stage < 3 and "pipeline" not in knobs and (stage or allowed([*strategies, "sharding"])):
        states.append(f"more sharding (strategy.sharding.stage={stage + 1})" if stage else
                      f"sharding ({selection('sharding')} strategy.sharding.stage=3)")
    if stage:  # sharded states shrink with the processes sharing them
        more = (f"trainer.num_nodes={2 * world['num_nodes']}" if world["num_nodes"] > 1
                else f"trainer.devices={2 * world['devices']}")
        states.append(f"more processes ({more})")
    if "recompute" not in strategies and allowed([*strategies, "recompute"]):
        activations.append(f"recompute ({selection('recompute')})")
    if "pipeline" in knobs:
        steps = knobs["pipeline"].accumulate_steps
        activations.append(f"a smaller micro-batch (strategy.pipeline.accumulate_steps={2 * steps})")
    elif batch_size and batch_size > 1:
        activations.append(f"a smaller micro-batch (data.batch_size={batch_size // 2}, with gradient_merge "
                           f"to keep the global batch)")
    memory = report["memory"]
    model_states = sum(memory.get(part) or 0 for part in ("parameters", "gradients", "optimizer_states"))
    return [*activations, *states] if (memory.get("activations") or 0) > model_states else [*states, *activations]


def gib(count: float) -> str:
    """Bytes in GiB, or in MiB below one GiB (a small model's parts)."""
    return f"{count / GIB:.1f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"


def payload(count: float) -> str:
    """Bytes on the wire in GB (10^9, as networks count), or MB, kB for a small model's."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count / 1e3:.1f} kB"


def console_line(verdict: Verdict, report: Mapping[str, Any]) -> str:
    """`rank 0 (stage 3, dp_shard 128): peak 31.2 GiB + reserve 5.1 GiB of 80.0 GiB: fits | params
    ... | all_gather 3.1 GB ... a step`: the verdict, the memory's parts, each collective's bytes."""
    memory = report["memory"]
    parts = " ".join(f"{name} {gib(memory.get(part) or 0)}" for name, part in
                     zip(("params", "grads", "optimizer", "activations"), MEMORY_PARTS))
    if memory.get("host"):
        parts += f" host {gib(memory['host'])}"
    by_op: Dict[str, int] = {}
    for row in report.get("collectives") or []:
        by_op[row["op"]] = by_op.get(row["op"], 0) + row["bytes"]
    traffic = " ".join(f"{op} {payload(count)}" for op, count in by_op.items()) or "no collectives"
    where = " at the checkpoint save" if verdict.at_checkpoint else ""
    return (f"rank {verdict.kind.rank} ({verdict.kind.words}): peak {gib(verdict.peak)}{where} + reserve "
            f"{gib(sum(verdict.reserve.values()))} of {gib(verdict.memory)}: "
            f"{'fits' if verdict.fits else 'does not fit'} | {parts} | {traffic} a step")


def refusal(verdict: Verdict, knobs: RehearseConfig, ways: Sequence[str]) -> ConfigError:
    """The one line of a rank kind that does not fit: what it needs, and what would make it fit."""
    short = f"short by {gib(verdict.needs - verdict.memory)}"
    fix = f"to fit, try {', or '.join(ways)}" if ways else "the plan shards, recomputes and splits all it can: a device with more memory"
    return ConfigError(knobs.memory_key(), None,
                       f"rank {verdict.kind.rank} ({verdict.kind.words}) needs {gib(verdict.needs)} (peak "
                       f"{gib(verdict.peak)} + reserve {gib(sum(verdict.reserve.values()))}) of "
                       f"{gib(verdict.memory)}, {short}; {fix}")
