"""Real 2-process training runs for the communication-strategy tests (gloo on CPU, no mocks).

Test side: `run_two_ranks(script, tmp_path)` writes `script` into tmp_path and runs it in 2 (or `nproc`)
ranks as `torchrun --standalone` would, the ranks forked with torch and Lightning imported
(tests/helpers/two_ranks.py), with the project's root importable, so the script can `from tests.helpers.distributed import ...` the rank side: `fit` (the real Lightning trainer
with `plugins.ddp.build_ddp`), `AllReduceSpy` (counts what reaches `torch.distributed.all_reduce`),
`AllGatherSpy` (keeps what each rank hands to `torch.distributed.all_gather`) and `Record`
(per-step parameters, losses, learning rates and collectives of one rank).
Results come back as one torch.save file per rank: `load_ranks(tmp_path)`.
"""
from __future__ import annotations

import functools
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, List, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from plugins.ddp import build_ddp
from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier
from tests.helpers import command_server

WORLD_SIZE = 2


# --------------------------------------------------------------------------- test side


def run_two_ranks(script: str, tmp_path: Path, timeout: float = 120, nproc: int = WORLD_SIZE) -> None:
    """Run `script` (Python source; sys.argv[1] is tmp_path) in `nproc` processes; fail with their output."""
    path = tmp_path / "ranks.py"
    path.write_text(textwrap.dedent(script))
    done = command_server.run_module("tests.helpers.two_ranks", [str(nproc), str(path), str(tmp_path)], tmp_path,
                                     timeout)
    assert done.returncode == 0, f"{nproc}-process run failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


def load_ranks(tmp_path: Path, name: str = "record", nproc: int = WORLD_SIZE) -> List[Any]:
    """What each of `nproc` ranks saved with `save(name, obj)`, in rank order."""
    return [torch.load(tmp_path / f"{name}.rank{rank}.pt", weights_only=False) for rank in range(nproc)]


# --------------------------------------------------------------------------- rank side


def save(name: str, obj: Any) -> None:
    torch.save(obj, Path(sys.argv[1]) / f"{name}.rank{dist.get_rank()}.pt")


class AllReduceSpy:
    """Counts the calls of `torch.distributed.all_reduce` and the bytes of the tensors they reduce,
    while `active`; the real collective runs. torch's DDP hooks and model averaging call it
    through the module attribute, so they are seen."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.active = False
        self._real = dist.all_reduce
        dist.all_reduce = self._all_reduce

    def _all_reduce(self, tensor, *args, **kwargs):
        if self.active:
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
        return self._real(tensor, *args, **kwargs)

    def reset(self) -> None:
        self.calls = self.bytes = 0


class AllGatherSpy:
    """Keeps CPU copies of the tensors this rank contributes to `torch.distributed.all_gather`
    (its second argument), in call order, while `active`; the real collective runs. Hooks call it
    through the module attribute, so they are seen."""

    def __init__(self) -> None:
        self.sent: List[torch.Tensor] = []
        self.active = False
        self._real = dist.all_gather
        dist.all_gather = self._all_gather

    def _all_gather(self, tensor_list, tensor, *args, **kwargs):
        if self.active:
            self.sent.append(tensor.detach().cpu().clone())
        return self._real(tensor_list, tensor, *args, **kwargs)

    @property
    def calls(self) -> int:
        return len(self.sent)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sent)

    def reset(self) -> None:
        self.sent = []


class Record(pl.Callback):
    """One rank's record of the flat parameters it starts training from (`initial_params`) and
    of every optimizer step (`steps`): the flat gradient it steps with, and at the end
    of its batch (after the callbacks listed before this one) the flat parameters, training loss,
    learning rate, and the all-reduce calls and bytes since the batch started (with `spy`)."""

    def __init__(self, spy: Optional[AllReduceSpy] = None) -> None:
        self.spy = spy
        self.steps: List[dict] = []
        self._grad: Optional[torch.Tensor] = None
        self.initial_params: Optional[torch.Tensor] = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial_params = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.spy is not None:
            self.spy.reset()
            self.spy.active = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._grad = torch.cat([p.grad.detach().reshape(-1) for p in pl_module.parameters()]).clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = {"step": trainer.global_step, "grad": self._grad,
                "params": torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone(),
                "loss": float(outputs["loss"]),
                "lr": float(trainer.optimizers[0].param_groups[0]["lr"])}
        if self.spy is not None:
            self.spy.active = False
            step.update(all_reduce_calls=self.spy.calls, all_reduce_bytes=self.spy.bytes)
        self.steps.append(step)


def fit(comm_hook: Optional[Callable], callbacks: list, max_steps: int, model: Any = None, lr: float = 0.1,
        batch_size: int = 16, **data_kwargs: Any):
    """Train `model` (default: MLPClassifier with plain SGD) on SyntheticClassificationData in this
    rank, with FleetDDPStrategy(comm_hook) and `callbacks`; returns the trainer."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = model or MLPClassifier(optimizer=functools.partial(torch.optim.SGD, lr=lr))
    data = SyntheticClassificationData(batch_size=batch_size, **data_kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=build_ddp(comm_hook=comm_hook),
                         callbacks=callbacks, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[1])
    trainer.fit(model, datamodule=data)
    return trainer
