"""Run records: clock-named directories never collide; user-named ones are never overwritten."""
from __future__ import annotations

import pytest
import yaml

from runner.errors import ConfigError
from runner.plan import make_plan
from runner.records import create_run_dir


def record(spec_for, output_dir: str):
    spec = spec_for(f"paths.output_dir={output_dir}")
    return create_run_dir(spec.cfg, make_plan(spec.strategies, spec.trainer), ["test"])


def test_runs_named_by_the_clock_in_the_same_second_get_their_own_directories(spec_for, tmp_path):
    template = f"{tmp_path}/runs/${{now:%Y}}"  # one name for the whole year: a guaranteed collision
    first, second, third = (record(spec_for, template) for _ in range(3))
    assert [p.name for p in (first, second, third)] == [first.name, f"{first.name}-1", f"{first.name}-2"]
    for run in (first, second, third):
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["paths"]["output_dir"] == str(run)
        assert {"plan.yaml", "env.yaml"} <= {p.name for p in run.iterdir()}


def test_a_directory_the_user_named_is_never_reused(spec_for, tmp_path):
    record(spec_for, str(tmp_path / "mine"))
    before = (tmp_path / "mine" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        record(spec_for, str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "config.yaml").read_text() == before
