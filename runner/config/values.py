"""The built-in models' and data's arguments that their value alone can rule out (runner.models.*,
runner.data.*): counts and sizes, and the files and folders they read. One declaration per
argument name, meaning the same in every built-in constructor that takes it. The command checks
the `model` and `data` nodes against it with the schema, before it imports torch or builds
anything (runner/command/preflight.py), and the constructors check their arguments with it
(`check_values`), so that a module built in Python refuses alike. A value of another type (None
for an optional argument, `auto`) is the constructor's annotations' to judge
(runner/config/arguments.py).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple, Union

from runner.core.errors import ConfigError

BUILT_IN = ("runner.models.", "runner.data.")


@dataclass(frozen=True)
class AtLeast:
    """A count or a size: a number >= lowest (of a list, each item)."""

    lowest: int

    def refusal(self, value: Any) -> Optional[str]:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return f"must be >= {self.lowest}" if number and value < self.lowest else None


@dataclass(frozen=True)
class Existing:
    """A path that must exist as `kind` (a file, a folder, or a file or directory) and open as
    one (`~` expanded, relative to where lightfleet runs)."""

    kind: str
    holding: str  # what it holds, said in the refusal

    def refusal(self, value: Any) -> Optional[str]:
        if not isinstance(value, str):
            return None
        path = Path(value).expanduser()
        try:
            folder = stat.S_ISDIR(path.stat().st_mode)
            if self.kind != "file or directory" and folder != (self.kind == "folder"):
                return f"is a {'folder' if folder else 'file'}, not a {self.kind} ({self.holding})"
            # Opened as the loader will: os.access says yes to root, whom a file system may still refuse.
            os.listdir(path) if folder else os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        except (FileNotFoundError, NotADirectoryError):
            return f"no such {self.kind} ({self.holding})"
        except OSError as error:
            return f"cannot be read: {error.strerror} ({self.holding})"
        return None


Rule = Union[AtLeast, Existing]
TOKEN_FILE = Existing("file", "a flat file of uint16 token ids (uint32 with dtype=uint32), as `lightfleet "
                              "prepare-data` writes")
RULES: Dict[str, Rule] = {
    **dict.fromkeys(("batch_size", "seq_len", "num_train", "num_val", "num_test", "num_classes", "vocab_size",
                     "image_size", "prefetch_factor", "samples_per_epoch", "input_shape", "input_dim", "hidden_dim",
                     "in_channels", "widths", "blocks_per_stage", "d_model", "n_heads", "n_layers"), AtLeast(1)),
    **dict.fromkeys(("num_workers", "num_blocks", "warmup_steps"), AtLeast(0)),
    "root": Existing("folder", "train/ and val/ folders of class folders under it"),
    **dict.fromkeys(("train_bin", "val_bin", "test_bin"), TOKEN_FILE),
    "path": Existing("file or directory", "text, parquet or jsonl files, a directory of them, or a directory a "
                                          "Hugging Face dataset was saved to"),
    "tokenizer": Existing("file or directory", "a tokenizer.json of the tokenizers library, or a directory "
                                               "AutoTokenizer loads; nothing is downloaded"),
    "weights_path": Existing("file", "a state dict saved with torch.save"),
}


def refusals(name: str, value: Any) -> Iterator[Tuple[str, Any, str]]:
    """(argument, value, why) for what the rule of argument `name` refuses in `value`: the value
    itself, or each item of a list (`input_shape[1]`)."""
    rule = RULES.get(name)
    if rule is None:
        return
    items = [(f"{name}[{i}]", item) for i, item in enumerate(value)] if isinstance(value, (list, tuple)) else [
        (name, value)]
    for argument, item in items:
        why = rule.refusal(item)
        if why:
            yield argument, item, why


def check_values(**arguments: Any) -> None:
    """For the constructors: ValueError("name=value: why") for the first argument its rule refuses
    (the command names the config key: runner.config.arguments.check_builds)."""
    for name, value in arguments.items():
        for argument, item, why in refusals(name, value):
            raise ValueError(f"{argument}={item}: {why}")


def check_node(key: str, node: Dict[str, Any]) -> None:
    """The command's check of the `model` or `data` node (plain data, interpolations resolved): a
    ConfigError naming `key.argument` for the first value a rule refuses. The user's own classes are
    theirs to check."""
    if not str(node.get("_target_", "")).startswith(BUILT_IN):
        return
    for name, value in node.items():
        for argument, item, why in refusals(name, value):
            raise ConfigError(f"{key}.{argument}", item, why)
