"""`lightfleet --help`, `lightfleet --version`, the `--help` of resume, eval and replay, and "did
you mean" for a misspelt subcommand: answered from this text and the conf/ and experiments/
folders alone, without importing torch, Lightning or Hydra (well under a second). Hydra's own
flags keep their help: `lightfleet --hydra-help`."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from runner.command.preflight import stage_names
from runner.core.paths import CONF_DIR, EXPERIMENTS_DIR, user_path
from runner.core.errors import ConfigError

# Each subcommand: its arguments, and what it does.
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "resume": ("RUN_DIR [KEY=VALUE ...]", "continue a run from its last checkpoint, into a new directory (or a "
               "stopped sweep's jobs: resume SWEEP_DIR)"),
    "eval": ("RUN_DIR [KEY=VALUE ...]", "evaluate a run's last checkpoint on the validation data (test=true: and test)"),
    "replay": ("RUN_DIR [KEY=VALUE ...]", "train again from the config a run saved, into a new directory"),
    "rehearse": ("[KEY=VALUE ...]", "rehearse a run of any size on this machine: each kind of rank's memory and "
                 "traffic, and whether it fits the device (docs/rehearse.md)"),
    "report": ("[PATH ...]", "compare runs and sweeps: report.md, report.csv and plots"),
    "import-fleet": ("FILE [-o FILE]", "a Fleet strategy file (prototxt) as a lightfleet experiment"),
    "export-fleet": ("RUN_DIR [-o FILE]", "a run's strategies as a Fleet strategy file"),
    "prepare-data": ("...", "tokenize text or a saved Hugging Face dataset into token files (data=tokens)"),
}
# The subcommands whose --help is this module's (the others parse their own arguments).
RUN_DIR_HELP = {
    "resume": "Continue the run in RUN_DIR from RUN_DIR/checkpoints/last.ckpt, with the config it saved, "
              "into a new run directory (overrides after it change it, e.g. trainer.max_steps=2000 to train "
              "longer: a finished run has nothing left to train; trainer.devices=M to go on with M processes: the "
              "accumulation is set to keep the checkpoint's global batch, or the command names the process counts "
              "that can). A run stopped before its first checkpoint "
              "starts again from its config. With a sweep's directory: continue the sweep there, with its "
              "command line and launcher: its stopped jobs from their checkpoints, those never started from "
              "the start; finished jobs are kept.",
    "eval": "Evaluate the last checkpoint of the run in RUN_DIR with the config it saved, on the validation "
            "data, and on the test data too with test=true; nothing is trained. Without RUN_DIR: "
            "evaluate=true on the config the overrides compose (ckpt_path=PATH names the weights).",
    "replay": "Train again from the config the run in RUN_DIR saved, from the start, into a new directory "
              "(overrides after it change it).",
}
EXAMPLES = """\
  lightfleet                                   default run: MLP on a synthetic task, one CPU process
  lightfleet experiment=quickstart             an experiment (experiments/)
  lightfleet 'strategy=[amp,recompute]'        strategies, as a list (conf/compat.yaml: which combine)
  lightfleet strategy.amp.init_loss_scaling=128 trainer.devices=2   knobs and Trainer arguments
  lightfleet dry_run=true 'strategy=[amp]'     print the plan, train nothing
  lightfleet -m 'strategy=[amp],[amp,recompute]' trainer.devices=2   a sweep: one job per combination
  lightfleet --config-dir my_configs model=my_model   options from your own config directory"""


def help_text(config_dir: Optional[Path] = None) -> str:
    """The command's help; the config groups include those of the user's `config_dir` (--config-dir)."""
    subcommands = "\n".join(f"  {name:13} {arguments:24} {what}" for name, (arguments, what) in SUBCOMMANDS.items())
    groups = "\n".join(f"{group}: {', '.join(options)}" for group, options in config_groups(config_dir).items())
    return (f"usage: lightfleet [KEY=VALUE ...]     compose a config, check it against the strategy table, plan it\n"
            f"                                      and train it with PyTorch Lightning\n"
            f"       lightfleet -m KEY=A,B ...      a sweep (Hydra's multirun)\n"
            f"       lightfleet SUBCOMMAND ...\n\n{EXAMPLES}\n\n"
            f"Subcommands (lightfleet SUBCOMMAND --help):\n{subcommands}\n\n"
            f"Config groups (GROUP=OPTION; every knob: docs/knobs.md):\n{groups}\n\n"
            f"Checked before anything is created, in this order (docs/preflight.md): {'; '.join(stage_names())}.\n"
            f"Hydra's own flags (--cfg, --info, --config-dir, -m, ...): lightfleet --hydra-help. "
            f"Versions: lightfleet --version.\n")


def config_groups(config_dir: Optional[Path] = None) -> Dict[str, List[str]]:
    """The groups of conf/ and of `config_dir` with their options, nested ones (model/optimizer) too,
    and the experiments (of experiments/ and config_dir/experiment/), as Hydra's search path joins them."""
    folders = [CONF_DIR, *([config_dir] if config_dir else [])]
    names = sorted({group.relative_to(folder).as_posix() for folder in folders if folder.is_dir()
                    for group in folder.rglob("*")
                    if group.is_dir() and group.relative_to(folder).parts[0] not in ("hydra", "experiment")})
    groups = {name: options(folder / name for folder in folders) for name in names}
    return {**groups, "experiment": options([EXPERIMENTS_DIR, *(folder / "experiment" for folder in folders)])}


def options(folders: Iterable[Path]) -> List[str]:
    return sorted({path.stem for folder in folders for path in folder.glob("*.yaml")})


def config_dir_of(args: Sequence[str]) -> Optional[Path]:
    """The --config-dir (-cd) the arguments name, if any."""
    for index, arg in enumerate(args):
        if arg in ("-cd", "--config-dir") and index + 1 < len(args):
            return user_path(args[index + 1])
        if arg.startswith("--config-dir="):
            return user_path(arg.partition("=")[2])
    return None


def run_dir_help(command: str) -> str:
    return f"usage: lightfleet {command} {SUBCOMMANDS[command][0]}\n\n{RUN_DIR_HELP[command]}\n"


def version_text() -> str:
    """lightfleet's version and those of the libraries it runs on, from their installed metadata."""
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"lightfleet {version('lightfleet')} (torch {version('torch')}, pytorch-lightning "
            f"{version('pytorch-lightning')}, hydra-core {version('hydra-core')})\n")


def check_subcommand(word: str, rest: Sequence[str] = ()) -> None:
    """A first argument that is neither an override (KEY=VALUE, +KEY=VALUE, ~KEY) nor a flag is
    meant as a subcommand: refused in one line, with the nearest subcommand. A subcommand after
    flags (`-cd cfg rehearse`) is refused with the order that works."""
    words = [word, *rest]
    for place, later in enumerate(words[1:], 1):
        if later in SUBCOMMANDS and not words[place - 1].startswith("-"):  # not a flag's value (-cd rehearse)
            others = " ".join(w for i, w in enumerate(words) if i != place)
            raise ConfigError("lightfleet", later, f"a subcommand comes first: lightfleet {later} {others}")
    if "=" in word or word.startswith(("-", "~")):
        return
    raise ConfigError("lightfleet", word, f"no such subcommand ({', '.join(SUBCOMMANDS)}) nor an override "
                                          f"(KEY=VALUE)", SUBCOMMANDS)
