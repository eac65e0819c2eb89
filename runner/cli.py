"""The `lightfleet` command: compose -> schema -> compatibility -> plan -> dry run | record -> launch.

Bad input (a typo, a wrong type, an out-of-range value, a forbidden combination) ends with one
line on stderr and exit status 2, before any run directory is made, any process starts, or
torch is imported. A plain `strategy=[...]` on the command line is checked against the table
before Hydra is even imported, so a refusal costs a fraction of a second.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from runner import strategies
from runner.compat import CONF_DIR, EXPERIMENTS_DIR, check, load_table, strategies_from_argv
from runner.errors import ConfigError, Refusal, exit_on_user_error

USAGE = """\
usage: lightfleet [-m] [--cfg] [KEY=VALUE | GROUP=OPTION ...]

Compose a config from conf/ (and experiments/), check it, plan it and train it with PyTorch Lightning.

  lightfleet                                   default run: MLP on a synthetic task, one CPU process
  lightfleet experiment=quickstart             an experiment from experiments/
  lightfleet 'strategy=[amp,recompute]'        strategies, as a list
  lightfleet strategy.amp.init_loss_scaling=128 trainer.devices=2   knobs and Trainer arguments
  lightfleet dry_run=true 'strategy=[amp]'     print the plan, train nothing
  lightfleet -m 'strategy=[amp],[amp,recompute]' trainer.devices=2  a sweep: one job per combination
  lightfleet -m 'experiment=glob(*)'           every experiment

options:
  -m, --multirun   run every combination of the swept overrides (a=1,2  glob(*)  range(1,4))
  --cfg            print the composed config and exit
  -h, --help       this help

config groups (GROUP=OPTION):
{groups}
strategies available: {strategies}
experiments: {experiments}
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # `_target_`s name the user's own modules, found from where lightfleet runs (as with `python -m`).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if "-h" in args or "--help" in args:
        print(usage())
        return 0
    multirun = _pop_flag(args, "-m", "--multirun")
    print_config = _pop_flag(args, "--cfg")
    with exit_on_user_error():
        selected = None if multirun else strategies_from_argv(args)
        if selected is not None:  # the command line's list wins over any experiment's: decide now
            check(selected, load_table())
        if print_config:
            from omegaconf import OmegaConf

            from runner.config import compose_config

            print(OmegaConf.to_yaml(compose_config(args)))
            return 0
        return run_sweep(args) if multirun else run_single(args)


def usage() -> str:
    groups = "\n".join(f"  {d.name:<10} {', '.join(sorted(p.stem for p in d.glob('*.yaml')))}"
                       for d in sorted(CONF_DIR.iterdir()) if d.is_dir())
    return USAGE.format(groups=groups, strategies=", ".join(strategies.names()),
                        experiments=", ".join(sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))))


def prepare(overrides: Sequence[str]):
    """Compose, validate, check against the table and plan: pure Python, no torch. The one
    place plans are made; every rank reads the plan this saves."""
    from runner.config import compose_config, validate
    from runner.plan import make_plan
    from runner.world import World, check_multi_node

    spec = validate(compose_config(overrides))
    check(list(spec.strategies), load_table())
    plan = make_plan(spec.strategies, spec.trainer, spec.batch_size)
    check_multi_node(World(**plan.world))
    return spec, plan


def run_single(overrides: Sequence[str]) -> int:
    from runner.plan import format_plan

    spec, plan = prepare(overrides)
    if spec.cfg.dry_run:
        print(format_plan(plan))
        return 0
    return launch(spec, plan, overrides)


def launch(spec, plan, overrides: Sequence[str]) -> int:
    """Record the run directory and train; a failed rank becomes one line naming its log."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from runner import launch as launcher
    from runner.plan import format_plan
    from runner.records import create_run_dir
    from runner.world import World

    records = create_run_dir(spec.cfg, plan, overrides)
    print(f"{format_plan(plan)}\nlightfleet: run directory {spec.cfg.paths.output_dir}", flush=True)
    try:
        launcher.run(records, World(**plan.world))
    except ChildFailedError as failure:
        codes = {rank: f.exitcode for rank, f in sorted(failure.failures.items())}
        print(f"lightfleet: run failed: exit status by rank {codes}; logs in {records / 'logs'}", file=sys.stderr)
        # A rank that exits 2 has printed a bad-input line; the others were stopped because of it.
        return 2 if 2 in codes.values() else 1
    return 0


def run_sweep(overrides: Sequence[str]) -> int:
    """Expand the sweep, check every job first (refusals reported together and skipped), then
    run the others one after another, each in its own directory under paths.sweep_dir."""
    from runner.config import expand_sweep
    from runner.plan import format_plan
    from runner.records import write_yaml

    jobs = expand_sweep(overrides)
    ready: List[Tuple[int, List[str], object, object]] = []
    for number, job in enumerate(jobs):
        try:
            spec, plan = prepare(job)
        except (ConfigError, Refusal) as problem:
            print(f"lightfleet: job {number} ({' '.join(job)}) skipped: {problem}", file=sys.stderr)
            continue
        ready.append((number, job, spec, plan))
    if not ready:
        print("lightfleet: refused: no job of the sweep can run", file=sys.stderr)
        return 2
    from runner.records import fresh_dir, named_by_clock

    first = ready[0][2].cfg
    sweep_dir = Path(first.paths.sweep_dir).expanduser().resolve()
    if named_by_clock(first.paths, "sweep_dir") and not first.dry_run:
        sweep_dir = fresh_dir(sweep_dir)
    status = {}
    for number, job, spec, plan in ready:
        if spec.cfg.dry_run:
            print(f"--- job {number}: {' '.join(job)}\n{format_plan(plan)}")
            continue
        spec.cfg.paths.output_dir = str(sweep_dir / str(number))
        print(f"lightfleet: job {number} of {len(jobs)}: {' '.join(job)}", flush=True)
        try:
            code = launch(spec, plan, job)
        except ConfigError as error:  # e.g. a module name only the built model can reject
            print(f"lightfleet: job {number} error: {error}", file=sys.stderr)
            code = 2
        status[number] = {"overrides": job, "exit_status": code}
    if status:
        write_yaml(sweep_dir / "multirun.yaml", {"jobs": len(jobs), "ran": status})
    return 1 if any(s["exit_status"] for s in status.values()) else 0


def _pop_flag(args: List[str], *names: str) -> bool:
    found = [a for a in args if a in names]
    for a in found:
        args.remove(a)
    return bool(found)


if __name__ == "__main__":
    sys.exit(main())
