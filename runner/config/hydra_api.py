"""What lightfleet needs of Hydra 1.3 beyond its public modules, in this one place: the Hydra
object over lightfleet's search path, the split of a basic sweep into its jobs, Hydra's command-line
parser and application (for `-m` sweeps and the flags that only show something), and one job of
run mode on a config composed already, and chosen jobs of a sweep through its launcher. tests/runner/test_hydra_api.py pins each behaviour, so that
a Hydra release that changes one fails there, not in a user's run.
"""
from __future__ import annotations

from argparse import ArgumentParser, Namespace
from typing import Any, Callable, List, Optional, Sequence, Tuple

from hydra._internal.callbacks import Callbacks
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.hydra import Hydra
from hydra._internal.utils import _run_hydra, create_automatic_config_search_path, get_args_parser
from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.types import Override
from hydra.core.plugins import Plugins
from hydra.core.utils import configure_log, run_job, setup_globals
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import DictConfig, open_dict, read_write

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"  # hydra.sweeper._target_ of `-m`'s default


def search_path(primary_dir: str, config_dir: Optional[str] = None) -> ConfigSearchPath:
    """Hydra's search path with `primary_dir` first and `config_dir` after it (as `--config-dir`
    adds it), then the ConfigStore."""
    path = create_automatic_config_search_path(None, None, primary_dir)
    if config_dir is not None:
        path.prepend(provider="command-line", path=f"file://{config_dir}", anchor=SearchPathQuery(provider="schema"))
    return path


def create_hydra(task_name: str, path: ConfigSearchPath) -> Hydra:
    """The global Hydra object over `path` (made afresh)."""
    GlobalHydra.instance().clear()
    Hydra.create_main_hydra2(task_name=task_name, config_search_path=path)
    return GlobalHydra.instance().hydra


def split_sweep(parsed: List[Override]) -> List[List[str]]:
    """The jobs of a basic sweep: the cartesian product of every swept override."""
    (jobs,) = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return jobs


def args_parser() -> ArgumentParser:
    """Hydra's command-line parser (overrides, -m, -cd, -cn, --cfg, --info, ...)."""
    return get_args_parser()


def run_app(args: Namespace, parser: ArgumentParser, task: TaskFunction, primary_dir: str, config_name: str) -> None:
    """Hydra's application on parsed arguments: it composes and launches a `-m` sweep's jobs (each
    calls `task`), or shows what a flag asks for (--cfg, --info, --hydra-help, ...)."""
    GlobalHydra.instance().clear()
    _run_hydra(args=args, args_parser=parser, task_function=task, config_path=primary_dir, config_name=config_name)


def run_one(hydra: Hydra, cfg: DictConfig, directory: str, task: Callable[[DictConfig], Any], config_name: str) -> Any:
    """One job of run mode on `cfg`, composed already with its `hydra` node, in `directory`
    (hydra.run.dir): what Hydra.run does after composing it (Hydra's logging, the callbacks, the
    job's directory with its .hydra/ files and log, HydraConfig, `task(cfg without hydra)`),
    without composing again. `task`'s result, or its exception."""
    setup_globals()
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.run.dir = directory
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    callbacks = Callbacks(cfg)
    callbacks.on_run_start(config=cfg, config_name=config_name)
    done = run_job(hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=callbacks),
                   task_function=task, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None)
    callbacks.on_run_end(config=cfg, config_name=config_name, job_return=done)
    return done.return_value


def launch_jobs(hydra: Hydra, cfg: DictConfig, task: TaskFunction, jobs: Sequence[Tuple[int, Sequence[str]]]) -> None:
    """Some jobs of the sweep `cfg` (composed in multirun mode, with its `hydra` node), each by its
    number and overrides, through the sweep's launcher, as Hydra's sweeper launches them: each
    run of consecutive numbers in one batch, so that every job keeps its number (and directory)."""
    setup_globals()
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    context = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg))
    launcher = Plugins.instance().instantiate_launcher(hydra_context=context, task_function=task, config=cfg)
    batches: List[List[Tuple[int, Sequence[str]]]] = []
    for number, overrides in sorted(jobs):
        if batches and batches[-1][-1][0] == number - 1:
            batches[-1].append((number, overrides))
        else:
            batches.append([(number, overrides)])
    for batch in batches:
        for done in launcher.launch([list(overrides) for _, overrides in batch], initial_job_idx=batch[0][0]):
            done.return_value  # as Hydra's sweeper: a job's exception is raised here
