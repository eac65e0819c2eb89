"""recompute: activation recomputation (Fleet `strategy.recompute`); carried out by plugins/recompute.py."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, List, Optional

from runner.core.contribution import Component, Contribution, Facts, Memory, RunShape, Strategy


@dataclass
class RecomputeConfig(Strategy):
    """Activation recomputation (Fleet: `strategy.recompute`, `strategy.recompute_configs`)."""

    name: ClassVar[str] = "recompute"

    checkpoints: List[str] = field(default_factory=list)
    """Modules whose activations are recomputed in backward: qualified module names, globs
    (`blocks.*`) or class names. Empty = each block of the model's first repeated block list."""
    enable_offload: bool = False
    """Keep the tensors saved at each checkpoint in host memory (torch `save_on_cpu`)."""
    checkpoint_shape: List[int] = field(default_factory=list)
    """Accepted for Fleet compatibility; PyTorch checkpointing needs no static shapes."""

    def applies(self, facts: Facts) -> Optional[str]:
        return None if facts.blocks >= 2 else "the model has no repeated block list to recompute"

    def memory(self, memory: Memory, facts: Facts) -> Memory:
        """The blocks keep their inputs; backward rebuilds one block at a time (Memory.held_activations)."""
        return replace(memory, recompute=True)

    def speed(self, facts: Facts) -> float:
        return 0.75  # one more forward per step: about 4/3 of the compute

    def fast_path_conflict(self, mechanism: str, run: RunShape) -> Optional[str]:
        if mechanism == "compile" and self.enable_offload:
            return ("with enable_offload=true keeps the blocks' inputs on the host through save_on_cpu hooks, which "
                    "torch.compile does not trace (the blocks would run uncompiled); compile without the offload")
        return None

    def contribute(self, run: RunShape) -> Contribution:
        contribution = Contribution()
        contribution.model_transforms.append(
            ("recompute", Component("plugins.recompute:apply_recompute",
                                    {"checkpoints": list(self.checkpoints), "enable_offload": self.enable_offload})))
        if not self.checkpoints:
            contribution.notes.append(
                "recompute.checkpoints=[]: every block of the model's first repeated block list "
                "(ModuleList/Sequential of same-class modules); the run's build.yaml lists them")
        if self.checkpoint_shape:
            contribution.notes.append(
                "recompute.checkpoint_shape has no effect: PyTorch recomputes with the shapes seen in forward")
        return contribution
