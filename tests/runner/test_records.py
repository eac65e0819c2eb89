"""Run directories, reserved before Hydra makes them: clock-named ones never collide, user-named
ones are never overwritten, and hydra.run.dir and paths.output_dir are one setting."""
from __future__ import annotations

import pytest
from hydra.types import RunMode

from runner.config.compose import compose_config
from runner.core.errors import ConfigError
from runner.records.run_dir import reserve_dir


def reserve(*overrides: str, sweep: bool = False):
    cfg = compose_config(list(overrides), run_mode=RunMode.MULTIRUN if sweep else RunMode.RUN, with_hydra=True)
    return reserve_dir(cfg, *(("hydra.sweep.dir", "paths.sweep_dir") if sweep else ("hydra.run.dir", "paths.output_dir")))


def test_runs_named_by_the_clock_in_the_same_second_get_their_own_directories(tmp_path):
    template = f"paths.output_dir={tmp_path}/runs/${{now:%Y}}"  # one name for the whole year: a collision
    first, second, third = (reserve(template) for _ in range(3))
    assert [p.name for p in (first, second, third)] == [first.name, f"{first.name}-1", f"{first.name}-2"]
    assert all(p.is_dir() for p in (first, second, third))


def test_sweeps_named_by_the_clock_get_their_own_directories(tmp_path):
    template = f"paths.sweep_dir={tmp_path}/sweeps/${{now:%Y}}"
    first, second = (reserve(template, sweep=True) for _ in range(2))
    assert second.name == f"{first.name}-1" and first.is_dir() and second.is_dir()


def test_a_directory_the_user_named_is_never_reused(tmp_path):
    mine = tmp_path / "mine"
    assert reserve(f"paths.output_dir={mine}") == mine
    mine.mkdir()
    (mine / "config.yaml").write_text("earlier run\n")
    for override in (f"paths.output_dir={mine}", f"hydra.run.dir={mine}"):
        with pytest.raises(ConfigError, match="already holds a run"):
            reserve(override)
    assert (mine / "config.yaml").read_text() == "earlier run\n"


def test_hydra_run_dir_is_the_same_setting_as_paths_output_dir(tmp_path):
    assert reserve(f"hydra.run.dir={tmp_path}/a") == tmp_path / "a"  # follows the clock default no more
    with pytest.raises(ConfigError, match=r"hydra.run.dir=.*differs from paths.output_dir=.*set one of them"):
        reserve(f"hydra.run.dir={tmp_path}/a", f"paths.output_dir={tmp_path}/b")
    with pytest.raises(ConfigError, match=r"hydra.sweep.dir=.*differs from paths.sweep_dir"):
        reserve(f"hydra.sweep.dir={tmp_path}/a", f"paths.sweep_dir={tmp_path}/b", sweep=True)
