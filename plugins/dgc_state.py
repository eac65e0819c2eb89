"""What the DGC communication hook keeps between steps: the momentum u and residual v of every
parameter, laid out per DDP bucket like its gradient buffer, and the step count.

DDP regroups parameters into new buckets after the first iteration, and a restart may lay them
out differently again, so the state is kept (and checkpointed) per parameter name and reassembled
whenever a bucket's layout is new. Details: docs/strategies.md#dgc
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from pytorch_lightning.utilities import rank_zero_warn

from plugins.dgc_compression import sparsity_at
from runner.core.errors import ConfigError

OPTIMIZER_KEY = "model.optimizer"


class _BucketState:
    """Flat momentum and residual for one DDP bucket, laid out like its gradient buffer."""

    def __init__(self, params: List[torch.Tensor], names: List[str], u: torch.Tensor, v: torch.Tensor,
                 weight_decay: Optional[torch.Tensor | float]) -> None:
        self.params = params
        self.names = names
        self.sizes = [p.numel() for p in params]
        self.u = u  # momentum
        self.v = v  # accumulated gradient not sent yet (the residual)
        self.weight_decay = weight_decay  # None, one float, or a per-entry tensor

    def same_layout(self, params: Sequence[torch.Tensor]) -> bool:
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def pieces(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        return dict(zip(self.names, zip(self.u.split(self.sizes), self.v.split(self.sizes))))


class DGCState:
    """Everything the hook keeps between steps; `trainer.strategy.comm_hook_state` in a run.

    `replace_optimizer` calls `configure` (momentum, parameter names, per-parameter weight decay)
    before the first backward; used with plain DDP, call it yourself.
    """

    def __init__(self, rampup_begin_step: int, rampup_step: int, sparsity: Sequence[float],
                 process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.rampup_begin_step = rampup_begin_step
        self.rampup_step = rampup_step
        self.sparsity = [float(s) for s in sparsity]
        self.process_group = process_group
        self.momentum: Optional[float] = None
        self.names: Dict[int, str] = {}  # id(parameter) -> name
        self.weight_decay: Dict[int, float] = {}  # id(parameter) -> weight decay
        self.step = 0  # optimizer steps communicated so far
        self.buckets: Dict[int, _BucketState] = {}  # by bucket index
        # Per-parameter (momentum, residual) not placed in a bucket yet: loaded from a checkpoint,
        # or left by buckets that DDP rebuilt.
        self.loose: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group the hook communicates over (the default one unless given)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def sparsity_at(self, step: int) -> Optional[float]:
        return sparsity_at(step, self.rampup_begin_step, self.rampup_step, self.sparsity)

    def configure(self, momentum: float, named_parameters: Sequence[Tuple[str, torch.Tensor]] = (),
                  weight_decay: Optional[Dict[int, float]] = None) -> None:
        """The momentum, parameter names (keys of `state_dict()`) and weight decay by id(parameter)."""
        if self.momentum is not None and momentum != self.momentum:
            raise ConfigError(OPTIMIZER_KEY, f"SGD(momentum={momentum})",
                              f"dgc keeps one momentum; another optimizer already uses {self.momentum}")
        self.momentum = float(momentum)
        self.names.update({id(p): name for name, p in named_parameters})
        self.weight_decay.update(weight_decay or {})

    # ------------------------------------------------------------------ bucket layout

    def bucket_state(self, bucket: dist.GradBucket) -> _BucketState:
        """The bucket's state, (re)assembled from per-parameter pieces when its layout is new."""
        params = bucket.parameters()
        state = self.buckets.get(bucket.index())
        if state is not None and state.same_layout(params):
            return state
        # Parameters are named by replace_optimizer (the LightningModule's names, which checkpoints
        # use); a model it has not seen (plain DDP) gets names by first appearance.
        names = [self.names.setdefault(id(p), f"<parameter {len(self.names)}>") for p in params]
        held = {name for old in self.buckets.values() for name in old.names}
        if state is not None or not held.isdisjoint(names):
            # DDP rebuilt its buckets (after the first iteration): regroup all state by parameter.
            for old in self.buckets.values():
                self.loose.update(old.pieces())
            self.buckets.clear()
        buffer = bucket.buffer()
        sizes = [p.numel() for p in params]
        if sum(sizes) != buffer.numel():
            raise RuntimeError(f"dgc: bucket {bucket.index()} holds {buffer.numel()} gradient entries but its "
                               f"parameters {sum(sizes)}")
        dtype = torch.promote_types(buffer.dtype, torch.float32)  # keep the residual in >= float32

        def piece(name: str, size: int, which: int) -> torch.Tensor:
            loaded = self.loose.get(name)
            if loaded is None:
                return torch.zeros(size, dtype=dtype, device=buffer.device)
            return loaded[which].reshape(-1).to(device=buffer.device, dtype=dtype)

        u = torch.cat([piece(n, s, 0) for n, s in zip(names, sizes)])
        v = torch.cat([piece(n, s, 1) for n, s in zip(names, sizes)])
        for name in names:
            self.loose.pop(name, None)
        decays = [self.weight_decay.get(id(p), 0.0) for p in params]
        if not any(decays):
            weight_decay = None
        elif len(set(decays)) == 1:
            weight_decay = decays[0]
        else:
            weight_decay = torch.tensor(decays, dtype=dtype, device=buffer.device).repeat_interleave(
                torch.tensor(sizes, device=buffer.device))
        state = _BucketState(list(params), names, u, v, weight_decay)
        self.buckets[bucket.index()] = state
        return state

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> Dict[str, Any]:
        """This rank's step, momentum and residual, per parameter name (CPU copies)."""
        pieces = dict(self.loose)
        for state in self.buckets.values():
            pieces.update(state.pieces())
        buffers = {name: {"momentum": u.detach().cpu().clone(), "residual": v.detach().cpu().clone()}
                   for name, (u, v) in pieces.items()}
        return {"step": self.step, "buffers": buffers}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.buckets.clear()
        self.loose = {name: (entry["momentum"], entry["residual"]) for name, entry in state_dict["buffers"].items()}
        unknown = sorted(set(self.loose) - set(self.names.values())) if self.names else []
        if unknown:
            rank_zero_warn(f"dgc: checkpoint holds state for parameters the model does not have: {unknown[:5]}")
