"""The arguments of `_target_` nodes (the model, the data, callbacks, loggers, and the nodes nested
in them) against their constructors: names, required ones, and values against the type
annotations, so that a typo or a wrong type is one line naming the key, not a TypeError inside
the user's code. `check_builds` then builds the model (on the meta device: no memory, no time)
and the data module once in the command, so that what the constructors themselves refuse
(a batch size of 0) stops the command before any rank starts.
"""
from __future__ import annotations

import collections.abc
import contextlib
import importlib
import inspect
import os
import re
import traceback
import types
import typing
import warnings
from typing import Any, Callable, Dict, List, Tuple

from runner.core.errors import ConfigError, error_line, first_line

# Keys of a `_target_` node that Hydra's instantiate reads itself.
HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


def target_of(key: str, node: Any) -> Callable[..., Any]:
    """The class or function a node's `_target_` names."""
    target = node.get("_target_")
    if not target:
        raise ConfigError(f"{key}._target_", target, "is required: the import path of the class to build")
    module, _, attr = str(target).rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"{key}._target_", target, f"cannot be imported ({error})") from None


def check_arguments(key: str, node: Any) -> None:
    """Check the `_target_` node at `key` (a plain mapping, interpolations resolved) and every
    `_target_` node nested in it."""
    factory = target_of(key, node)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    parameters = signature.parameters
    hints = annotations(factory)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    check_given(key, node)
    for name, value in node.items():
        if name in HYDRA_KEYS:
            continue
        if name not in parameters and not takes_any:
            raise ConfigError.unknown_key(f"{key}.{name}", [p for p in parameters if p not in ("self", "args", "kwargs")])
        hint = hints.get(name, typing.Any)
        if not fits(value, hint):
            raise ConfigError(f"{key}.{name}", value, f"{factory.__name__} takes {describe(hint)}")
    if "_args_" not in node and not node.get("_partial_", False):
        for name, parameter in parameters.items():
            required = parameter.default is inspect.Parameter.empty and parameter.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            if required and name not in node:
                raise ConfigError(f"{key}.{name}", None, f"is required by {factory.__name__} (no default)")
    for name, value in node.items():
        for inner_key, inner in nested_targets(f"{key}.{name}", value):
            check_arguments(inner_key, inner)


def check_given(key: str, node: Dict[str, Any]) -> None:
    """No value of the node is OmegaConf's mandatory `???`: a conf that ships without it (data=tokens'
    files) names what to set."""
    for name, value in node.items():
        if value == "???":
            raise ConfigError(f"{key}.{name}", None, f"is required: set {key}.{name}=... on the command line "
                                                     f"or in an experiment")


def nested_targets(key: str, value: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """The `_target_` nodes inside a value, with their keys."""
    if isinstance(value, dict):
        if "_target_" in value:
            return [(key, value)]
        return [found for name, item in value.items() for found in nested_targets(f"{key}.{name}", item)]
    if isinstance(value, list):
        return [found for i, item in enumerate(value) for found in nested_targets(f"{key}[{i}]", item)]
    return []


def annotations(factory: Callable[..., Any]) -> Dict[str, Any]:
    """The constructor's resolved type annotations; none where they cannot be resolved (a name
    only a TYPE_CHECKING block imports): unchecked, not refused."""
    function = factory.__init__ if inspect.isclass(factory) else factory
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 (any failure to evaluate the user's annotations)
        return {}


def fits(value: Any, hint: Any) -> bool:
    """Whether a config value (None, bool, int, float, str, list, dict) can be the annotated type."""
    if hint is typing.Any or isinstance(hint, typing.TypeVar):
        return True
    if isinstance(value, dict) and "_target_" in value:
        return True  # built by instantiate; its own arguments are checked where it is nested
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, arm) for arm in args)
    if origin is typing.Literal:
        return value in args
    if value is None:
        return hint is type(None)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    container = origin or hint
    if container in (list, tuple, collections.abc.Sequence, collections.abc.Iterable, set, frozenset):
        if not isinstance(value, list):
            return container in (collections.abc.Sequence, collections.abc.Iterable) and isinstance(value, str)
        if container is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(fits(item, arm) for item, arm in zip(value, args))
        return not args or all(fits(item, args[0]) for item in value)
    if container in (dict, collections.abc.Mapping):
        return isinstance(value, dict)
    return True  # a class of the user's: whatever YAML gives may be what it takes


def describe(hint: Any) -> str:
    """An annotation as the user wrote it: int, Optional[float], List[int]."""
    if inspect.isclass(hint) and typing.get_origin(hint) is None:
        return hint.__name__
    return str(hint).replace("typing.", "")


def check_logger_package(key: str, node: Dict[str, Any]) -> None:
    """A Lightning logger whose package is missing (wandb, mlflow, comet, tensorboard) is refused
    here, not in every rank. Its module notes each requirement it lacks (a falsy RequirementCache);
    only then is it built, which fails at its first line, before any side effect."""
    from hydra.utils import instantiate
    from lightning_utilities.core.imports import RequirementCache

    module = inspect.getmodule(target_of(key, node))
    if not any(isinstance(value, RequirementCache) and not value for value in vars(module).values()):
        return
    try:
        instantiate(node)
    except Exception as error:  # noqa: BLE001 (instantiate wraps the constructor's exception)
        cause = error.__cause__ or error
        if isinstance(cause, ImportError):
            raise ConfigError(key, None, f"its package is not installed: {first_line(cause)}") from None


def lightning_kind(key: str) -> type:
    """What the `model` and `data` nodes must build."""
    import pytorch_lightning as pl

    return {"model": pl.LightningModule, "data": pl.LightningDataModule}[key]


def check_kind(key: str, node: Dict[str, Any]) -> None:
    """The `model` or `data` node's `_target_`, when a class, is a LightningModule or LightningDataModule."""
    factory, kind = target_of(key, node), lightning_kind(key)
    if inspect.isclass(factory) and not issubclass(factory, kind):
        raise ConfigError(f"{key}._target_", node["_target_"], f"is not a {kind.__name__} (pytorch_lightning.{kind.__name__})")


def check_builds(model: Dict[str, Any], data: Dict[str, Any]) -> Tuple[Any, Any]:
    """Build the model (on the meta device: parameters without storage) and the data module once,
    so that the constructors' own refusals stop the command: one line naming the node; and each
    must be what Lightning trains: a LightningModule and a LightningDataModule. Returns the
    meta-device model and the data module (None for one whose constructor needs real tensors)."""
    import torch
    from hydra.utils import instantiate

    built: Dict[str, Any] = {"model": None, "data": None}
    for key, node in (("model", model), ("data", data)):
        kind = lightning_kind(key)
        try:
            with torch.device("meta") if key == "model" else contextlib.nullcontext():
                made = instantiate(node, _convert_="all")
        except Exception as error:  # noqa: BLE001 (whatever the user's constructor raises)
            cause = error.__cause__ or error  # instantiate wraps the constructor's exception
            if key == "model" and "meta" in str(cause):  # a constructor that needs real tensors: built in the ranks
                continue
            reason = first_line(cause)
            named = re.match(r"(\w+)=\S+: (.*)", reason)  # "batch_size=0: must be >= 1" names an argument
            if named and named.group(1) in node:
                raise ConfigError(f"{key}.{named.group(1)}", node[named.group(1)], named.group(2)) from None
            raise ConfigError(key, None, f"{node['_target_']} refused its arguments: {reason}") from None
        if not isinstance(made, kind):  # a factory function's product
            raise ConfigError(f"{key}._target_", node["_target_"], f"made a {type(made).__name__}, not a {kind.__name__}")
        built[key] = made
    return built["model"], built["data"]


SIZES = {"num_classes": "classes", "vocab_size": "token ids"}  # what data may hold more of than a model takes


def check_sizes(model: Any, datamodule: Any, model_node: Dict[str, Any], data_node: Dict[str, Any]) -> None:
    """Classes and vocabularies: data with more classes (an ImageFolder's class folders) or a larger
    vocabulary (a tokenizer's) than the model's head or embedding would fail on the first batch that
    holds one, or read past the embedding on a GPU; the command refuses it."""
    for name, what in SIZES.items():
        needed = getattr(datamodule, name, None)
        taken = getattr(model, name, None) or getattr(model, "hparams", {}).get(name)
        if isinstance(needed, int) and isinstance(taken, int) and needed > taken:
            raise ConfigError(f"model.{name}", taken, f"fewer than the {needed} {what} of the data "
                              f"({data_node['_target_']}); set model.{name}={needed} or more")


def check_one_batch(model: Any, datamodule: Any, model_node: Dict[str, Any], data_node: Dict[str, Any]) -> None:
    """The meta-device model's training_step on one batch of the data, moved to the meta device (no
    memory, no arithmetic), so that a model and data that do not fit together (token ids for a
    model of images, float features for an embedding) stop the command. Only torch's own refusal of
    the batch counts: whatever needs more than the meta device (a loaded file, a trainer, a value)
    is left to the ranks."""
    import torch
    from torch.utils._pytree import tree_map

    try:
        with warnings.catch_warnings():  # Lightning's "self.log without a trainer", data loaders' notes
            warnings.simplefilter("ignore")
            datamodule.setup("fit")
            batch = next(iter(datamodule.train_dataloader()))
            batch = tree_map(lambda item: item.to("meta") if isinstance(item, torch.Tensor) else item, batch)
            model.training_step(batch, 0)
    except Exception as error:  # noqa: BLE001 (whatever the user's code raises)
        innermost = traceback.extract_tb(error.__traceback__)[-1].filename
        if f"{os.sep}torch{os.sep}" in innermost and "meta" not in str(error):
            raise ConfigError("model", None, f"{model_node['_target_']} cannot train on {data_node['_target_']}'s "
                              f"batches: {error_line(error)} (choose a model and data that go together)") from None
