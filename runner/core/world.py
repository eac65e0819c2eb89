"""The world's shape: how many processes a run has, how they split into data-parallel, sharding,
pipeline and tensor-parallel groups (Fleet's hybrid degrees), and what each one is.

Pure Python: the plan checks the degrees before any process starts, and the plugins build
their device meshes from the same `Layout`.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Optional

from runner.core.errors import ConfigError, require

# Set by torchrun, SLURM's srun or another launcher that already started this process.
EXTERNAL_LAUNCH_VARS = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")
MULTI_NODE_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


@dataclass(frozen=True)
class World:
    """Processes per node and in all, from the trainer config."""

    devices: Any  # per node: a count, or "auto"/-1 until Lightning resolves it
    num_nodes: int
    world_size: Any  # devices x num_nodes, or "auto"

    @classmethod
    def of(cls, trainer: Any) -> "World":
        devices = trainer.devices
        per_node = len(devices) if isinstance(devices, (list, tuple)) else devices
        if isinstance(per_node, str) and per_node.isdigit():
            per_node = int(per_node)
        world_size = per_node * trainer.num_nodes if isinstance(per_node, int) else "auto"
        return cls(per_node, trainer.num_nodes, world_size)

    def known_size(self, needed_by: str) -> int:
        """The process count, which strategies that split the processes need before any starts."""
        require(isinstance(self.world_size, int), "trainer.devices", self.devices,
                f"{needed_by} needs a known process count: set trainer.devices to a number")
        return self.world_size

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def devices_for(processes: int, num_nodes: int) -> str:
    """The override that gives a run on `num_nodes` nodes `processes` processes: trainer.devices
    per node, or one node where the nodes cannot share them evenly."""
    per_node, left = divmod(processes, num_nodes)
    return f"trainer.devices={per_node}" if per_node and not left else f"trainer.devices={processes} trainer.num_nodes=1"


@dataclass(frozen=True)
class Layout:
    """How the processes split, outermost first: rank = ((r * S + s) * P + p) * T + t for
    coordinates (r, s, p, t) in (dp_replicate, dp_shard, pp, tp), as a device mesh of these
    dims (the field names) lays them out."""

    dp_replicate: int = 1  # replica groups over the sharding groups (Fleet dp_degree: hybrid sharding)
    dp_shard: int = 1  # ranks of one sharding group (Fleet sharding degree); pipeline replicas with pipeline
    pp: int = 1  # processes of one pipeline (Fleet pp_degree)
    tp: int = 1  # tensor-parallel ranks (Fleet mp_degree)

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas: ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> Dict[str, int]:
        """What process `rank` is: its index along each dimension."""
        sizes = self.to_dict()
        place = {}
        for dim in reversed(sizes):
            rank, place[dim] = divmod(rank, sizes[dim])
        return {dim: place[dim] for dim in sizes}

    def data_parallel_rank(self, rank: int) -> int:
        """Which batches `rank` reads: ranks of one pipeline or tensor-parallel group read the same."""
        where = self.coordinates(rank)
        return where["dp_replicate"] * self.dp_shard + where["dp_shard"]

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)


def layout(world_size: int, *, dp_replicate: int = 1, dp_shard: Optional[int] = None, pp: int = 1,
           tp: int = 1, num_nodes: int = 1) -> Layout:
    """The layout of `world_size` processes on `num_nodes` nodes; `dp_shard=None` takes the
    processes left over. The product must be the world size (the error names Fleet's knobs, which
    set these degrees, and the trainer.devices that fits them)."""
    others = dp_replicate * pp * tp
    shard = dp_shard if dp_shard is not None else max(1, world_size // others)
    product = others * shard
    require(product == world_size, "strategy.sharding.degree", shard,
            f"dp_degree x degree x mp_degree x pp_degree = {dp_replicate} x {shard} x {tp} x {pp} = "
            f"{product}, but the run has {world_size} process(es): set "
            f"{devices_for(product, num_nodes)}, or degrees whose "
            f"product is {world_size}")
    return Layout(dp_replicate=dp_replicate, dp_shard=shard, pp=pp, tp=tp)


def device_type(accelerator: str, cuda_available: Callable[[], bool]) -> str:
    """The torch device type a run uses: cuda when trainer.accelerator asks for it, or is auto and
    `cuda_available()` (asked only then: it imports torch); else cpu."""
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda_available()):
        return "cuda"
    return "cpu"


def launched_externally() -> bool:
    """Whether torchrun, SLURM or another launcher started this process (lightfleet starts none)."""
    return any(var in os.environ for var in EXTERNAL_LAUNCH_VARS)


def external_rank() -> int:
    """This process's rank under torchrun or SLURM (0 when lightfleet launches the ranks)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) if launched_externally() else 0


def check_multi_node(world: World) -> None:
    """Fail before spawning when a multi-node run lacks its rendezvous address."""
    if world.num_nodes > 1 and not launched_externally():
        missing = [var for var in MULTI_NODE_VARS if var not in os.environ]
        if missing:
            raise ConfigError("trainer.num_nodes", world.num_nodes,
                              f"needs {', '.join(MULTI_NODE_VARS)} set on every node (missing: {', '.join(missing)})")


def alive(pid: int) -> bool:
    """Whether process `pid` of this host runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True
