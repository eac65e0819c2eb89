"""Model transforms: the plan's changes to the model's module tree, applied in phase order in
the model's `configure_model` hook, which Lightning calls once the process group exists and
before the strategy wraps the model (DDP) or sets up optimizers.

A transform is `f(module, context, **knobs) -> names of the modules it changed`. It is called
once per part of the model: the whole model, or, once the pipeline split has run, each of this
rank's stages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from plugins.rehearsal import to_device

Transform = Tuple[Callable[..., List[str]], Dict[str, Any]]  # (function, its knobs)


@dataclass
class ModelContext:
    """What a transform sees besides its knobs."""

    model: nn.Module  # the whole model: the module names users write in knobs refer to it
    strategy: Any = None  # the Lightning strategy, its process group set up (None: a plain module)
    parts: List[nn.Module] = field(default_factory=list)  # what later transforms change

    def __post_init__(self) -> None:
        self.parts = self.parts or [self.model]

    @property
    def device_type(self) -> str:
        return self.strategy.root_device.type if self.strategy is not None else "cpu"


def apply_transforms(context: ModelContext, transforms: Sequence[Transform]) -> List[List[str]]:
    """Apply `transforms` in order to every part of `context`; the names each changed."""
    changed = []
    for function, knobs in transforms:
        changed.append([name for part in list(context.parts) for name in function(part, context, **knobs)])
    return changed


def transform_in_configure_model(model: nn.Module, transforms: Sequence[Transform],
                                 applied: Optional[Callable[[List[List[str]]], None]] = None) -> None:
    """Make `model.configure_model` (after the model's own) move the model to the strategy's
    device and apply `transforms` there, once; `applied` then gets the names each changed."""
    own = model.configure_model
    done: List[bool] = []

    def configure_model() -> None:
        own()
        if done:  # Lightning calls it again for every trainer entry point
            return
        strategy = model.trainer.strategy
        # Transforms see the model where it trains: the pipeline traces it there, FSDP shards it from there.
        to_device(model, strategy.root_device)
        changed = apply_transforms(ModelContext(model, strategy), transforms)
        done.append(True)
        if applied is not None:
            applied(changed)

    model.configure_model = configure_model
