"""The world's shape: process counts from the trainer config, and the layout of ranks over the
data-parallel, sharding, pipeline and tensor-parallel dimensions."""
from __future__ import annotations

import pytest
import torch

from runner.core.errors import ConfigError
from runner.config.schema import TrainerConfig
from runner.core.world import Layout, World, layout


def test_world_from_the_trainer_config():
    assert World.of(TrainerConfig(devices=4, num_nodes=2)) == World(4, 2, 8)
    assert World.of(TrainerConfig(devices=[0, 1])).world_size == 2
    with pytest.raises(ConfigError, match=r"^trainer.devices='auto': sharding needs a known process count"):
        World.of(TrainerConfig(devices="auto")).known_size("sharding")


def test_ranks_are_laid_out_like_the_device_mesh():
    processes = Layout(dp_replicate=2, dp_shard=2, pp=2, tp=2)
    grid = torch.arange(16).reshape(tuple(processes.to_dict().values()))  # init_device_mesh's row-major layout
    for rank in range(16):
        assert grid[tuple(processes.coordinates(rank).values())] == rank
    assert processes.coordinates(13) == {"dp_replicate": 1, "dp_shard": 1, "pp": 0, "tp": 1}
    # The ranks of one pipeline and tensor-parallel group read the same batches.
    assert [processes.data_parallel_rank(rank) for rank in range(16)] == [r // 4 for r in range(16)]


def test_the_sharding_group_takes_the_processes_left_and_the_product_is_checked():
    assert layout(8, dp_replicate=2, tp=2) == Layout(dp_replicate=2, dp_shard=2, pp=1, tp=2)
    with pytest.raises(ConfigError, match=r"^strategy.sharding.degree=3: .* = 1 x 3 x 1 x 1 = 3, but the run has 4"):
        layout(4, dp_shard=3)
