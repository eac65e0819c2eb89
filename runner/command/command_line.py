"""The command line as lightfleet reads it: Hydra's parse of its flags and overrides, argparse's
refusals as one line, the user's config directory, and paths written in Hydra's override syntax
(quoted: Lightning's checkpoint names hold `=`)."""
from __future__ import annotations

import re
from argparse import ArgumentParser
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, List, NoReturn, Optional, Tuple

from runner.core.errors import ConfigError
from runner.core.paths import user_path

if TYPE_CHECKING:
    from argparse import Namespace


def parse(args: List[str]) -> Tuple["Namespace", ArgumentParser, str]:
    """Hydra's parse of the command line (flags, overrides), the parser, and the config's name."""
    from runner.config import hydra_api
    from runner.config.compose import CONFIG_NAME

    parser = hydra_api.args_parser()
    parser.prog = "lightfleet"
    parser.error = partial(refuse_flags, parser)
    parsed = parser.parse_args(args)
    parsed.config_dir, parsed.config_path = user_config_dir(parsed.config_dir, parsed.config_path), None
    return parsed, parser, parsed.config_name or CONFIG_NAME


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
