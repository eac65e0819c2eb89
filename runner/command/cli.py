"""The `lightfleet` command: a Hydra application (every Hydra flag, `hydra.*` key, launcher and
sweeper plugin works as Hydra documents it), with lightfleet's checks in front of it.

Bad input (a typo, a wrong type, an out-of-range value, a forbidden combination, an unknown `+key`)
ends with one line on stderr and exit status 2 before Hydra makes any directory, any process starts
or torch is imported: a plain `strategy=[...]` is checked against the table before Hydra is even
imported, then the command composes the config as Hydra will and checks it (every job of a basic
sweep too). Only then does Hydra run the job(s) (runner/command/job.py) in the directory the command
reserved: a single run's one job on the config the command composed and checked (one composition,
one check), a sweep's jobs through Hydra's launcher, each handed the command's check of it.
"""
from __future__ import annotations

import os
import signal
import sys
from argparse import ArgumentParser
from functools import partial
from pathlib import Path
from collections import Counter
from typing import TYPE_CHECKING, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from runner.command import preflight, usage
from runner.command.command_line import hydra_override, parse, quote_checkpoint_names
from runner.core import collector
from runner.core.errors import ConfigError, Refusal, exit_on_user_error
from runner.core.paths import CONF_DIR, home_expanded, user_code_last, user_path
from runner.core.clock import mark_start
from runner.rank.parent import INTERRUPTED, STOPPED, exit_status

if TYPE_CHECKING:  # Hydra and OmegaConf are imported only once the table allows the run
    from argparse import Namespace

    from omegaconf import DictConfig

    Planned = Sequence[Tuple[int, Sequence[str]]]  # a sweep's jobs: (number, overrides as Hydra records them)

# `lightfleet COMMAND RUN_DIR [overrides]`: again from the config a run saved, into a new directory.
RUN_DIR_COMMANDS = ("replay", "resume", "eval")
# Hydra's flags that show something and run nothing (see `lightfleet --hydra-help`).
SHOW_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")


def main(argv: Optional[Sequence[str]] = None) -> int:
    mark_start()
    args = [home_expanded(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    if "--verbose" in args:  # the short form of Hydra's own switch
        args = [arg for arg in args if arg != "--verbose"] + ["hydra.verbose=true"]
    # `_target_`s name the user's own modules, found from where lightfleet runs: in this process, its
    # rank processes and launcher workers, after hydra.job.chdir too; after lightfleet's own packages.
    user_code_last(os.getcwd())
    if args and args[0] in usage.SUBCOMMANDS and args[0] not in RUN_DIR_COMMANDS:  # they parse their own arguments
        return main_of(args[0])(args if args[0].endswith("-fleet") else args[1:])
    args = [quote_checkpoint_names(arg) for arg in args]
    if {"-h", "--help"} & set(args) or args[:1] == ["--version"]:  # answered without torch, Lightning or Hydra
        return print_usage(args)
    try:
        with exit_on_user_error():
            if args[:1] == ["resume"] and resumes_sweep(args[1:]):
                return resume_sweep(Path(args[1]), args[2:])
            if args and args[0] in RUN_DIR_COMMANDS:
                args = from_run_dir(args[0], args[1:])
            elif args:
                usage.check_subcommand(args[0], args[1:])
            if {"-m", "--multirun", *SHOW_FLAGS} & set(args):
                return run_app(args)
            preflight.command_line(args)
            with collector.paused():  # a single run's imports and checks, until it trains (launch.run)
                return run_app(args)
    except KeyboardInterrupt:  # Ctrl-C outside a run (a run takes it itself: runner/command/launch.py)
        print("lightfleet: interrupted", file=sys.stderr)
        return INTERRUPTED


def print_usage(args: List[str]) -> int:
    """`--help` (of the command, or of resume, eval and replay) or `--version`."""
    if args[:1] == ["--version"]:
        print(usage.version_text(), end="")
    elif args[0] in usage.RUN_DIR_HELP:
        print(usage.run_dir_help(args[0]), end="")
    else:
        print(usage.help_text(usage.config_dir_of(args)), end="")
    return 0


def main_of(subcommand: str):
    """The entry point of a subcommand that parses its own arguments."""
    if subcommand == "report":
        from runner.records.report import main as report_main

        return report_main
    if subcommand == "prepare-data":
        from runner.data.prepare import main as prepare_main

        return prepare_main
    if subcommand == "rehearse":
        from runner.command.rehearse import main as rehearse_main

        return rehearse_main
    from runner.fleet.cli import main as fleet_main

    return fleet_main


def from_run_dir(command: str, args: List[str]) -> List[str]:
    """The Hydra arguments of `replay RUN_DIR` (train again from RUN_DIR's config.yaml), `resume
    RUN_DIR` (the same, from its checkpoints/last.ckpt; a run stopped before its first checkpoint
    starts again) and `eval [RUN_DIR]` (evaluate=true, with RUN_DIR's config and last checkpoint
    when one is given); overrides follow as usual."""
    from runner.records.files import CONFIG_YAML, FINISHED, LAST_CHECKPOINT, holds_run, job_ending

    if command == "eval" and not (args and holds_run(user_path(args[0]))):
        return [*args, "evaluate=true"]
    if not args or not holds_run(user_path(args[0])):
        raise ConfigError(f"lightfleet {command}", args[0] if args else None,
                          f"needs a run directory (one holding {CONFIG_YAML}) first: lightfleet "
                          f"{command} RUN_DIR [KEY=VALUE ...]")
    import yaml

    from runner.config.compose import SAVED_RUN, store_saved_run, yaml_problem

    run_dir = user_path(args[0]).resolve()
    try:
        store_saved_run(run_dir / CONFIG_YAML)
    except yaml.YAMLError as error:  # a config.yaml damaged since the run wrote it
        raise ConfigError(f"lightfleet {command}", args[0], yaml_problem(error)) from None
    start = []
    if command in ("resume", "eval"):
        last = run_dir / LAST_CHECKPOINT
        if last.exists():
            start = [hydra_override("ckpt_path", last)] + (["evaluate=true"] if command == "eval" else [])
        elif command == "eval" or job_ending(run_dir).outcome == FINISHED:
            raise ConfigError(f"lightfleet {command}", str(run_dir), f"has no {LAST_CHECKPOINT} to start from")
        else:  # stopped before its first checkpoint: the resume line it printed (a requeue script's) starts it again
            print(f"lightfleet: {run_dir} has no {LAST_CHECKPOINT} yet: starting the run again from its config",
                  file=sys.stderr, flush=True)
    return ["-cn", SAVED_RUN, *start, *args[1:]]


def run_app(args: List[str]) -> int:
    parsed, parser, config_name = parse(args)
    if parsed.help or parsed.cfg or parsed.info or parsed.hydra_help or parsed.shell_completion:
        if not (parsed.hydra_help or parsed.shell_completion):
            preflight.compose(parsed.overrides, parsed.config_dir, config_name)  # errors in one line
        run_sweep(parsed, parser, config_name, {})  # Hydra shows what the flag asks for
        return 0
    if parsed.multirun:
        return sweep(parsed, parser, config_name, args)
    return run(parsed.overrides, parsed.config_dir, config_name)


def run(overrides: List[str], config_dir: Optional[str], config_name: str) -> int:
    """A single run: composed and checked once, here; a dry run prints its plan, else Hydra runs
    the one job on that config, in the directory reserved for it, handed the check."""
    from runner.command.job import run_checked
    from runner.config import hydra_api
    from runner.config.compose import load_hydra

    cfg = preflight.compose(overrides, config_dir, config_name)
    flight = preflight.check_job(cfg)
    if flight.spec.cfg.dry_run:
        print(dry_run_text(flight))
        return 0
    run_dir, subdir = preflight.run_directory(cfg, flight.plan, flight.rehearsal)
    hydra_api.run_one(load_hydra(config_dir), cfg, str(run_dir / subdir), partial(run_checked, flight.for_the_job(), run_dir),
                      config_name)
    return 0


def sweep(parsed: "Namespace", parser: ArgumentParser, config_name: str, args: List[str]) -> int:
    """A `-m` sweep: every job of a basic sweep checked here (`check_sweep`), sweep.yaml listing
    them all with the command line `args`, then Hydra's sweeper and launcher run them, each job
    handed its check; a signal stops them all (runner/command/sweeps.py); the sweep's summary last."""
    from runner.records.files import NOT_STARTED, SWEEP_YAML
    from runner.records.run_dir import write_yaml

    checked = check_sweep(parsed.overrides, parsed.config_dir, config_name)
    if checked is None:  # a dry run: the plans are printed
        return 0
    sweep_dir, flights, planned = checked
    sweep_line = hydra_override("hydra.sweep.dir", sweep_dir)
    parsed.overrides += [sweep_line]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_yaml(sweep_dir / SWEEP_YAML, {"command": [*args, sweep_line], "cwd": os.getcwd(), "jobs": {
        str(number): {"overrides": list(overrides), "status": NOT_STARTED} for number, overrides in planned}})
    return launched(sweep_dir, planned, partial(run_sweep, parsed, parser, config_name, flights))


def launched(sweep_dir: Path, planned: "Planned", launch: Callable[[], None]) -> int:
    """Run `launch` (the sweep's jobs) passing a signal on to them all, then summarise the sweep."""
    from runner.command.sweeps import passing_signals_on, stopped_by

    with passing_signals_on(sweep_dir):
        try:
            launch()
        except SystemExit as stop:  # a job in this process was stopped: the sweep stops there
            if stop.code not in STOPPED and stopped_by(sweep_dir) is None:
                raise
    return summarize_sweep(sweep_dir, planned)


def run_sweep(parsed: "Namespace", parser: ArgumentParser, config_name: str,
              flights: Dict[Tuple[str, ...], preflight.Flight]) -> None:
    """Hydra's application on the parsed command line, its jobs run by `run_sweep_job` with `flights`."""
    from runner.command.job import run_sweep_job
    from runner.config import hydra_api

    if "hydra/sweeper=optuna" in parsed.overrides and not sys.stdout.isatty():
        import optuna

        optuna.logging.disable_default_handler()  # its coloured set-up lines are for terminals
    hydra_api.run_app(parsed, parser, partial(run_sweep_job, flights), str(CONF_DIR), config_name)


def check_sweep(overrides: List[str], config_dir: Optional[str],
                config_name: str) -> Optional[Tuple[Path, Dict[Tuple[str, ...], preflight.Flight], "Planned"]]:
    """The preflight of every job of a basic sweep. A job Hydra cannot compose (an unknown option)
    refuses the sweep: Hydra's launcher would stop at it mid-sweep. Jobs the other stages refuse
    are reported together and skipped (Hydra still launches them; each stops at once); a sweep
    none of whose jobs can run is refused. Other sweepers (Optuna) choose their jobs as they go:
    the config without the swept keys is checked, and each job checks itself.
    The sweep's directory, reserved, each checked job's flight by its overrides, and every job it
    plans, by number (None: a dry run, whose plans are printed)."""
    from runner.config.compose import expand_sweep
    from runner.config.hydra_api import BASIC_SWEEPER

    cfg = preflight.compose(overrides, config_dir, config_name, multirun=True)
    if cfg.hydra.sweeper._target_ != BASIC_SWEEPER:
        check_study_storage(cfg.hydra.sweeper.get("storage"))
        flights, planned = [(0, overrides, preflight.check_job(cfg))], []
    else:
        planned = list(enumerate(expand_sweep(overrides, config_dir)))
        flights = check_jobs(planned, config_dir, config_name)
        if not flights:
            raise Refusal("no job of the sweep can run")
    if flights[0][2].spec.cfg.dry_run:
        for number, job, flight in flights:
            print(f"--- job {number}: {' '.join(job)}\n{dry_run_text(flight)}")
        return None
    by_job = {preflight.job_overrides(job): flight.for_the_job() for number, job, flight in flights
              if cfg.hydra.sweeper._target_ == BASIC_SWEEPER}  # another sweeper's jobs check themselves
    return (preflight.sweep_directory(cfg), by_job,
            [(number, preflight.job_overrides(job)) for number, job in planned])


def check_jobs(jobs: Sequence[Tuple[int, List[str]]], config_dir: Optional[str], config_name: str,
               extra: Optional[Dict[int, List[str]]] = None) -> List[Tuple[int, List[str], preflight.Flight]]:
    """The job stages of each job (with `extra` overrides by number); those they refuse are said
    and skipped (Hydra still launches them; each stops at once)."""
    flights = []
    for number, job in jobs:
        shown = " ".join(preflight.job_overrides(job))  # as the job prints them
        cfg_of_job = preflight.compose([*job, *(extra or {}).get(number, [])], config_dir, config_name)
        try:
            flights.append((number, job, preflight.check_job(cfg_of_job)))
        except (ConfigError, Refusal) as problem:
            print(f"lightfleet: job {number} ({shown}) skipped: {problem}", file=sys.stderr)
    return flights


def dry_run_text(flight: preflight.Flight) -> str:
    """What dry_run=true prints: the plan, and with strategy=[auto] the facts, the candidates and
    the rules' choice (or the trials a search would run): runner/command/autotune.py."""
    from runner.core.plan import format_plan

    if "auto" not in flight.plan.strategies:
        return format_plan(flight.plan)
    from runner.command.autotune import preview

    return f"{format_plan(flight.plan)}\n{preview(flight.spec)}"


def summarize_sweep(sweep_dir: Path, planned: "Planned") -> int:
    """Write sweep.yaml (the command line, and every job of `planned` and found in `sweep_dir` with
    its overrides and how it ended, with the reason) and the sweep's report (printed too); return
    its exit status: a signal's when one stopped the sweep, else 1 when a job that started did not finish."""
    from runner.command.sweeps import stopped_by
    from runner.records import report
    from runner.records.jobs import sweep_jobs
    from runner.records.files import FINISHED, REFUSED, SWEEP_YAML, read_yaml
    from runner.records.run_dir import write_yaml

    jobs = sweep_jobs(sweep_dir, planned)
    write_yaml(sweep_dir / SWEEP_YAML, {**(read_yaml(sweep_dir / SWEEP_YAML) or {}), "jobs": jobs})
    report.main([str(sweep_dir)])
    signum = stopped_by(sweep_dir)
    if signum is not None:
        counts = Counter(job["status"].replace("_", " ") for job in jobs.values())
        print(f"lightfleet: sweep {'interrupted' if signum == signal.SIGINT else 'stopped'} by "
              f"{signal.Signals(signum).name}: {', '.join(f'{n} {status}' for status, n in counts.items())}; "
              f"continue with: lightfleet resume {sweep_dir}", file=sys.stderr)
        return exit_status(signum)
    return 1 if any(job["status"] not in (FINISHED, REFUSED) for job in jobs.values()) else 0


def check_study_storage(storage: Optional[str]) -> None:
    """An Optuna study's storage (`hydra.sweeper.storage`, a database URL) opened as the sweeper
    will open it, so that one the installed optuna cannot use is one line before the sweep starts,
    not a traceback (optuna 2.10, the version hydra-optuna-sweeper 1.3 takes, fails its schema
    check on SQLAlchemy 2 with a bare AssertionError). The SQLite files it made are removed again."""
    if not storage:
        return
    from optuna.storages import get_storage

    database = Path(storage.removeprefix("sqlite:///")) if storage.startswith("sqlite:///") else None
    files = [database.with_name(database.name + suffix) for suffix in ("", "-journal", "-wal")] if database else []
    made = [] if not files or files[0].exists() else files  # a database opening it creates: removed again
    try:
        get_storage(storage)
    except Exception as error:  # noqa: BLE001 (whatever the database driver or optuna raises)
        import optuna
        import sqlalchemy

        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise ConfigError("hydra.sweeper.storage", storage, f"optuna {optuna.__version__} cannot open it with "
                          f"SQLAlchemy {sqlalchemy.__version__} ({reason}); leave it unset for a study in "
                          f"memory") from None
    finally:
        for file in made:
            file.unlink(missing_ok=True)


def refuse_study(sweep_dir: Path, cfg: "DictConfig") -> NoReturn:
    """An Optuna sweep chooses its trials as it goes: it continues through its study, where that
    persists (hydra-optuna-sweeper loads a stored study of the same name again), not job by job."""
    storage, name = cfg.hydra.sweeper.get("storage"), cfg.hydra.sweeper.get("study_name")
    if storage and name:
        raise ConfigError("lightfleet resume", str(sweep_dir), f"an Optuna sweep continues through its study, not "
                          f"job by job: run its command line again into a new sweep directory, with the same "
                          f"hydra.sweeper.storage and hydra.sweeper.study_name={name}")
    raise ConfigError("lightfleet resume", str(sweep_dir), "its Optuna study was kept in memory and ended with its "
                      "command, so the sweep cannot continue: run it again (with hydra.sweeper.storage and "
                      "hydra.sweeper.study_name its study would persist)")


def resumes_sweep(args: List[str]) -> bool:
    """Whether `lightfleet resume ARGS` names a sweep directory (not a run's)."""
    from runner.records.files import holds_run, holds_sweep

    return bool(args) and holds_sweep(Path(args[0])) and not holds_run(Path(args[0]))


def resume_sweep(sweep_dir: Path, overrides: List[str]) -> int:
    """`lightfleet resume SWEEP_DIR`: the sweep's command line again (from sweep.yaml, where it ran),
    into the same directory, with only the jobs that did not finish: a stopped one from its
    checkpoints/last.ckpt (its directory moved to attempts/), one never started from the start;
    finished and refused jobs are kept as they are. A sweeper that chooses its jobs as it goes
    (Optuna) is not continued here (`refuse_study`)."""
    from runner.command.job import run_sweep_job
    from runner.command.sweeps import set_aside
    from runner.config import hydra_api
    from runner.config.compose import expand_sweep, load_hydra
    from runner.config.hydra_api import BASIC_SWEEPER
    from runner.records.jobs import sweep_jobs
    from runner.records.run_dir import take_over
    from runner.records.files import (FINISHED, LAST_CHECKPOINT, NOT_STARTED, REFUSED, SWEEP_STOPPED, SWEEP_YAML,
                                      read_yaml)

    sweep_dir = sweep_dir.resolve()
    record = read_yaml(sweep_dir / SWEEP_YAML) or {}
    if "command" not in record:
        raise ConfigError("lightfleet resume", str(sweep_dir), f"its {SWEEP_YAML} holds no command line (a sweep "
                          "from before lightfleet recorded it, or one that never started): run it again")
    if overrides:
        raise ConfigError("lightfleet resume", overrides[0], "a sweep continues as its command line planned "
                          "it: give only SWEEP_DIR")
    os.chdir(record["cwd"])  # the command line's relative paths are from there
    user_code_last(record["cwd"])
    parsed, parser, config_name = parse(record["command"])
    cfg = preflight.compose(parsed.overrides, parsed.config_dir, config_name, multirun=True)
    if cfg.hydra.sweeper._target_ != BASIC_SWEEPER:
        refuse_study(sweep_dir, cfg)
    take_over("lightfleet resume", sweep_dir)
    (sweep_dir / SWEEP_STOPPED).unlink(missing_ok=True)
    jobs = list(enumerate(expand_sweep(parsed.overrides, parsed.config_dir)))
    planned = [(number, preflight.job_overrides(job)) for number, job in jobs]
    states = sweep_jobs(sweep_dir, planned)
    names = {tuple(entry["overrides"]): name for name, entry in states.items()}
    to_run, extra = [], {}
    for number, job in jobs:
        name = names[preflight.job_overrides(job)]
        if states[name]["status"] in (FINISHED, REFUSED):
            continue
        to_run.append((number, job))
        if states[name]["status"] != NOT_STARTED:  # its directory goes aside; a checkpoint it saved is where it goes on
            last = set_aside(sweep_dir, sweep_dir / name) / LAST_CHECKPOINT
            extra[number] = [hydra_override("ckpt_path", last)] if last.is_file() else []
    if not to_run:
        print(f"lightfleet: every job of {sweep_dir} has finished (or was refused): nothing to continue")
        return summarize_sweep(sweep_dir, planned)
    flights = {preflight.job_overrides(job): flight.for_the_job()
               for number, job, flight in check_jobs(to_run, parsed.config_dir, config_name, extra)}
    print(f"lightfleet: continuing {sweep_dir}: job(s) {', '.join(str(number) for number, _ in to_run)}", flush=True)
    return launched(sweep_dir, planned, partial(
        hydra_api.launch_jobs, load_hydra(parsed.config_dir), cfg, partial(run_sweep_job, flights),
        [(number, preflight.job_overrides(job)) for number, job in to_run]))


if __name__ == "__main__":
    sys.exit(main())
