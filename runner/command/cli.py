"""The `lightfleet` command: a Hydra application (every Hydra flag, `hydra.*` key, launcher and
sweeper plugin works as Hydra documents it), with lightfleet's checks in front of it.

Bad input (a typo, a wrong type, an out-of-range value, a forbidden combination, an unknown
`+key`) ends with one line on stderr and exit status 2 before Hydra makes any directory, any
process starts or torch is imported: a plain `strategy=[...]` is checked against the table
before Hydra is even imported, then the command composes the config as Hydra will and checks it
(every job of a basic sweep too). Only then does Hydra run the job(s) (runner/command/job.py) in the
directory the command reserved: a single run's one job on the config the command composed and
checked (one composition, one check), a sweep's jobs through Hydra's launcher, each handed the
command's check of it.
"""
from __future__ import annotations

import os
import re
import sys
from argparse import ArgumentParser
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, NoReturn, Optional, Sequence, Tuple

from runner.command import preflight, usage
from runner.core.errors import ConfigError, Refusal, exit_on_user_error
from runner.core.paths import CONF_DIR, home_expanded, user_code_last, user_path
from runner.core.clock import mark_start
from runner.rank.parent import INTERRUPTED, STOPPED

if TYPE_CHECKING:  # Hydra and OmegaConf are imported only once the table allows the run
    from argparse import Namespace

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
            if args and args[0] in RUN_DIR_COMMANDS:
                args = from_run_dir(args[0], args[1:])
            elif args:
                usage.check_subcommand(args[0])
            if not {"-m", "--multirun", *SHOW_FLAGS} & set(args):
                preflight.command_line(args)
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
    from runner.config import hydra_api
    from runner.config.compose import CONFIG_NAME

    parser = hydra_api.args_parser()
    parser.prog = "lightfleet"
    parser.error = partial(refuse_flags, parser)
    parsed = parser.parse_args(args)
    parsed.config_dir, parsed.config_path = user_config_dir(parsed.config_dir, parsed.config_path), None
    config_name = parsed.config_name or CONFIG_NAME
    if parsed.help or parsed.cfg or parsed.info or parsed.hydra_help or parsed.shell_completion:
        if not (parsed.hydra_help or parsed.shell_completion):
            preflight.compose(parsed.overrides, parsed.config_dir, config_name)  # errors in one line
        run_sweep(parsed, parser, config_name, {})  # Hydra shows what the flag asks for
        return 0
    if parsed.multirun:
        return sweep(parsed, parser, config_name)
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
    run_dir, subdir = preflight.run_directory(cfg, flight.plan)
    hydra_api.run_one(load_hydra(config_dir), cfg, str(run_dir / subdir), partial(run_checked, flight.for_the_job(), run_dir),
                      config_name)
    return 0


def sweep(parsed: "Namespace", parser: ArgumentParser, config_name: str) -> int:
    """A `-m` sweep: every job of a basic sweep checked here (`check_sweep`), then Hydra's sweeper
    and launcher run them, each job handed its check; the sweep's summary last."""
    checked = check_sweep(parsed.overrides, parsed.config_dir, config_name)
    if checked is None:  # a dry run: the plans are printed
        return 0
    sweep_dir, flights = checked
    parsed.overrides += [hydra_override("hydra.sweep.dir", sweep_dir)]
    if "hydra/sweeper=optuna" in parsed.overrides and not sys.stdout.isatty():
        import optuna

        optuna.logging.disable_default_handler()  # its coloured set-up lines are for terminals
    try:
        run_sweep(parsed, parser, config_name, flights)
    except SystemExit as stop:
        if stop.code not in STOPPED:
            raise
        summarize_sweep(sweep_dir)  # a job was preempted or interrupted: the sweep stops there, its summary says so
        return stop.code
    return summarize_sweep(sweep_dir)


def run_sweep(parsed: "Namespace", parser: ArgumentParser, config_name: str,
              flights: Dict[Tuple[str, ...], preflight.Flight]) -> None:
    """Hydra's application on the parsed command line, its jobs run by `run_sweep_job` with `flights`."""
    from runner.command.job import run_sweep_job
    from runner.config import hydra_api

    hydra_api.run_app(parsed, parser, partial(run_sweep_job, flights), str(CONF_DIR), config_name)


def refuse_flags(parser: ArgumentParser, message: str) -> NoReturn:
    """argparse's refusal of the command line, as one line (not its usage text): the flag and the
    flags there are."""
    flags = sorted({flag for action in parser._actions for flag in action.option_strings})
    unknown = re.match(r"unrecognized arguments: (\S+)", message)
    if unknown and not unknown.group(1).startswith("-"):  # argparse takes the overrides in one run
        raise ConfigError("command line", unknown.group(1), "an override after a flag: give the flags (-m, -cd, "
                          "...) first, then every KEY=VALUE")
    if unknown:
        raise ConfigError("command line", unknown.group(1), "no such flag (lightfleet --help lists them)", flags)
    raise ConfigError("command line", None, f"{message} (lightfleet --help lists the flags)")


def user_config_dir(config_dir: Optional[str], config_path: Optional[str]) -> Optional[str]:
    """The user's config directory, absolute. `-cp DIR` is taken as `-cd DIR`: lightfleet's conf/
    stays on the search path, so a primary config there (`-cn NAME`) can start from lightfleet's
    (`defaults: [lightfleet, _self_]`)."""
    if config_dir is not None and config_path is not None:
        raise ConfigError("--config-path", config_path, "give --config-dir or --config-path, not both: "
                          "each adds one directory before lightfleet's configs")
    chosen = config_dir if config_path is None else config_path
    if chosen is None:
        return None
    path = user_path(chosen).resolve()
    if not path.is_dir():
        raise ConfigError("--config-dir" if config_path is None else "--config-path", chosen, "no such directory")
    return str(path)


def check_sweep(overrides: List[str], config_dir: Optional[str],
                config_name: str) -> Optional[Tuple[Path, Dict[Tuple[str, ...], preflight.Flight]]]:
    """The preflight of every job of a basic sweep. A job Hydra cannot compose (an unknown option)
    refuses the sweep: Hydra's launcher would stop at it mid-sweep. Jobs the other stages refuse
    are reported together and skipped (Hydra still launches them; each stops at once); a sweep
    none of whose jobs can run is refused. Other sweepers (Optuna) choose their jobs as they go:
    the config without the swept keys is checked, and each job checks itself.
    The sweep's directory, reserved, and each checked job's flight by its overrides (None: a dry
    run, whose plans are printed)."""
    from runner.config.compose import expand_sweep
    from runner.config.hydra_api import BASIC_SWEEPER

    cfg = preflight.compose(overrides, config_dir, config_name, multirun=True)
    if cfg.hydra.sweeper._target_ != BASIC_SWEEPER:
        flights = [(0, overrides, preflight.check_job(cfg))]
    else:
        flights = []
        for number, job in enumerate(expand_sweep(overrides, config_dir)):
            shown = " ".join(preflight.job_overrides(job))  # as the job prints them
            cfg_of_job = preflight.compose(job, config_dir, config_name)  # Hydra would stop here
            try:
                flights.append((number, job, preflight.check_job(cfg_of_job)))
            except (ConfigError, Refusal) as problem:
                print(f"lightfleet: job {number} ({shown}) skipped: {problem}", file=sys.stderr)
        if not flights:
            raise Refusal("no job of the sweep can run")
    if flights[0][2].spec.cfg.dry_run:
        for number, job, flight in flights:
            print(f"--- job {number}: {' '.join(job)}\n{dry_run_text(flight)}")
        return None
    by_job = {preflight.job_overrides(job): flight.for_the_job() for number, job, flight in flights
              if cfg.hydra.sweeper._target_ == BASIC_SWEEPER}  # another sweeper's jobs check themselves
    return preflight.sweep_directory(cfg), by_job


def dry_run_text(flight: preflight.Flight) -> str:
    """What dry_run=true prints: the plan, and with strategy=[auto] the facts, the candidates and
    the rules' choice (or the trials a search would run): runner/command/autotune.py."""
    from runner.core.plan import format_plan

    if "auto" not in flight.plan.strategies:
        return format_plan(flight.plan)
    from runner.command.autotune import preview

    return f"{format_plan(flight.plan)}\n{preview(flight.spec)}"


def hydra_override(key: str, path: Path) -> str:
    """`key='path'` in Hydra's override syntax (quoted: a path may hold `=`, `,` or spaces)."""
    return f"{key}={quoted(str(path))}"


def quoted(text: str) -> str:
    """`text` as a quoted string of Hydra's override syntax."""
    return "'%s'" % text.replace("'", "\\'")


def quote_checkpoint_names(arg: str) -> str:
    """`ckpt_path=RUN/checkpoints/epoch=3-step=50.ckpt` as typed: Lightning names its checkpoints
    with `=`, which Hydra's override syntax reads only in quotes. Each of a sweep's comma-separated
    paths is quoted; a value quoted already, an interpolation or a sweep function is left as typed."""
    key, _, value = arg.partition("=")
    if key.lstrip("+") != "ckpt_path" or "=" not in value or re.search(r"['\"$(]", value):
        return arg
    return f"{key}={','.join(quoted(path) for path in value.split(','))}"


def summarize_sweep(sweep_dir: Path) -> int:
    """Write sweep.yaml (each job's overrides and how it ended, with the reason) and the sweep's
    report (printed too); return its exit status: 1 when a job that started did not finish."""
    from runner.records import report
    from runner.records.files import (CONFIG_YAML, FINISHED, HYDRA_OVERRIDES, REFUSED, REFUSED_YAML, SWEEP_YAML,
                                      job_ending, read_yaml)
    from runner.records.jobs import job_order
    from runner.records.run_dir import write_yaml

    jobs = {}
    found = {path.parent for path in sweep_dir.rglob("*.yaml") if path.name in (CONFIG_YAML, REFUSED_YAML)}
    for job in sorted(found, key=lambda job: job_order(job.relative_to(sweep_dir).as_posix())):
        name = job.relative_to(sweep_dir).as_posix()
        ending = job_ending(job)
        if ending.outcome == REFUSED:
            jobs[name] = {**ending.record, "status": REFUSED}
        elif (job / HYDRA_OVERRIDES).is_file():
            # failure.yaml says how a job that did not finish ended (status, exit_code, error)
            told = ending.record if ending.outcome != FINISHED and ending.record else {"status": ending.outcome}
            jobs[name] = {"overrides": read_yaml(job / HYDRA_OVERRIDES), **told}
    write_yaml(sweep_dir / SWEEP_YAML, {"jobs": jobs})
    report.main([str(sweep_dir)])
    return 1 if any(job["status"] not in (FINISHED, REFUSED) for job in jobs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
