"""runner/config/hydra_api.py, the one module that uses Hydra's private API: each behaviour
lightfleet relies on, pinned, so that a Hydra release that changes one fails here."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode

from runner.config import hydra_api
from runner.config.compose import CONFIG_NAME, compose_config, load_hydra
from runner.core.paths import CONF_DIR


def test_the_search_path_puts_conf_first_and_a_users_config_dir_after_it(tmp_path):
    path = hydra_api.search_path(str(CONF_DIR), str(tmp_path))
    searched = [element.path for element in path.get_path()]
    assert searched.index(str(CONF_DIR)) < searched.index(f"file://{tmp_path}")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("_target_: runner.models.MLPClassifier\n")
    assert compose_config(["model=mine"], config_dir=str(tmp_path)).model._target_ == "runner.models.MLPClassifier"


def test_a_basic_sweep_splits_into_the_product_of_its_swept_overrides():
    parsed = OverridesParser.create(load_hydra().config_loader).parse_overrides(["seed=0,1", "trainer.max_steps=5,6"])
    assert sorted(map(sorted, hydra_api.split_sweep(parsed))) == sorted(
        sorted([f"seed={seed}", f"trainer.max_steps={steps}"]) for seed in (0, 1) for steps in (5, 6))


def test_the_parser_takes_hydras_flags_and_the_overrides():
    parsed = hydra_api.args_parser().parse_args(["-m", "-cd", "dir", "--cfg", "job", "seed=1"])
    assert parsed.multirun and parsed.config_dir == "dir" and parsed.cfg == "job" and parsed.overrides == ["seed=1"]


def test_one_job_runs_on_the_config_composed_already_in_its_directory(tmp_path):
    cfg = compose_config(["seed=7"], run_mode=RunMode.RUN, with_hydra=True)
    seen = {}

    def task(job_cfg):
        seen.update(hydra="hydra" in job_cfg, seed=job_cfg.seed, output_dir=HydraConfig.get().runtime.output_dir,
                    mode=HydraConfig.get().mode)
        return "its result"

    assert hydra_api.run_one(load_hydra(), cfg, str(tmp_path / "run"), task, CONFIG_NAME) == "its result"
    assert seen == {"hydra": False, "seed": 7, "output_dir": str(tmp_path / "run"), "mode": RunMode.RUN}
    assert yaml.safe_load((tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()) == ["seed=7"]
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file() and (tmp_path / "run" / ".hydra" / "hydra.yaml").is_file()

    def fails(job_cfg):
        raise RuntimeError("the task's own error")

    with pytest.raises(RuntimeError, match="the task's own error"):
        hydra_api.run_one(load_hydra(), compose_config([], with_hydra=True), str(tmp_path / "again"), fails, CONFIG_NAME)


def test_the_application_runs_a_sweeps_jobs_each_with_its_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = hydra_api.args_parser()
    ran = []
    hydra_api.run_app(parser.parse_args(["-m", "seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"]), parser,
                      lambda job_cfg: ran.append((list(HydraConfig.get().overrides.task), HydraConfig.get().mode)),
                      str(CONF_DIR), CONFIG_NAME)
    assert sorted(ran) == [(["seed=1"], RunMode.MULTIRUN), (["seed=2"], RunMode.MULTIRUN)]
    assert sorted(path.name for path in (tmp_path / "sweep").iterdir() if path.is_dir()) == ["0", "1"]
