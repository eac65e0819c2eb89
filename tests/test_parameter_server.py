"""Fleet's parameter-server modes (parameter_server.*): sync runs as data parallelism, GEO-SGD as
localsgd (labelled in the plan, and training exactly as localsgd does in 2 processes), and the
asynchronous modes are refused in one line naming what to use instead."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.command import preflight
from runner.command.planning import plan_for
from runner.core.errors import ConfigError, Refusal
from runner.core.plan import format_plan

TWO = "trainer.devices=2"


def plan_text(spec_for, *overrides: str) -> str:
    return format_plan(plan_for(spec_for(*overrides)))


def test_geo_is_localsgd_with_its_k_steps_and_the_plan_says_so(spec_for):
    geo = plan_text(spec_for, "parameter_server.mode=geo", "parameter_server.k_steps=3", TWO).splitlines()
    localsgd = plan_text(spec_for, "strategy=[localsgd]", "strategy.localsgd.k_steps=3", TWO).splitlines()
    assert geo[:-1] == localsgd
    assert geo[-1] == ("note: parameter_server.mode=geo: Fleet's GEO-SGD runs as strategy localsgd (each process "
                       "steps alone; parameters averaged every k_steps=3 steps)")
    assert "ModelAveraging(k_steps=3, begin_step=1)  <- localsgd" in "\n".join(geo)


def test_sync_is_data_parallelism_and_the_plan_says_so(spec_for):
    sync = plan_text(spec_for, "parameter_server.mode=sync", TWO).splitlines()
    assert sync[:-1] == plan_text(spec_for, TWO).splitlines()
    assert "plugins.ddp:build_ddp()  <- lightfleet" in sync[2]
    assert sync[-1].startswith("note: parameter_server.mode=sync: Fleet's synchronous parameter-server training "
                               "runs as data parallelism")


def test_geo_beside_a_localsgd_of_its_own_k_steps_keeps_the_localsgd_knobs(spec_for):
    spec = spec_for("parameter_server.mode=geo", "parameter_server.k_steps=3", "strategy=[localsgd]",
                    "strategy.localsgd.k_steps=3", "strategy.localsgd.begin_step=5")
    assert (spec.strategies["localsgd"].k_steps, spec.strategies["localsgd"].begin_step) == (3, 5)


@pytest.mark.parametrize("overrides, message", [
    (["parameter_server.mode=gossip"], "parameter_server.mode='gossip': choose from: none, sync, geo, async, half_async"),
    (["parameter_server.mode=geo"], "parameter_server.k_steps=0: must be >= 1 with mode=geo"),
    (["parameter_server.mode=sync", "parameter_server.k_steps=4"],
     "parameter_server.k_steps=4: only parameter_server.mode=geo takes k_steps (mode is sync)"),
    (["parameter_server.mode=geo", "parameter_server.k_steps=3", "strategy=[localsgd]", "strategy.localsgd.k_steps=2"],
     "strategy.localsgd.k_steps=2: parameter_server.mode=geo runs as localsgd with parameter_server.k_steps=3; "
     "set one of them"),
])
def test_bad_parameter_server_knobs_are_one_line(spec_for, overrides, message):
    with pytest.raises(ConfigError) as error:
        spec_for(*overrides)
    assert str(error.value) == message


def test_geo_is_checked_against_the_table_as_localsgd(spec_for):
    spec = spec_for("parameter_server.mode=geo", "parameter_server.k_steps=2", "strategy=[dgc]", TWO)
    with pytest.raises(Refusal, match="dgc\\+localsgd is not an allowed combination"):
        preflight.table(preflight.Flight(spec.cfg, spec))


@pytest.mark.parametrize("mode", ["async", "half_async"])
def test_asynchronous_modes_are_refused_naming_what_to_use(lightfleet, tmp_path, mode):
    done = lightfleet(f"parameter_server.mode={mode}", "paths.output_dir=run")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"lightfleet: error: parameter_server.mode='{mode}': asynchronous updates need "
                               "parameter-server processes")
    assert "torch.distributed.rpc" in lines[0] and "parameter_server.mode=geo" in lines[0]
    assert list(tmp_path.iterdir()) == []


def final_weights(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.slow
def test_geo_trains_in_two_processes_exactly_as_localsgd(lightfleet, tmp_path):
    common = [TWO, "trainer.max_steps=6", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    geo = lightfleet("parameter_server.mode=geo", "parameter_server.k_steps=2", "paths.output_dir=geo", *common)
    assert geo.returncode == 0, geo.stderr[-3000:]
    assert "note: parameter_server.mode=geo: Fleet's GEO-SGD runs as strategy localsgd" in geo.stdout
    local = lightfleet("strategy=[localsgd]", "strategy.localsgd.k_steps=2", "paths.output_dir=local", *common)
    assert local.returncode == 0, local.stderr[-3000:]
    geo_weights, local_weights = final_weights(tmp_path / "geo"), final_weights(tmp_path / "local")
    assert list(geo_weights) == list(local_weights)
    assert all(torch.equal(geo_weights[name], local_weights[name]) for name in geo_weights)
