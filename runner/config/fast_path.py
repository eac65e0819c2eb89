"""The fast path (`fast_path.*`): torch.compile of the model, torch's fused optimizers and the
kernel of F.scaled_dot_product_attention, what takes a model on a GPU from eager speed towards
the field's (GPT-2 124M on an H200: 17% model FLOPs utilisation eager with a per-tensor
optimizer; llm.c, with compiled kernels and a fused AdamW, 41%). Their schema, each knob
documented by the string under it (docs/knobs.md), and what they add to the plan (`<- fast_path`),
made after the strategies' like the collective knobs'. Whether a mechanism serves a run with a
strategy, the strategy says (`Strategy.fast_path_conflict`); plugins/fast_path.py carries them
out. Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

from runner.core.contribution import Component, Contribution, RunShape
from runner.core.errors import ConfigError, require

KEY = "fast_path."
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ATTENTION_KERNELS = ("auto", "flash", "efficient", "cudnn", "math")
CUDA_ONLY_KERNELS = ("efficient", "cudnn")  # torch has them on CUDA only
HALF_ONLY_KERNELS = ("flash", "cudnn")  # on CUDA they take float16 and bfloat16 inputs only
# What a strategy may refuse (Strategy.fast_path_conflict). The attention kernel is set for the
# whole process, so every strategy's forward, recomputation and pipeline stage runs it.
FAST_PATH = ("compile", "fused_optimizer")


@dataclass
class FastPathConfig:
    """The mechanisms the field's fast training runs use: a compiled model, a fused optimizer step
    and the attention kernel (docs/guide.md#the-fast-path). Each is a claim in the plan
    (`<- fast_path`); a strategy they cannot serve is refused with the reason."""

    compile: bool = False
    """Compile the model with torch.compile (inductor fuses elementwise ops, norms and matmul
    epilogues into generated kernels), as the plan's last model transform. Off by default:
    compiling costs a minute or more at the start of every run (more with max-autotune) and again
    whenever new input shapes come (a shorter last batch, validation), which short runs, tests and
    sweeps do not win back; experiments that train for hours turn it on (experiments/gpt2_124m.yaml).
    Fleet's op-fusion flags (collective.build_strategy) ask for the same compile."""
    compile_mode: str = "default"
    """torch.compile's mode, for the compile whoever asks for it: default; reduce-overhead (CUDA
    graphs: less launch overhead for small batches, more memory); max-autotune (also tries matmul
    kernels; compiles much longer); max-autotune-no-cudagraphs."""
    fused_optimizer: Any = "auto"
    """torch's fused step (one kernel over all parameters: Adam, AdamW, SGD, Adagrad) for the
    optimizer the model's configure_optimizers returns. auto: fused on CUDA, as built elsewhere;
    true: fused wherever torch has the kernel for the parameters' device (CPU too); false: as built.
    Optimizers without a fused kernel (LARS, LAMB, RMSprop, ...), and SGD and Adagrad over sharded
    DTensor parameters (sharding stages 2 and 3, tensor parallelism), take their foreach kernels or
    stay as built, said in one log line."""
    attention: str = "auto"
    """The kernel of F.scaled_dot_product_attention (the built-in gpt and causal_lm call it) for
    the whole run: auto (torch chooses: FlashAttention on CUDA for 16-bit inputs, its flash kernel
    on CPU); flash, efficient (memory-efficient attention), cudnn or math (the unfused reference)
    allow that one kernel only (torch's sdpa_kernel). efficient and cudnn run on CUDA only; on
    CUDA, flash and cudnn need 16-bit inputs (strategy amp)."""

    def __post_init__(self) -> None:
        require(self.compile_mode in COMPILE_MODES, KEY + "compile_mode", self.compile_mode,
                f"allowed: {', '.join(COMPILE_MODES)}", COMPILE_MODES)
        # Not `in ("auto", True, False)`: 1 == True would pass it.
        require(isinstance(self.fused_optimizer, bool) or self.fused_optimizer == "auto", KEY + "fused_optimizer",
                self.fused_optimizer, "allowed: auto, true, false")
        require(self.attention in ATTENTION_KERNELS, KEY + "attention", self.attention,
                f"allowed: {', '.join(ATTENTION_KERNELS)}", ATTENTION_KERNELS)

    def contribute(self, run: RunShape) -> Contribution:
        """The knobs' part of the plan: the compile (which the collective fusion flags may ask for
        too: one claim), the fused optimizer transform, the attention kernel's callback."""
        contribution = Contribution()
        if self.compile:
            contribution.model_transforms.append(compile_transform(run, self.compile_mode, KEY + "compile"))
        self._fused_optimizer(run, contribution)
        if self.attention != "auto":
            self._check_attention(run)
            contribution.callbacks.append(Component("plugins.fast_path:AttentionKernel", {"kernel": self.attention}))
        return contribution

    def _fused_optimizer(self, run: RunShape, contribution: Contribution) -> None:
        if self.fused_optimizer is False or (self.fused_optimizer == "auto" and run.device_type != "cuda"):
            return
        refused = conflicts(run, "fused_optimizer")
        if refused and self.fused_optimizer is True:
            raise ConfigError(KEY + "fused_optimizer", True, f"{'; '.join(refused)}; auto or false leave it as built")
        if refused:
            contribution.notes.append(f"fast_path.fused_optimizer=auto: the optimizer stays as built: "
                                      f"{'; '.join(refused)}")
        else:
            contribution.optimizer_transforms.append(Component("plugins.fast_path:fuse_optimizer"))

    def _check_attention(self, run: RunShape) -> None:
        device = run.device_type
        require(device == "cuda" or self.attention not in CUDA_ONLY_KERNELS, KEY + "attention", self.attention,
                f"torch has this kernel on CUDA only; on {device}: flash (torch's CPU kernel), math or auto")
        require(device != "cuda" or run.precision is not None or self.attention not in HALF_ONLY_KERNELS,
                KEY + "attention", self.attention, "on CUDA this kernel takes float16 or bfloat16 inputs, and the "
                                                   "run computes in float32: add strategy amp, or choose efficient, "
                                                   "math or auto")


def conflicts(run: RunShape, mechanism: str) -> List[str]:
    """Why the run's strategies refuse `mechanism` (of FAST_PATH): "strategy NAME WHY" each."""
    return [f"strategy {name} {why}" for name, knobs in run.selected.items()
            if (why := knobs.fast_path_conflict(mechanism, run))]


def compile_transform(run: RunShape, mode: str, key: str) -> Tuple[str, Component]:
    """The plan's compile, the same whoever asks (`key`: fast_path.compile, or a fusion flag of
    collective.build_strategy), so that the plan holds it once; refused beside a strategy it
    cannot serve."""
    refused = conflicts(run, "compile")
    require(not refused, key, True, "; ".join(refused))
    return "compile", Component("plugins.fast_path:compile_model", {"mode": mode})
