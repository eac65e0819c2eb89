"""What an exact resume needs in a checkpoint beyond Lightning's own state.

State that differs between ranks: only rank 0 writes a checkpoint, but every rank builds it
(Lightning calls the callbacks' `state_dict` on all of them), so a callback gathers each rank's
piece into it with `gather` and, on resume, each rank takes its own back with `own`, or follows
the callback's rule where the number of ranks changed (plugins/ranks.py). `RandomStates` keeps
every rank's random generators this way. `GlobalPosition`
records where a checkpoint stands (its world, global batch and position in the epoch's global
order), so that it resumes on any number of processes (docs/reliability.md#resume-bit-for-bit).
"""
from __future__ import annotations

import random
from typing import Any, Dict, List, Optional

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.seed import _collect_rng_states, _set_rng_states
from typing_extensions import override

from plugins.ranks import Rule, gather, own
from runner.data.order import GlobalOrder, Position, run_seed
from runner.rank.hooks import OwnHooksOnly
from runner.records.run_dir import RECORD


class RandomStates(OwnHooksOnly):
    """Every rank's torch, CUDA, numpy and Python random generators, saved with each checkpoint
    and restored when training starts from one: a resumed run draws the dropout masks, the noise
    and the augmentations the uninterrupted run would have drawn.

    On another number of processes no rank's saved draws are the ones it would make (the global
    batch is cut into other micro-batches), and rank 0's would give every rank the same masks:
    each rank's generators are re-derived from (run seed, global step, rank) instead (`rederived`)."""

    def __init__(self) -> None:
        self._loaded: Optional[List[Dict[str, Any]]] = None

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"ranks": gather(storable(_collect_rng_states(include_cuda=torch.cuda.is_available())))}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._loaded = state_dict["ranks"]  # applied when training starts: nothing draws after that

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loaded is not None:
            seed, step = run_seed(), trainer.global_step
            rule = Rule(f"each rank's are re-derived from (seed {seed}, step {step}, rank)",
                        lambda ranks, rank: rederived(seed, step, rank))
            _set_rng_states(restorable(own(self._loaded, "random generator states", rule)))
            self._loaded = None


def storable(states: Dict[str, Any]) -> Dict[str, Any]:
    """Lightning's generator states as a checkpoint holds them: numpy's key array as a tensor
    (checkpoints load with weights_only, which refuses arrays), and Python's 625 numbers as one
    (pickled one by one, they made every checkpoint ~0.1 ms slower to write)."""
    name, keys, *rest = states.pop("numpy")
    version, internal, gauss = states.pop("python")
    return {**states, "numpy": (name, torch.from_numpy(keys.astype(np.int64)), *rest),
            "python": (version, torch.tensor(internal, dtype=torch.int64), gauss)}


def restorable(states: Dict[str, Any]) -> Dict[str, Any]:
    """`storable`'s states as Lightning sets them (Python's a tuple in checkpoints written before)."""
    name, keys, *rest = states["numpy"]
    version, internal, gauss = states["python"]
    if isinstance(internal, torch.Tensor):
        internal = tuple(internal.tolist())
    return {**states, "numpy": (name, keys.numpy().astype(np.uint32), *rest), "python": (version, internal, gauss)}


def rederived(seed: int, step: int, rank: int) -> Dict[str, Any]:
    """This process's generators seeded from (seed, step, rank) through numpy's SeedSequence, as
    Lightning seeds a loader worker: torch's (the CPU's and every CUDA device's), Python's and
    numpy's from three of its words. Returns their states as `storable` keeps them."""
    torch_seed, python_seed, numpy_seed = np.random.SeedSequence([seed, step, rank]).generate_state(3)
    torch.manual_seed(int(torch_seed))
    random.seed(int(python_seed))
    np.random.seed(int(numpy_seed))
    return storable(_collect_rng_states(include_cuda=torch.cuda.is_available()))


class GlobalPosition(OwnHooksOnly):
    """Where a checkpoint stands, for a resume on any number of processes: every checkpoint gets
    a `lightfleet` record of the world it was written on, its global batch (micro-batch and
    accumulation) and its position in the epoch as samples of the epoch's global order
    (runner/data/order.py). On resume, the position goes to the run's GlobalOrder samplers, and
    Lightning's per-rank batch counters are made those of this run's accumulation, so that the
    epoch ends, validates and checkpoints at the same optimizer steps as the uninterrupted run.

    A loader of another sampler keeps its own position in Lightning's loop state; this only
    drops it from a checkpoint taken at an epoch's last batch, which Lightning resumes at the next
    epoch, where the saved position (the end of the data) would make that epoch empty."""

    def __init__(self, pipeline_micro_batches: int = 1) -> None:
        self.pipeline_micro_batches = pipeline_micro_batches  # a pipeline cuts each loader batch into this many
        self.position = Position()
        self._epoch_start_step = 0
        self._epoch: Optional[int] = None  # the epoch whose batches are being trained

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)  # Lightning does not call it for an epoch resumed midway

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch = trainer.current_epoch
        sampler = train_sampler(trainer)
        trained = self.position.samples_in(trainer.current_epoch)
        global_batch = sampler.global_batch if isinstance(sampler, GlobalOrder) else 1
        self._epoch_start_step = trainer.global_step - trained // global_batch

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: Dict[str, Any]) -> None:
        sampler = train_sampler(trainer)
        ordered = isinstance(sampler, GlobalOrder)
        if ordered or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            checkpoint["loops"]["fit_loop"]["state_dict"].pop("combined_loader", None)
        replicas = trainer.distributed_sampler_kwargs["num_replicas"] if trainer.distributed_sampler_kwargs else 1
        loader_batch = getattr(trainer.train_dataloader, "batch_size", None)
        global_batch = replicas * loader_batch * trainer.accumulate_grad_batches if loader_batch else None
        micro_batch = loader_batch // self.pipeline_micro_batches if loader_batch else None
        steps = trainer.global_step - self._epoch_start_step
        # The epoch of the batches trained: Lightning counts an epoch that max_steps ended midway as
        # done (a checkpoint written as fit ends), and would resume that run in the next epoch.
        epoch = trainer.current_epoch if self._epoch is None else self._epoch
        finished = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        checkpoint[RECORD] = {
            "world": {"processes": trainer.world_size, "nodes": trainer.num_nodes, "data_parallel": replicas},
            "batch": {"global": global_batch, "micro": micro_batch,
                      "accumulation": global_batch // (replicas * micro_batch) if global_batch else None,
                      "loader": loader_batch, "accumulate_grad_batches": trainer.accumulate_grad_batches},
            "data": {"order": "global" if ordered else "loader", "epoch": epoch, "epoch_finished": finished,
                     "steps_in_epoch": steps, "samples": steps * global_batch if global_batch else None}}

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: Dict[str, Any]) -> None:
        record = checkpoint.get(RECORD)
        if record is None:  # written before lightfleet kept one: Lightning's own position stands
            return
        data = record["data"]
        if data["order"] == "global":
            self.position.epoch, self.position.samples = data["epoch"], data["samples"]
        loops = checkpoint["loops"]["fit_loop"]
        epochs, batches = loops["epoch_progress"], loops["epoch_loop.batch_progress"]
        if not data["epoch_finished"] and epochs["current"]["completed"] > data["epoch"]:
            # Written as fit ended midway: its counters made those of a checkpoint written at the
            # step's end (the epoch under way, its last batch not yet counted done), which Lightning
            # resumes exactly.
            for counters in (epochs["current"], epochs["total"]):
                counters["processed"] -= 1
                counters["completed"] -= 1
            for counters in (batches["current"], batches["total"]):
                counters["completed"] -= 1
            loops["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
        # Lightning counts batches per rank (in the epoch, and in all: what validation every n
        # steps across epochs counts): those of the steps already trained, at this run's
        # accumulation, so the epoch ends (and validates) at the steps the run's did.
        more = trainer.accumulate_grad_batches - record["batch"]["accumulate_grad_batches"]
        trained = ((batches["current"], data["steps_in_epoch"]), (batches["total"], checkpoint["global_step"]))
        for counters, steps in trained:
            for name in counters:
                counters[name] += steps * more


def train_sampler(trainer: pl.Trainer) -> Any:
    """The sampler of the run's training loader (None before fit has made it)."""
    return getattr(trainer.train_dataloader, "sampler", None)
