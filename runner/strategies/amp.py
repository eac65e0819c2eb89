"""amp: automatic mixed precision (Fleet `strategy.amp`, `amp_configs`); carried out by plugins/amp.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Dict, List, Optional

from runner.core.contribution import Component, Contribution, Facts, Memory, RunShape, Strategy
from runner.core.errors import require

DTYPES = ("float16", "bfloat16")


@dataclass
class AmpConfig(Strategy):
    """Automatic mixed precision (Fleet: `strategy.amp`, `strategy.amp_configs`)."""

    name: ClassVar[str] = "amp"

    dtype: str = "float16"
    """Low-precision type: float16 (with loss scaling) or bfloat16 (no loss scaling needed)."""
    init_loss_scaling: float = 32768.0
    """Initial loss scale (float16 only)."""
    use_dynamic_loss_scaling: bool = True
    """Adapt the scale to overflows (true) or keep init_loss_scaling fixed (false)."""
    incr_every_n_steps: int = 1000
    """Grow the scale after this many consecutive steps without overflow."""
    decr_every_n_nan_or_inf: int = 2
    """Shrink the scale after this many consecutive overflow steps (each one is skipped)."""
    incr_ratio: float = 2.0
    """Factor by which the scale grows (> 1)."""
    decr_ratio: float = 0.5
    """Factor by which the scale shrinks (0 < decr_ratio < 1)."""
    custom_white_list: List[str] = field(default_factory=list)
    """Module class names or module names (globs allowed) forced to run in `dtype`."""
    custom_black_list: List[str] = field(default_factory=list)
    """Module class names or module names (globs allowed) kept in float32."""

    def __post_init__(self) -> None:
        key = "strategy.amp."
        require(self.dtype in DTYPES, key + "dtype", self.dtype, f"allowed: {', '.join(DTYPES)}", DTYPES)
        require(self.init_loss_scaling > 0, key + "init_loss_scaling", self.init_loss_scaling, "must be > 0")
        require(self.incr_every_n_steps >= 1, key + "incr_every_n_steps", self.incr_every_n_steps, "must be >= 1")
        require(self.decr_every_n_nan_or_inf >= 1, key + "decr_every_n_nan_or_inf",
                self.decr_every_n_nan_or_inf, "must be >= 1")
        require(self.incr_ratio > 1, key + "incr_ratio", self.incr_ratio, "must be > 1")
        require(0 < self.decr_ratio < 1, key + "decr_ratio", self.decr_ratio, "must be in (0, 1)")
        both = set(self.custom_white_list) & set(self.custom_black_list)
        require(not both, key + "custom_white_list", sorted(both), "names also in custom_black_list")

    def memory(self, memory: Memory, facts: Facts) -> Memory:
        """The forward under autocast (activations as it saves them: 16-bit matrix products and what
        follows them, the weights' 16-bit copies, float32 where autocast keeps it); parameters,
        gradients and optimizer states stay float32."""
        return replace(memory, autocast=True, compute_bytes=2.0)

    def speed(self, facts: Facts) -> float:
        # Tensor cores run 16-bit matrix products several times faster; CPUs emulate them slowly.
        return 1.8 if facts.device == "cuda" else 0.5

    def variants(self, facts: Facts) -> List[Dict[str, Any]]:
        return [{"dtype": "bfloat16" if facts.bf16 else "float16"}]

    def fast_path_conflict(self, mechanism: str, run: RunShape) -> Optional[str]:
        clip = getattr(run.trainer, "gradient_clip_val", None)
        if mechanism == "fused_optimizer" and self.dtype == "float16" and clip:
            return (f"with dtype=float16 lets a fused step unscale the gradients itself, so Lightning cannot clip "
                    f"them before it (trainer.gradient_clip_val={clip}): use dtype=bfloat16 or no clipping")
        return None

    def contribute(self, run: RunShape) -> Contribution:
        knobs = asdict(self)
        lists = {k: knobs.pop(k) for k in ("custom_white_list", "custom_black_list")}
        contribution = Contribution(precision=Component("plugins.amp:build_precision", knobs))
        if lists["custom_white_list"] or lists["custom_black_list"]:
            contribution.model_transforms.append(
                ("precision", Component("plugins.amp:apply_precision_lists", {"dtype": self.dtype, **lists})))
        if self.dtype == "bfloat16":
            contribution.notes.append("dtype=bfloat16: loss scaling knobs have no effect (bfloat16 needs none)")
        elif run.device_type == "cpu":  # a newcomer's ResNet-18 did not finish 2 steps in 300 s
            contribution.notes.append("amp with dtype=float16 on a CPU: most CPUs have no float16 arithmetic and run it "
                                      "about 10x slower than float32; strategy.amp.dtype=bfloat16 is fast on CPUs "
                                      "with bfloat16 units (AVX512-BF16, AMX), and leaving amp out is elsewhere")
        return contribution
