"""Callbacks the tests put into real `lightfleet` runs, as a user adds a callback from the command
line (`+callbacks.probe._target_=tests.helpers.probe.Wiring ...`), to see from inside every rank
what the strategies' plugins received and what they did. The project's root is on the runs'
PYTHONPATH (tests/helpers/commands.py), so a rank imports this module as the tests do.

- `Wiring`: each knob as the object carrying it out sees it (a strategy's `wiring`, declared in
  tests/helpers/strategies.py).
- `Effects`: what every strategy is known for, observed alike in every run (its `row_effect`, there).
- `FirstStep`, `FinalState`, `SynchronisingCalls`: what many tests read; then the callbacks of one
  test module each (a run loads them by name, so they live here, not in the test module).

And what in-process tests share: `knobs_of` (every knob a table of knob effects must name) and
`attention_in_plain_matmuls` (attention that torch's FLOP counter sees).
"""
from __future__ import annotations

import hashlib
import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

class Wiring(pl.Callback):
    """After the first training batch, rank 0 writes what the readers of the strategy's wiring case
    `case` (tests/helpers/strategies.py) see into wiring.json in the run directory."""

    def __init__(self, strategy: str, case: int) -> None:
        self.strategy, self.case = strategy, case

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx or not trainer.is_global_zero:
            return
        from tests.helpers.strategies import STRATEGIES  # here: only the runs that wire import the readers' plugins

        knobs = STRATEGIES[self.strategy].wiring[self.case].knobs
        seen = {name: knob.read(trainer, pl_module) for name, knob in knobs.items()}
        Path(trainer.default_root_dir, "wiring.json").write_text(json.dumps(seen))


class Effects(pl.Callback):
    """What each rank does, for the strategies' `row_effect` checks: per training batch, the
    dtypes modules compute in, the forward calls of recompute's wrapped modules and the
    collectives handed to all_gather / all_reduce (op, dtype, bytes); before every batch and at
    the end, the state: global step, optimizer class and how many parameters its state covers,
    a checksum of the parameters, logged metrics. Saved as effects.rank<r>.pt in the run directory."""

    def __init__(self) -> None:
        self.static: Dict[str, Any] = {}
        self.batches: List[Dict[str, Any]] = []
        self.states: List[Dict[str, Any]] = []  # states[i]: after i training batches
        self._open: Optional[Dict[str, Any]] = None  # the batch running now (not validation between batches)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name in ("all_gather", "all_reduce"):
            real = getattr(dist, name)

            def spy(*args: Any, _name: str = name, _real: Callable = real, **kwargs: Any) -> Any:
                tensor = args[1] if _name == "all_gather" else args[0]  # what this rank sends
                if self._open is not None:
                    self._open["collectives"].append((_name, str(tensor.dtype), tensor.numel() * tensor.element_size()))
                return _real(*args, **kwargs)

            setattr(dist, name, spy)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modules = list(pl_module.modules())
        for stage in getattr(trainer.strategy, "stages", []):  # pipeline: the traced stages run, not the model
            modules += list(stage.submod.modules())
        for module in modules:
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_hook(self._output_dtype)
            if isinstance(module, CheckpointWrapper):
                # A pre-hook: the recomputation in backward stops as soon as it has what backward needs.
                module._checkpoint_wrapped_module.register_forward_pre_hook(self._wrapped_forward)
        self.static = {"parameters": [name for name, _ in pl_module.named_parameters()],
                       "numel": sum(_local(p).numel() for p in pl_module.parameters()),
                       "global_numel": sum(p.numel() for p in pl_module.parameters()),
                       "wrapped": sum(isinstance(m, CheckpointWrapper) for m in modules),
                       "micro_batches": getattr(trainer.strategy, "accumulate_steps", 1)}

    def _output_dtype(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open is not None and isinstance(output, torch.Tensor) and output.is_floating_point():
            self._open["dtypes"].add(str(output.dtype))

    def _wrapped_forward(self, module: nn.Module, args: Any) -> None:
        if self._open is not None:
            self._open["wrapped_forwards"] += 1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.states.append(self._state(trainer, pl_module))
        self._open = {"dtypes": set(), "wrapped_forwards": 0, "collectives": []}
        self.batches.append(self._open)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._open = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.states.append(self._state(trainer, pl_module))
        torch.save({"static": self.static, "batches": self.batches, "states": self.states},
                   Path(trainer.default_root_dir) / f"effects.rank{trainer.global_rank}.pt")

    @staticmethod
    def _state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Dict[str, Any]:
        optimizer = trainer.optimizers[0]
        local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's share
        with torch.no_grad():
            checksum = sum(float(_local(p).double().sum()) for p in pl_module.parameters())
        return {"global_step": trainer.global_step, "optimizer": type(local).__name__,
                "optimizer_state": len(local.state), "checksum": checksum,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class FirstStep(pl.Callback):
    """Rank 0 saves, as first_step.pt in the run directory: the parameters training starts from,
    the batches of the first optimizer step, and the gradients that step applies."""

    def __init__(self) -> None:
        self.record: Dict[str, Any] = {"batches": []}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["initial"] = {name: p.detach().clone() for name, p in pl_module.named_parameters()}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if "grads" not in self.record:
            self.record["batches"].append([t.clone() for t in batch])

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if "grads" not in self.record and trainer.is_global_zero:
            self.record["grads"] = {name: p.grad.clone() for name, p in pl_module.named_parameters()}
            torch.save(self.record, Path(trainer.default_root_dir) / "first_step.pt")


class Collector(pl.Callback):
    """Each rank writes, as collector.rank<r>.json in the run directory when training starts, the
    state of Python's garbage collector: its full collections so far, the objects frozen, and
    whether it is on (tests/test_startup.py)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import gc

        state = {"full_collections": gc.get_stats()[2]["collections"], "frozen": gc.get_freeze_count(),
                 "enabled": gc.isenabled()}
        (Path(trainer.default_root_dir) / f"collector.rank{trainer.global_rank}.json").write_text(json.dumps(state))


class FinalState(pl.Callback):
    """Each rank saves what it ends training with, as final.rank<r>.pt in the run directory: its
    parameters (its own shard or stage where it holds one) and its optimizer's state, to compare
    a resumed run with an uninterrupted one exactly."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modules = {"model": pl_module}
        for index, stage in enumerate(getattr(trainer.strategy, "stages", [])):
            modules[f"stage{index}"] = stage.submod
        parameters = {f"{owner}.{name}": _local(p).detach().clone()
                      for owner, module in modules.items() for name, p in module.named_parameters()}
        optimizer = trainer.optimizers[0]
        local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's share
        state = [{key: _local(value).clone() if isinstance(value, torch.Tensor) else value
                  for key, value in entry.items()} for entry in local.state.values()]
        torch.save({"global_step": trainer.global_step, "parameters": parameters, "optimizer": state},
                   Path(trainer.default_root_dir) / f"final.rank{trainer.global_rank}.pt")


# aten ops that read a value back from the device (an `.item()`, `float(tensor)`, a comparison into a
# Python bool, a data-dependent shape): each one waits for the device on a GPU.
SYNCHRONISING = ("_local_scalar_dense", "equal", "nonzero", "masked_select")


class SynchronisingCalls(pl.Callback):
    """Counts, on rank 0, the calls that would synchronise a GPU with its host, from each training
    batch's start to the next one's (everything in between: the step, every callback, Lightning's
    logging, the next fetch); writes [[global step, count], ...] into syncs.json in the run
    directory at the end. It watches the aten ops themselves, on any device, and on CUDA also
    counts what CUDA's own sync debug mode reports (blocking copies, stream synchronisations)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import warnings

        from torch.utils._python_dispatch import TorchDispatchMode

        watched = {getattr(torch.ops.aten, name).default for name in SYNCHRONISING}

        class Counter(TorchDispatchMode):
            calls = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Counter.calls += func in watched
                return func(*args, **(kwargs or {}))

        self.counter, self.counts, self.started_at = Counter(), [], None
        self.counter.__enter__()
        self.cuda = trainer.strategy.root_device.type == "cuda"
        if self.cuda:
            self.caught = warnings.catch_warnings(record=True)
            self.warned = self.caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def calls(self) -> int:
        reported = sum("synchronizing CUDA operation" in str(w.message) for w in self.warned) if self.cuda else 0
        return self.counter.calls + reported

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.started_at is not None:
            self.counts.append([self.step, self.calls() - self.started_at])
        self.started_at, self.step = self.calls(), trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counter.__exit__(None, None, None)
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self.caught.__exit__(None, None, None)
        if trainer.global_rank == 0:
            Path(trainer.default_root_dir, "syncs.json").write_text(json.dumps(self.counts))


def reads_off_logging_steps(windows: List[List[int]], k_steps: int, log_every: int) -> Dict[int, int]:
    """Of SynchronisingCalls' windows in a run of `k_steps` micro-batches a step, those with calls
    that end no logging step (the first step and every `log_every`-th): window index -> calls."""
    def logged(index: int, step: int) -> bool:
        return index % k_steps == k_steps - 1 and (step + 1 == 1 or (step + 1) % log_every == 0)

    return {index: calls for index, (step, calls) in enumerate(windows) if calls and not logged(index, step)}


# --------------------------------------------------------------------------- callbacks of one test module each


# tests/plugins/test_collective.py


class CollectiveProbe(pl.Callback):
    """At the end of training (DDP has rebuilt its buckets by then), each rank writes what it
    sees into probe.rank<r>.json in the run directory."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seen: Dict[str, Any] = {
            "threads": torch.get_num_threads(),
            "sync_batch_norm": any(isinstance(m, nn.SyncBatchNorm) for m in pl_module.modules()),
            "foreach": trainer.optimizers[0].param_groups[0].get("foreach"),
        }
        ddp = trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel):
            logged = ddp._get_ddp_logging_data()
            # After the first step DDP rebuilds its buckets in gradient order, by bucket_cap_mb; each
            # step then hands every bucket to the allreduce (num_buckets_reduced).
            seen.update(bucket_cap_bytes=ddp.bucket_bytes_cap, find_unused_parameters=ddp.find_unused_parameters,
                        buckets=logged["num_buckets_reduced"], bucket_sizes=logged.get("rebuilt_bucket_sizes"))
        Path(trainer.default_root_dir, f"probe.rank{trainer.global_rank}.json").write_text(json.dumps(seen))


class HangingRank(pl.Callback):
    """Rank 1 stops answering at step 2, as a rank stuck outside a collective would (and dies
    at once on SIGTERM, as one stuck in C++ code would not run a Python handler)."""

    def on_train_batch_start(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 2:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            Path(trainer.default_root_dir, HANG_STARTED).write_text(str(time.time()))
            time.sleep(300)


HANG_STARTED = "hang_started"  # when rank 1 stopped answering (seconds since the epoch)


# tests/plugins/test_batch_norm.py


def floating_buffers(pl_module: pl.LightningModule) -> Dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in pl_module.named_buffers() if b.is_floating_point()}


class RunningStats(pl.Callback):
    """Each rank saves, as running_stats.rank<r>.pt in the run directory, its floating buffers when
    training starts and when it ends."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = floating_buffers(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save({"start": self.start, "end": floating_buffers(pl_module)},
                   Path(trainer.default_root_dir) / f"running_stats.rank{trainer.global_rank}.pt")


# tests/plugins/test_fast_path.py (and tests/test_gpu.py)


class AttentionOps(TorchDispatchMode):
    """Counts the aten ops by name while active: which kernel scaled_dot_product_attention ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def attention(self) -> Dict[str, int]:
        # The math kernel's softmax; not the loss's log-softmax.
        return {op: count for op, count in self.ops.items()
                if "attention" in op or op.startswith(("_safe_softmax", "_softmax"))}


class CountFirstBatch(pl.Callback):
    """The aten ops of the first training batch (forward, recomputation, backward, step)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.counter = AttentionOps()
            self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.counter.__exit__(None, None, None)


class FastPathProbe(CountFirstBatch):
    """Each rank writes into fast_path.rank<r>.json what it trained with: whether the model is
    compiled (and the graphs dynamo made), the optimizer's class and its groups' fused flags, the
    attention ops of the first training batch (not under compile: dynamo would trace the
    counting), the losses, and a checksum of its (full) parameters."""

    def __init__(self, count_attention: bool = True) -> None:
        super().__init__()
        self.count_attention = count_attention
        self.counter = AttentionOps()
        self.losses: List[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.count_attention:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.count_attention:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        optimizer = trainer.optimizers[0]
        full = [p.full_tensor() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
        seen = {"compiled": pl_module._compiled_call_impl is not None, "optimizer": type(optimizer).__name__,
                "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                "dtensor": any(isinstance(p, DTensor) for p in pl_module.parameters()),
                "fused": [group.get("fused") for group in optimizer.param_groups],
                "attention": self.counter.attention(), "losses": self.losses,
                "checksum": float(sum(p.detach().double().sum() for p in full))}
        Path(trainer.default_root_dir, f"fast_path.rank{trainer.global_rank}.json").write_text(json.dumps(seen))


# tests/test_gpu.py


class CudaProbe(pl.Callback):
    """What rank 0 trained with, written into probe.json in the run directory at the end."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.dtypes, self.channels_last = set(), set()
        first = next(module for module in pl_module.modules() if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)))
        first.register_forward_hook(lambda module, args, output: self.dtypes.add(str(output.dtype)))
        first.register_forward_hook(lambda module, args, output: self.channels_last.add(
            args[0].dim() == 4 and args[0].is_contiguous(memory_format=torch.channels_last)))
        loader = trainer.fit_loop._combined_loader.flattened[0]
        self.loader = {"pin_memory": loader.pin_memory, "num_workers": loader.num_workers}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank:
            return
        device = trainer.strategy.root_device
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        seen: Dict[str, Any] = {
            "device": str(device), "backend": dist.get_backend() if dist.is_initialized() else None,
            "forward_dtypes": sorted(self.dtypes), "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "channels_last_inputs": sorted(self.channels_last), "loader": self.loader,
            "memory_fraction": torch.cuda.get_per_process_memory_fraction(device),
            "scaler": [cls.__module__ + "." + cls.__name__ for cls in type(scaler).__mro__] if scaler else [],
            "scale": float(scaler.get_scale()) if scaler else None}
        Path(trainer.default_root_dir, "probe.json").write_text(json.dumps(seen))


# tests/test_runs.py


class FailingStep(pl.Callback):
    """The user's code failing mid-run, in a rank: what the command cannot foresee."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            raise RuntimeError(f"the user's callback failed at step {self.at_step}")


# tests/test_divergence.py


class NaNInputs(pl.Callback):
    """The inputs of training step `step` (counted from 1, as global_step counts steps taken) made
    NaN: that step's loss is non-finite, and so are the parameters it updates."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step + 1 == self.step:
            batch[0].fill_(float("nan"))


# --------------------------------------------------------------------------- shared by in-process tests


def knobs_of(target: Callable, conf: Optional[Path] = None) -> set:
    """Every knob of a built-in model or data module: its constructor's arguments and the keys of
    its conf (conf/model/*.yaml, conf/data/*.yaml; not its Hydra defaults list). A test module's
    table of knob effects must name each one: a knob added without a test of its own effect fails there."""
    import inspect

    from omegaconf import OmegaConf

    names = set(inspect.signature(target).parameters)
    return names | (set(OmegaConf.load(conf)) - {"_target_", "defaults"} if conf is not None else set())


def attention_in_plain_matmuls(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's scaled_dot_product_attention as two matrix products that torch's FLOP counter sees
    (it counts no CPU SDPA kernel), the whole T x T of them as published FLOP formulas count:
    grouped key/value heads repeated, causal or boolean masks, no dropout."""
    assert dropout_p == 0, "FLOPs are counted without dropout"
    if k.size(-3) != q.size(-3):  # grouped-query attention: each key/value head serves a group of query heads
        k, v = (t.repeat_interleave(q.size(-3) // t.size(-3), -3) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(-1) @ v


def optimizer_knob(make: Callable[..., pl.LightningModule]) -> None:
    """A built-in model's `optimizer` (a partial optimizer class, as Hydra builds it): the one it trains with."""
    import functools

    chosen = make(optimizer=functools.partial(torch.optim.Adam, lr=0.25)).configure_optimizers()
    chosen = chosen["optimizer"] if isinstance(chosen, dict) else chosen  # with a learning-rate schedule
    assert isinstance(chosen, torch.optim.Adam) and chosen.defaults["lr"] == 0.25


def channels_last_knob(make: Callable[..., pl.LightningModule]) -> None:
    """A convolution model's `channels_last=true`: its convolution weights in channels-last on a CPU
    too, where auto (the default) leaves them (tests/runner/test_device_path.py: on CUDA)."""
    from tests.helpers.data_files import on_device

    def converted(**knob: Any) -> bool:
        model = make(**knob)
        model.trainer = on_device("cpu")
        model.setup("fit")
        return all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in model.modules()
                   if isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1))

    assert converted(channels_last="true") and not converted()


class SampleIds(pl.Callback):
    """Every rank appends, for each training batch, the optimizer step it belongs to and an id of
    each sample (the first 12 hex digits of the sha1 of its inputs' bytes) to
    sample_ids.rank<R>.jsonl in the run directory: `samples_per_step` reads them back, whatever the
    number of processes and micro-batches that made a step (issue 41's resumes)."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        inputs = (batch[0] if isinstance(batch, (list, tuple)) else batch).detach().cpu()
        ids = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:12] for row in inputs]
        with (Path(trainer.default_root_dir) / f"sample_ids.rank{trainer.global_rank}.jsonl").open("a") as out:
            out.write(json.dumps({"step": trainer.global_step, "ids": ids}) + "\n")


def samples_per_step(*runs: Path) -> Dict[int, Counter]:
    """The samples each optimizer step of `runs` trained on (their SampleIds files), counted: a
    run resumed from another's step takes the steps from there on."""
    steps: Dict[int, Counter] = {}
    for run in runs:
        for path in sorted(run.glob("sample_ids.rank*.jsonl")):
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                steps.setdefault(entry["step"], Counter()).update(entry["ids"])
    return steps


class BarRedraws(pl.Callback):
    """Counts how often the steps bar draws its training line (tqdm's display) from the first
    batch on, its closing line too, and writes the count and the seconds from there to
    bar_redraws.json (rank 0)."""

    def __init__(self) -> None:
        self.redraws, self.started = 0, 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.started:
            return
        self.started = time.monotonic()
        bar = trainer.progress_bar_callback.train_progress_bar
        display = bar.display

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.redraws += 1
            return display(*args, **kwargs)

        bar.display = counted

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:  # after the bar has closed, drawing its last line
            figures = {"redraws": self.redraws, "seconds": time.monotonic() - self.started, "steps": trainer.global_step}
            (Path(trainer.default_root_dir) / "bar_redraws.json").write_text(json.dumps(figures))
