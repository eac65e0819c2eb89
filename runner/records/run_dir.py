"""The run directory: everything needed to see what ran and to run it again (its files and
how a job ended: runner/records/files.py), made by the command before any rank starts.
"""
from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf

from runner.core.paths import CHECKOUT
from runner.core.errors import ConfigError, error_line, first_line, require
from runner.core.plan import Plan, format_plan
from runner.core.world import World, alive, external_rank, launched_externally
from runner.records.checkpoints import (manifest_path, newest_intact, read_manifest, remove_leftovers, verify,
                                        write_atomically)
from runner.records.files import (CONFIG_YAML, ENV_YAML, FAILED, FAILURE_YAML, LAST_CHECKPOINT, MULTIRUN_YAML,
                                  NODES_DIR, OWNER_YAML, PLAN_YAML, RANKS_DIR, failure_outcome)

TEST_PAUSE_RESERVED = "LIGHTFLEET_TEST_PAUSE_RESERVED"  # for tests only: see pause_for_tests


def create_run_dir(cfg: DictConfig, plan: Plan, command: Sequence[str], records: Path) -> None:
    """Resolve the config and write config, plan and environment into `records`: the run
    directory, or for a second node or an externally launched rank its subdirectory
    (`records_subdir`). The command reserved it (`reserve_dir`); Hydra made it."""
    if (records / CONFIG_YAML).exists():
        raise ConfigError("paths.output_dir", str(records), "already holds a run; choose another directory")
    OmegaConf.resolve(cfg)
    records.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, records / CONFIG_YAML)
    write_yaml(records / PLAN_YAML, {"printed": format_plan(plan).splitlines(), **plan.to_dict()})
    write_yaml(records / ENV_YAML, environment(command))


def reserve_dir(cfg: DictConfig, hydra_key: str, paths_key: str, subdir: str = "") -> Path:
    """The absolute directory a run (hydra.run.dir) or sweep (hydra.sweep.dir) will write, checked
    and taken by this command before Hydra writes anything into it. `hydra.<x>.dir` follows
    `paths.<x>_dir` unless set itself; setting both to different places is refused. A directory
    named by the clock (the default) that is taken gets a -1, -2, ... suffix; one the user named is
    refused if it already holds a run or sweep, so nothing written earlier is overwritten, or if
    another command holds it (`take`). `subdir`: see `records_subdir`."""
    hydra_dir = str(OmegaConf.select(cfg, hydra_key))
    paths_dir = str(OmegaConf.select(cfg, paths_key))
    if hydra_dir != paths_dir and not _named_by_clock(cfg, paths_key):
        raise ConfigError(hydra_key, hydra_dir, f"differs from {paths_key}={paths_dir!r}; set one of them "
                          f"({hydra_key} follows {paths_key})")
    key = paths_key if hydra_dir == paths_dir else hydra_key
    path = Path(hydra_dir).expanduser().resolve()
    check_writable(key, path)
    if not subdir and _named_by_clock(cfg, hydra_key):
        path = fresh_dir(path)
    for record, holds in ((CONFIG_YAML, "a run"), (MULTIRUN_YAML, "a sweep")):
        if (path / subdir / record).exists():
            raise ConfigError(key, str(path), f"already holds {holds}; choose another directory")
    take(key, path, subdir)
    pause_for_tests()
    return path


def take(key: str, path: Path, subdir: str) -> None:
    """Make the directory `path` (with a node's or rank's `subdir`: each records apart) this
    command's in one atomic step, so that of two commands given one directory exactly one goes on,
    whatever the timing: an exclusive create (O_EXCL, which local file systems and NFS v3 and later
    honour) of its owner.yaml, then its pid, host, time and command written into it. The file
    stays: a directory belongs to the command that took it, also after it ended (a resume writes a
    new one). A holder that died before it recorded a run leaves its claim too: from another host
    no command can tell a dead holder from a live one, and taking a claim over safely would need a
    second atomic step; the refusal says which file to remove."""
    records = path / subdir
    records.mkdir(parents=True, exist_ok=True)
    try:
        claim = os.open(records / OWNER_YAML, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ConfigError(key, str(path), held_by(records / OWNER_YAML)) from None
    owner = {"pid": os.getpid(), "host": platform.node(), "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
             "command": shlex.join(["lightfleet", *sys.argv[1:]])}
    with os.fdopen(claim, "w") as file:
        file.write(yaml.safe_dump(owner, sort_keys=False))


def take_over(key: str, path: Path) -> None:
    """Make a stopped sweep's directory this command's, to continue it in place (`lightfleet resume
    SWEEP_DIR`): refused while its holder still runs on this host; of two commands continuing it at
    once, one goes on: the old claim is renamed away (atomic: the other finds it gone), then taken
    as `take` does."""
    claim = path / OWNER_YAML
    if claim.exists():
        owner = yaml.safe_load(claim.read_text()) or {}
        if owner.get("host") == platform.node() and alive(owner.get("pid", -1)):
            raise ConfigError(key, str(path), f"is held by a command still running (pid {owner['pid']}: "
                              f"{owner.get('command')}); stop it first, or remove {claim} if that process is another")
        ended = path / f".{OWNER_YAML}.{os.getpid()}.ended"
        try:
            os.rename(claim, ended)
        except FileNotFoundError:
            raise ConfigError(key, str(path), "is being continued by another command") from None
        ended.unlink()
    take(key, path, "")


def held_by(owner_file: Path, wait_s: float = 2.0) -> str:
    """Why a command cannot take a directory whose owner.yaml is `owner_file`: who holds it, and
    what to do. The holder writes the file right after creating it: an empty one is waited for."""
    deadline = time.monotonic() + wait_s
    while not (owner := yaml.safe_load(owner_file.read_text()) or {}) and time.monotonic() < deadline:
        time.sleep(0.05)
    holder = (f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('since')}: {owner.get('command')}"
              if owner else f"one that left {owner_file} empty")
    if owner.get("host") == platform.node() and not alive(owner["pid"]):
        return (f"is held by another command ({holder}), which is no longer running and recorded no run or sweep "
                f"there; choose another directory, or remove {owner_file} to use this one")
    return f"is held by another command ({holder}); choose another directory"


def pause_for_tests() -> None:
    """For tests only: LIGHTFLEET_TEST_PAUSE_RESERVED=SECONDS holds the command here, after the run
    or sweep directory is reserved and before Hydra writes into it, so that a test can start a
    second command on the same directory inside that window."""
    time.sleep(float(os.environ.get(TEST_PAUSE_RESERVED, 0)))


def check_writable(key: str, path: Path) -> None:
    """A run or sweep directory lightfleet can make and fill, and not inside another run's."""
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    require(existing.is_dir(), key, str(path), f"{existing} is a file, not a directory")
    try:  # a directory made and removed again: os.access says yes to root even where mkdir fails
        os.rmdir(tempfile.mkdtemp(prefix=".lightfleet-probe-", dir=existing))
    except OSError as error:
        raise ConfigError(key, str(path), f"cannot be written: {error.strerror} ({existing})") from None
    for parent in path.parents:
        require(not (parent / PLAN_YAML).is_file(), key, str(path),
                f"is inside the run directory {parent}; choose a directory outside it")


def find_checkpoint(run: DictConfig, base: Path) -> Path:
    """`run.ckpt_path` as an absolute path that exists (relative ones are taken from `base`, where
    the command ran). `last` is the newest checkpoints/last.ckpt of the runs and sweep jobs of the
    same experiment (`name`) and model (`model._target_`) under paths.root_dir's outputs/ and
    multirun/; which one it took is said in one line."""
    if run.ckpt_path != "last":
        path = (base / Path(run.ckpt_path).expanduser()).resolve()
        if not path.exists():
            raise ConfigError("ckpt_path", run.ckpt_path, f"no such checkpoint ({path})")
        return path
    root = (base / Path(run.paths.root_dir).expanduser()).resolve()
    found = [path for folder in ("outputs", "multirun") for path in (root / folder).glob(f"**/{LAST_CHECKPOINT}")]
    ours = [path for path in found if same_experiment(path.parents[1], run)]
    if not ours:
        others = f" (only of other experiments or models: {len(found)})" if found else ""
        raise ConfigError("ckpt_path", "last", f"no run of experiment {run.name!r} with model {run.model._target_} "
                          f"under {root / 'outputs'} or {root / 'multirun'} has {LAST_CHECKPOINT}{others}; "
                          f"give the checkpoint's path")
    newest = max(ours, key=lambda path: saved_at(path))
    print(f"lightfleet: ckpt_path=last: {newest} (step {checkpoint_contents(newest).step})", flush=True)
    return newest


def same_experiment(records: Path, run: DictConfig) -> bool:
    """Whether the run directory `records` ran `run`'s experiment with `run`'s model."""
    config = records / CONFIG_YAML
    if not config.is_file():
        return False
    saved = yaml.safe_load(config.read_text()) or {}
    return saved.get("name") == run.name and (saved.get("model") or {}).get("_target_") == run.model._target_


def saved_at(checkpoint: Path) -> float:
    """When `checkpoint` was last written: a distributed checkpoint's directory by its metadata
    file, which Lightning writes last."""
    from lightning_fabric.strategies.fsdp import _METADATA_FILENAME

    return (checkpoint / _METADATA_FILENAME if checkpoint.is_dir() else checkpoint).stat().st_mtime


RECORD = "lightfleet"  # a checkpoint's key of the record runner/rank/resume.py:GlobalPosition writes


@dataclass(frozen=True)
class CheckpointContents:
    step: int  # the global step it was saved at
    weights: Dict[str, Optional[Tuple[int, ...]]]  # the model's state dict: names and shapes (None: not a tensor)
    record: Optional[Dict[str, Any]] = None  # where it stands: world, global batch, position (None: written before it)


def checkpoint_contents(checkpoint: Path) -> CheckpointContents:
    """What a Lightning checkpoint holds, read without loading its tensors: a file (memory-mapped)
    or a distributed checkpoint's directory (sharding stages 2/3, the pipeline). Read as data only
    (torch's weights-only unpickler): a pickle that would call code is refused, never run."""
    import pickle

    import torch
    from lightning_fabric.strategies.fsdp import _METADATA_FILENAME

    try:
        if checkpoint.is_dir():
            from torch.distributed.checkpoint import FileSystemReader

            meta = torch.load(checkpoint / _METADATA_FILENAME, map_location="cpu", weights_only=True)
            stored = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
            weights = {key.removeprefix("state_dict."): tuple(item.size) if hasattr(item, "size") else None
                       for key, item in stored.items() if key.startswith("state_dict.")}
        else:
            meta = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
            weights = {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None
                       for key, value in meta["state_dict"].items()}
        return CheckpointContents(int(meta["global_step"]), weights, meta.get(RECORD))
    except pickle.UnpicklingError as error:  # torch's weights-only unpickler met something other than data
        needs = re.search(r"GLOBAL ([\w.]+)", str(error))
        raise ConfigError("ckpt_path", str(checkpoint), f"needs more than data to load "
                          f"({needs.group(1) if needs else first_line(error)}): lightfleet loads checkpoints "
                          f"weights-only (torch.load(weights_only=True)), so a checkpoint's pickle never runs "
                          f"code") from None
    except Exception as error:  # noqa: BLE001 (whatever a file that is no checkpoint raises)
        raise Unreadable("ckpt_path", str(checkpoint), f"is not a checkpoint lightfleet can read "
                         f"({error_line(error)})") from None


class Unreadable(ConfigError):
    """A checkpoint that is no checkpoint (truncated, or another kind of file)."""


def verified_contents(checkpoint: Path, evaluate: bool = False) -> Tuple[CheckpointContents, Optional[str]]:
    """`checkpoint_contents` of a checkpoint whose bytes match its manifest (runner/records/checkpoints.py),
    and a note for the plan when it has none (not written by lightfleet: read unverified). A
    damaged, truncated or unreadable one is refused in one line naming the newest intact
    checkpoint beside it and the command that uses it. Temporary files a crash left beside it
    are removed first."""
    remove_leftovers(checkpoint.parent)
    verdict = verify(checkpoint)
    if verdict.problem:
        raise ConfigError("ckpt_path", str(checkpoint), verdict.problem + instead(checkpoint, evaluate))
    try:
        contents = checkpoint_contents(checkpoint)
    except Unreadable as error:
        raise ConfigError("ckpt_path", str(checkpoint), error.allowed + instead(checkpoint, evaluate)) from None
    unverified = verdict.manifest is None
    return contents, (f"{checkpoint} has no manifest ({manifest_path(checkpoint).name}): not written by lightfleet, "
                      f"its bytes are not verified" if unverified else None)


def instead(checkpoint: Path, evaluate: bool) -> str:
    """What to use in place of a refused `checkpoint`: the newest intact one beside it, and the
    command (`lightfleet resume RUN ckpt_path=...`, or eval) when it is a run's."""
    intact = newest_intact(checkpoint.parent, besides=checkpoint)
    if intact is None:
        return "; no intact checkpoint lies beside it"
    run = checkpoint.parent.parent
    override = f"\"ckpt_path='{intact}'\""  # quoted for the shell and for Hydra: Lightning's names hold '='
    command = f"lightfleet {'eval' if evaluate else 'resume'} {run} {override}" if (run / CONFIG_YAML).is_file() \
        else override
    return f"; the newest intact checkpoint of the run is {intact} (step {read_manifest(intact)['step']}): {command}"


def check_weights_fit(checkpoint: Path, contents: CheckpointContents, model: Any) -> None:
    """Refuse a checkpoint (holding `contents`) whose weights do not fit `model` (the user's LightningModule built on
    the meta device), in one line naming the checkpoint and the first keys that differ, instead
    of Lightning's error in every rank. A model that makes its layers in `configure_model` has
    not made them yet: the ranks check that one."""
    from pytorch_lightning.utilities.model_helpers import is_overridden

    if is_overridden("configure_model", model):
        return
    held = contents.weights
    wanted = {key: tuple(value.shape) if hasattr(value, "shape") else None for key, value in model.state_dict().items()}
    differences = {"missing": [key for key in wanted if key not in held],
                   "unexpected": [key for key in held if key not in wanted]}
    if not getattr(model, "strict_loading", True):  # Lightning loads strictly unless the model says otherwise
        differences.clear()
    differences["other shapes"] = [f"{key} {list(held[key])} (model {list(shape)})" for key, shape in wanted.items()
                                   if key in held and None not in (shape, held[key]) and shape != held[key]]
    told = [f"{what}: {listed(keys)}" for what, keys in differences.items() if keys]
    require(not told, "ckpt_path", str(checkpoint),
            f"its weights do not fit the model ({type(model).__name__}): {'; '.join(told)}")


def listed(items: Iterable[str], first: int = 3) -> str:
    """The first few of `items`, and how many more."""
    items = list(items)
    return ", ".join(items[:first]) + (f" (+{len(items) - first} more)" if len(items) > first else "")


def records_subdir(world: World) -> str:
    """Where this copy of the command keeps its records inside the run directory.

    One copy runs per node (multi-node) or per rank (under torchrun/SLURM), all with the same
    output directory, often on a shared filesystem: the first copy writes the run directory
    itself, the others `nodes/<NODE_RANK>/` or `ranks/<RANK>/`, so no two write one file.
    """
    if launched_externally():
        rank = external_rank()
        return f"{RANKS_DIR}/{rank}" if rank else ""
    if world.num_nodes > 1 and int(os.environ["NODE_RANK"]):
        return f"{NODES_DIR}/{os.environ['NODE_RANK']}"
    return ""


def record_failure(records: Path, exit_code: int, error: str, status: str = FAILED) -> str:
    """failure.yaml: how the run ended (`status`, unless it ran out of memory: the cure differs).
    Returns what the run's line adds when even that cannot be written (a full disk), else ""."""
    try:
        write_yaml(records / FAILURE_YAML, {"status": failure_outcome(error, status), "exit_code": exit_code,
                                           "error": error})
    except OSError as problem:
        return f"; {records / FAILURE_YAML} could not be written either ({problem.strerror})"
    return ""


def read_plan(records: Path) -> Plan:
    """The plan the command saved in `records`."""
    return Plan.from_dict(yaml.safe_load((records / PLAN_YAML).read_text()))


def _named_by_clock(cfg: DictConfig, key: str) -> bool:
    """Whether the value at `key` is built from the `now` resolver (as the default directories
    are), following plain `${other.key}` references."""
    raw = str(OmegaConf.to_container(OmegaConf.select(cfg, key.rpartition(".")[0]), resolve=False)[key.rpartition(".")[2]])
    reference = re.fullmatch(r"\$\{([\w.]+)\}", raw)
    return _named_by_clock(cfg, reference.group(1)) if reference else "${now:" in raw


def fresh_dir(path: Path) -> Path:
    """Create and return `path`, or `path-1`, `path-2`, ... if taken: runs started within the same
    second (parallel launches, scripts) each get their own directory. mkdir is atomic, so two
    processes never get the same one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate, taken = path, 0
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            taken += 1
            candidate = path.with_name(f"{path.name}-{taken}")


def environment(command: Sequence[str]) -> Dict[str, Any]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "command": ["lightfleet", *command],
        "python": platform.python_version(),
        "versions": {dist: version(dist) for dist in
                     ("lightfleet", "torch", "pytorch-lightning", "hydra-core", "omegaconf")},
        "git_commit": git_commit(),
        "host": platform.node(),
        "executable": sys.executable,
    }


def git_commit() -> str:
    if CHECKOUT is None:  # installed: versions.lightfleet names the code; a repository around it is not its
        return "unknown"
    try:
        out = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(CHECKOUT), "status", "--porcelain"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def write_yaml(path: Path, data: Any) -> None:
    """Write atomically: a reader never sees half a file, a crash leaves the old one, and a failed
    write (a full disk) leaves no temporary file."""
    write_atomically(path, yaml.safe_dump(data, sort_keys=False).encode())
