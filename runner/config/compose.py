"""Compose a run's config with Hydra (runner/config/checks.py checks what it composes).

The command and the tests compose through one Hydra object (`load_hydra`): conf/ as the primary
config directory, a user's `--config-dir` after it, then the ConfigStore, where the schema and the
experiments of experiments/ live (the `experiment` group; a `hydra.searchpath` entry would be
missed by `glob(*)`: Hydra #1942). Every Hydra/OmegaConf failure becomes a one-line ConfigError
naming the key, with the options of every search-path entry for "did you mean".
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml
from typing import Any, List, Optional, Sequence

from hydra import version
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode

from runner import strategies
from runner.config import hydra_api, schema
from runner.config.hydra_api import Hydra
from runner.config.compat import check, load_table, strategies_from_argv
from runner.core.paths import CONF_DIR, EXPERIMENTS_DIR
from runner.core.errors import ConfigError, Refusal, first_line, require

CONFIG_NAME = "config"  # conf/config.yaml; also stored as `lightfleet` for users' primary configs
SAVED_RUN = "lightfleet_saved_run"  # the primary config of `lightfleet replay|resume|eval RUN_DIR`
TASK_NAME = "lightfleet"


def register_configs() -> None:
    """The schema as the base of conf/config.yaml, each experiment as a config option, and
    lightfleet's primary config as `lightfleet`, so a user's own primary config can start from it."""
    version.setbase("1.3")
    store = ConfigStore.instance()
    store.store(name="lightfleet_schema", node=schema.RunConfig)
    store.store(name="lightfleet", node=OmegaConf.load(CONF_DIR / f"{CONFIG_NAME}.yaml"))
    for path in sorted(EXPERIMENTS_DIR.glob("*.yaml")):
        store.store(group="experiment", name=path.stem, node=OmegaConf.load(path), package="_global_")


def store_saved_run(saved_config: Path) -> None:
    """The config a run saved (its config.yaml), as the primary config SAVED_RUN, its directories back to
    the defaults and every path inside the old run directory (loggers, checkpoints) re-pointed at
    `${paths.output_dir}`: run again, it writes a new run directory, never into the old one."""
    saved = OmegaConf.load(saved_config)
    old_dir = saved.paths.output_dir

    def repoint(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: repoint(item) for key, item in value.items()}
        if isinstance(value, list):
            return [repoint(item) for item in value]
        if isinstance(value, str) and (value == old_dir or value.startswith(old_dir + "/")):
            return "${paths.output_dir}" + value[len(old_dir):]
        return value

    node = repoint(OmegaConf.to_container(saved))
    node["paths"].update(output_dir=schema.PathsConfig.output_dir, sweep_dir=schema.PathsConfig.sweep_dir)
    ConfigStore.instance().store(name=SAVED_RUN, node=OmegaConf.create({"defaults": [{"hydra": "default"}, "_self_"], **node}))


_loaded_for: List[Optional[str]] = []  # the config dir the global Hydra object was made for


def load_hydra(config_dir: Optional[str] = None) -> Hydra:
    """The global Hydra object over conf/ and `config_dir` (hydra_api.search_path), made once per config dir."""
    if not (GlobalHydra.instance().is_initialized() and _loaded_for == [config_dir]):
        register_configs()
        hydra_api.create_hydra(TASK_NAME, hydra_api.search_path(str(CONF_DIR), config_dir))
        _loaded_for[:] = [config_dir]
    return GlobalHydra.instance().hydra


def compose_config(overrides: Sequence[str], config_dir: Optional[str] = None, config_name: str = CONFIG_NAME,
                   run_mode: RunMode = RunMode.RUN, with_hydra: bool = False) -> DictConfig:
    """The config Hydra composes for `overrides` (with its `hydra` node when `with_hydra`)."""
    hydra = load_hydra(config_dir)
    try:
        cfg = hydra.compose_config(config_name, list(overrides), run_mode=run_mode)
    except MissingConfigException as error:
        raise _missing(error, overrides) from None
    except yaml.YAMLError as error:  # a config file that is no YAML (Hydra lets PyYAML's error through)
        raise _not_yaml(error, config_dir) from None
    except (HydraException, OmegaConfBaseException, AssertionError) as error:
        # OmegaConf asserts on `+strategy.x.knob` under an unselected strategy (a None node)
        problem = _unselected_knob(hydra, config_name, overrides, run_mode)
        if problem is None and isinstance(error, AssertionError):
            raise
        problem = problem or _with_known_keys(explain(error), hydra, config_name, overrides, run_mode)
        raise _swept_strategy(problem, overrides, run_mode) from None
    except ValueError as error:  # Hydra's word on a malformed override, e.g. `model=null`
        raise ConfigError("overrides", " ".join(overrides),
                          f"{first_line(error)} (to drop a group use ~GROUP)") from None
    except TypeError as error:  # Hydra's defaults list on a nested list: strategy=[[amp]]
        raise ConfigError("overrides", " ".join(overrides), f"cannot be composed ({first_line(error)}); a "
                          "config group takes an option name or a flat list of them: strategy=[amp,recompute]") from None
    require_booleans(cfg, hydra, overrides)
    if not with_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def keep_typed_selection(cfg: DictConfig, overrides: Sequence[str]) -> Optional[str]:
    """A plain `strategy=[...]` among `overrides` is the whole selection. The selection is the
    strategies cfg.strategy holds, and a config file's knobs for a strategy (an experiment's
    `strategy: {amp: {dtype: ...}}`) compose that strategy back in even when the command line's
    list leaves it out: such knobs are dropped here, and the note that says so is returned. A knob
    typed on the command line for a strategy left out is refused, as it is without an experiment."""
    typed = strategies_from_argv(overrides)
    if typed is None:
        return None
    refuse_unselected_knobs(overrides, typed)
    dropped = [name for name, node in cfg.strategy.items() if node is not None and name not in typed]
    for name in dropped:
        cfg.strategy[name] = None
    if not dropped:
        return None
    # Adding to the list would be refused beside a strategy the table runs alone (auto).
    lonely = sorted(load_table().alone.intersection(typed))
    keep = f"{lonely[0]} is used alone" if lonely else f"add {', '.join(dropped)} to the list to keep them"
    return (f"strategy=[{','.join(typed)}] on the command line is the whole selection: the config files' settings "
            f"for {', '.join(dropped)} are dropped ({keep})")


def require_booleans(cfg: DictConfig, hydra: Hydra, overrides: Sequence[str]) -> None:
    """A knob typed bool takes true or false on the command line: composing onto the schema, OmegaConf
    reads 1 or "yes" as true, silently."""
    for override in OverridesParser.create(hydra.config_loader).parse_overrides(list(overrides)):
        if override.is_sweep_override() or override.is_delete() or not override.key_or_group.count("."):
            continue
        parent, _, leaf = override.key_or_group.rpartition(".")
        node = OmegaConf.select(cfg, parent)
        given = override.value()
        if isinstance(node, DictConfig) and isinstance(node._get_node(leaf), BooleanNode):
            require(given is None or isinstance(given, bool), override.key_or_group, given, "must be true or false")


def _with_known_keys(problem: ConfigError, hydra: Hydra, config_name: str, overrides: Sequence[str],
                     run_mode: RunMode) -> ConfigError:
    """An unknown key under a node the schema leaves open (model, data, a callback), with the
    keys that node has when composed without it, for "did you mean"; or, for no near name, under a
    `_target_` node, how to pass an argument its config leaves out (a callback's): with `+`, as
    Hydra adds a key (the arguments stage then checks that the class takes it)."""
    parent, _, leaf = problem.key.rpartition(".")
    if problem.value is not None or "has no key" not in str(problem) or "did you mean" in str(problem) or not parent:
        return problem
    given = [o for o in overrides if o.lstrip("+~").split("=")[0] == problem.key]
    others = [o for o in overrides if o not in given]
    try:
        node = OmegaConf.select(hydra.compose_config(config_name, others, run_mode=run_mode), parent)
    except Exception:  # noqa: BLE001 (the first error is the one to report)
        return problem
    if not isinstance(node, DictConfig):
        return problem
    known = ConfigError.unknown_key(problem.key, list(node.keys()))
    if "did you mean" in str(known) or "_target_" not in node or not given or given[0][0] in "+~":
        return known
    return ConfigError(problem.key, None, f"{parent} has no key {leaf!r}; to pass an argument its config leaves "
                       f"out, add it with +{given[0]}")


def group_options(group: str) -> List[str]:
    """The options of a config group over the whole search path (conf/, a user's dir, the store)."""
    return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


# A strategy's knob in every override form: key=, +key= (add), ++key= (add or set), ~key (delete).
STRATEGY_KNOB = re.compile(r"^[+~]*(strategy\.(\w+)\.[^=]+)")


def refuse_unselected_knobs(overrides: Sequence[str], selected: Sequence[str]) -> None:
    """The first override, of any form, of a knob of a strategy not in `selected` is refused."""
    for override in overrides:
        knob = STRATEGY_KNOB.match(override)
        if knob and knob.group(2) not in selected:
            raise _not_selected(knob.group(1))


def _unselected_knob(hydra: Hydra, config_name: str, overrides: Sequence[str], run_mode: RunMode) -> Optional[ConfigError]:
    """Why composing `overrides` failed when one sets or deletes a knob of a strategy left out: the
    selection is a typed `strategy=[...]`, else what the config composes to without the knobs."""
    selected = strategies_from_argv(overrides)
    if selected is None:
        try:
            composed = hydra.compose_config(config_name, [o for o in overrides if not STRATEGY_KNOB.match(o)],
                                            run_mode=run_mode)
        except Exception:  # noqa: BLE001 (the first error is the one to report)
            return None
        selected = [name for name, node in composed.strategy.items() if node is not None]
    try:
        refuse_unselected_knobs(overrides, selected)
    except ConfigError as problem:
        return problem
    return None


def _not_selected(knob: str) -> Exception:
    name = knob.split(".")[1]
    check([name], load_table())  # an unknown name says so first
    return ConfigError(knob, None, f"strategy {name} is not selected; add it to strategy=[...] to set its knobs")


def _swept_strategy(problem: ConfigError, overrides: Sequence[str], run_mode: RunMode) -> ConfigError:
    """`problem`, or, for a knob of a strategy that only a swept `strategy=` selects, why: Hydra
    composes a sweep's own config without its swept options, so the knob must be swept too (with one value)."""
    if run_mode != RunMode.MULTIRUN or not problem.key.startswith("strategy.") or "is not selected" not in str(problem):
        return problem
    name = problem.key.split(".")[1]
    swept = [o for o in overrides if o.startswith("strategy=") and "," in o and re.search(rf"\b{name}\b", o)]
    if not swept:
        return problem
    value = next((o.partition("=")[2] for o in overrides if o.lstrip("+").startswith(f"{problem.key}=")), "VALUE")
    return ConfigError(problem.key, value, f"strategy {name} is selected only by the sweep ({swept[0]}), and Hydra "
                       f"composes a sweep's config without its swept options: sweep the knob too, with one value: "
                       f"{problem.key}=choice({value})")


def expand_sweep(overrides: Sequence[str], config_dir: Optional[str] = None) -> List[List[str]]:
    """The jobs of a `-m` sweep: the cartesian product of every swept override (Hydra's syntax:
    `a=1,2`, `glob(*)`, `range(...)`, `choice(...)`)."""
    try:
        parsed = OverridesParser.create(load_hydra(config_dir).config_loader).parse_overrides(list(overrides))
        return hydra_api.split_sweep(parsed)
    except HydraException as error:
        raise ConfigError("overrides", " ".join(overrides), first_line(error)) from None


def _missing(error: MissingConfigException, overrides: Sequence[str]) -> Exception:
    group = re.search(r"Could not (?:load|find) '([\w/]+?)/(\w+)'", str(error))
    if group is None:
        return ConfigError("overrides", " ".join(overrides), first_line(error))
    group_name, option = group.group(1), group.group(2)
    if group_name == "strategy":  # the compat check names the known strategies
        try:
            check([option], load_table())
        except (ConfigError, Refusal) as refusal:
            return refusal
    options = group_options(group_name)
    return ConfigError(group_name, option, f"no such option; choose from: {', '.join(options)}", options)


def _not_yaml(error: yaml.YAMLError, config_dir: Optional[str]) -> ConfigError:
    """One line for a config file PyYAML cannot read: the selection that loaded it (`model=bad`, or
    the primary config's name), then `yaml_problem`."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return ConfigError("config", None, yaml_problem(error))
    path = Path(mark.name)
    root = next((Path(root) for root in (config_dir, CONF_DIR) if root and path.is_relative_to(root)), path.parent)
    group = path.parent.relative_to(root).as_posix()
    return ConfigError("--config-name" if group == "." else group, path.stem, yaml_problem(error))


def yaml_problem(error: yaml.YAMLError) -> str:
    """What PyYAML found wrong, in one line: the file, line and column, and the problem."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f"not YAML: {first_line(error)}"
    what = error.problem + (" (YAML indents with spaces, not tabs)" if "'\\t'" in error.problem else "")
    if error.context and error.context_mark and error.context_mark.line != mark.line:
        what += f", {error.context} from line {error.context_mark.line + 1}"
    return f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: {what}"


def explain(error: Exception) -> ConfigError:
    """One line naming the key, the value and what is allowed, from an OmegaConf/Hydra error."""
    cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
    key = getattr(cause, "full_key", None) or ""
    message = first_line(cause)
    if "not in struct" in str(cause) or "Key '" in message and "not" in message:
        overridden = re.search(r"Could not override '([\w.]+)'", str(error))
        name = (overridden.group(1) if overridden else key).split(".")
        if name[0] == "strategy" and len(name) > 2 and key in ("strategy", f"strategy.{name[1]}"):
            return _not_selected(".".join(name))
        return ConfigError.unknown_key(key, _schema_keys(key.rpartition(".")[0]))
    value = re.search(r"Value '([^']*)'", message)
    return ConfigError(key or "config", value.group(1) if value else None, message)


def _schema_keys(parent: str) -> List[str]:
    """Field names of the schema node at dotted path `parent` (for "did you mean")."""
    node: Any = OmegaConf.structured(schema.RunConfig)
    known = strategies.schemas()
    for part in filter(None, parent.split(".")):
        if parent.startswith("strategy.") and part in known:
            node = OmegaConf.structured(known[part])
            continue
        node = node.get(part) if isinstance(node, DictConfig) else None
        if node is None:
            return []
    return list(node.keys()) if isinstance(node, DictConfig) else []
