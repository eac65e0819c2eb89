"""Every run measures itself, on every rank: optimizer-step times, the time the training loader
takes to produce each step's batches, throughput, model FLOPs utilisation and peak memory
(docs/measurements.md says what each figure means).

The hot path only reads clocks (CUDA events on GPUs, so the device is synchronised only when the
times are read: at logging steps and at the end) and counts samples; figures are computed and
logged every `log_every_n_steps`, and gathered from all ranks once, when training ends.

On a GPU the host runs ahead of the device and blocks only where something synchronises, so time
between two host hooks is device time, not the loader's. The loader is timed inside its fetch
(LoaderClock), and on CUDA the device's own idle time between batches (DeviceGaps) says whether
that loading held the device up.

(Over 400 lines on purpose: the meter, the loader clock and the device gaps share one step
timeline and its pause/resume points; split apart, each would re-derive the others' step state.)
"""
from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.throughput import get_available_flops
from pytorch_lightning.utilities.data import extract_batch_size
from typing_extensions import override

from plugins.ranks import gather
from runner.core.clock import started_at
from runner.rank.hooks import OwnHooksOnly

# Dense peak FLOP/s of GPUs Lightning's table (lightning_fabric.utilities.throughput) lacks or
# names ambiguously: the H200 ("NVIDIA H200") and the L40S (which Lightning reads as an L4).
EXTRA_PEAK_FLOPS = {
    "h200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, "tfloat32": 494.7e12, torch.float32: 66.9e12},
    "l40s": {torch.bfloat16: 362.05e12, torch.float16: 362.05e12, "tfloat32": 183.2e12, torch.float32: 91.6e12},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Dense peak FLOP/s of one device computing in `dtype` (None: unknown, as on CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for chip, table in EXTRA_PEAK_FLOPS.items():
        if chip in name.split():
            tf32 = dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest"
            return table.get("tfloat32" if tf32 else dtype)
    return get_available_flops(device, dtype)


def declared(name: str, *owners: Any) -> Optional[float]:
    """An attribute a user's module or datamodule may declare (tokens_per_sample, flops_per_token...)."""
    for owner in owners:
        value = getattr(owner, name, None)
        if value is not None:
            return float(value)
    return None


def peak_memory_mb(device: torch.device) -> Dict[str, Optional[float]]:
    """This rank's peak memory: CUDA's max allocated and reserved, or on CPU the process's peak
    resident set: Linux's VmHWM, of this program since it started (getrusage's ru_maxrss survives
    exec, and so holds the memory of the command that launched the rank when that was larger);
    elsewhere ru_maxrss (macOS reports it in bytes)."""
    if device.type == "cuda":
        return {"peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
    status = Path("/proc/self/status")
    if status.exists():
        kib = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
        return {"peak_memory_mb": kib / 2**10, "peak_reserved_mb": None}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_memory_mb": peak / (2**20 if sys.platform == "darwin" else 2**10), "peak_reserved_mb": None}


class StepClock:
    """Times between consecutive `tick`s. On CUDA each tick records an event, and the device is
    synchronised only when `durations` reads them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._ticks: List[Any] = []

    def tick(self) -> None:
        if self.cuda:
            self._ticks.append(recorded_event())
        else:
            self._ticks.append(time.perf_counter())

    def restart(self) -> None:
        """Forget the pending tick: what comes before the next one is not a step (validation...)."""
        self._ticks.clear()
        self.tick()

    def durations(self) -> List[float]:
        """Seconds between the ticks since the last call; the last tick is kept as the next start."""
        ticks = self._ticks
        if len(ticks) < 2:
            return []
        if self.cuda:
            ticks[-1].synchronize()
            seconds = [start.elapsed_time(end) / 1000 for start, end in zip(ticks, ticks[1:])]
        else:
            seconds = [end - start for start, end in zip(ticks, ticks[1:])]
        self._ticks = ticks[-1:]
        return seconds


class LoaderClock:
    """Seconds the training loader spends producing batches, by the host's clock inside each fetch.
    Lightning's training epoch loop wraps every `next()` of the training loader in its
    `_on_before_fetch` and `_on_after_fetch` (its profiler's start and stop of the fetch, whatever
    profiler the run has): this times those two, and `release` puts them back. Private Lightning
    API (tests/runner/test_measure.py fails where it moves), chosen over the profiler's public
    start and stop, which every hook of every callback goes through: about 67 calls a step."""

    HOOKS = ("_on_before_fetch", "_on_after_fetch")

    def __init__(self, epoch_loop: Any) -> None:
        self.epoch_loop, self.seconds, self._started = epoch_loop, 0.0, None
        before, after = (getattr(epoch_loop, name) for name in self.HOOKS)

        def timed_before() -> None:
            self._started = time.perf_counter()
            before()

        def timed_after() -> None:
            after()
            if self._started is not None:
                self.seconds += time.perf_counter() - self._started
                self._started = None

        epoch_loop._on_before_fetch, epoch_loop._on_after_fetch = timed_before, timed_after

    def take(self) -> float:
        """The loading time since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def release(self) -> None:
        for name in self.HOOKS:
            vars(self.epoch_loop).pop(name, None)


class DeviceGaps:
    """On CUDA, the device's idle time between one micro-batch's end and the next one's start, by
    events recorded at both (read when `take` is called): near zero when the host ran ahead (the
    device still had work queued when the next batch was issued), the device's wait when it did
    not. Nothing on other devices, where the host's clock is the device's."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._end: Any = None  # the event of the last micro-batch's end, until the next one starts
        self._step: List[Tuple[Any, Any]] = []  # (end, start) event pairs of the step under way
        self._steps: List[List[Tuple[Any, Any]]] = []  # ... of each finished step not yet read

    def batch_end(self) -> None:
        if self.cuda:
            self._end = recorded_event()

    def batch_start(self) -> None:
        if self.cuda and self._end is not None:
            self._step.append((self._end, recorded_event()))
            self._end = None

    def step_done(self) -> None:
        if self.cuda:
            self._steps.append(self._step)
            self._step = []

    def forget(self) -> None:
        """What comes before the next batch (validation, an epoch's end) is not a gap between batches."""
        self._end = None

    def take(self) -> List[float]:
        """Each step's idle seconds since the last call (synchronises on the last event)."""
        last = next((pairs[-1][1] for pairs in reversed(self._steps) if pairs), None)
        if last is not None:
            last.synchronize()
        gaps = [sum(end.elapsed_time(start) for end, start in pairs) / 1000 for pairs in self._steps]
        self._steps = []
        return gaps


def recorded_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@dataclass
class RankFigures:
    """What one rank measured, gathered to every rank at the end."""

    data_parallel_rank: int
    samples: int  # samples this rank trained on
    measured_samples: int  # ... in the steps after warm-up
    step_times: List[float]  # seconds per optimizer step after warm-up
    data_waits: List[float]  # ... of which the training loader spent producing its batches (host clock)
    first_step_at: float  # seconds since the epoch
    peak_memory_mb: float
    peak_reserved_mb: Optional[float]
    device_gaps: Optional[List[float]] = None  # per measured step, the device's idle time between batches (CUDA)


class LastValidation(OwnHooksOnly):
    """The global step of fit's last validation (a sanity check is none): the step the run's
    val_* figures come from, which is not the last step unless validation ran there."""

    def __init__(self) -> None:
        self.step: Optional[int] = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.step = trainer.global_step


class RunMeter(OwnHooksOnly):
    """Measures optimizer-step time, samples, tokens and peak memory on every rank; logs them
    every `log_every_n_steps` (samples/s and tokens/s in the progress bar) and leaves the run's
    figures in `summary` (on every rank) when training ends."""

    def __init__(self, warmup_steps: int = 5) -> None:
        self.warmup_steps = warmup_steps
        self.summary: Dict[str, Any] = {}
        self.clock: Optional[StepClock] = None  # from the start of training (not in evaluation or sanity checks)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.device = trainer.strategy.root_device
        sampler = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        self.data_parallel_size = int(sampler.get("num_replicas", 1))
        self.data_parallel_rank = int(sampler.get("rank", 0))
        datamodule = trainer.datamodule
        self.tokens_per_sample = declared("tokens_per_sample", datamodule, pl_module)
        per_token = declared("flops_per_token", pl_module)
        self.flops_per_sample = (per_token * self.tokens_per_sample if per_token and self.tokens_per_sample
                                 else declared("flops_per_sample", pl_module))
        self.peak_flops = peak_flops(self.device, compute_dtype(trainer))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.clock = StepClock(self.device)
        self.loader = LoaderClock(trainer.fit_loop.epoch_loop)
        self.gaps = DeviceGaps(self.device)
        self.step_times: List[float] = []  # every step's, warm-up included
        self.data_waits: List[float] = []  # every step's loading time (host clock, inside the fetches)
        self.device_gaps: List[float] = []  # every step's idle device time between batches (CUDA)
        self.step_samples: List[int] = []
        self.samples = self.samples_in_step = 0
        self.first_step_at: Optional[float] = None
        self.interrupted = True
        self.last_step = trainer.global_step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()
        if self.interrupted:  # the step starts now, not when validation or the epoch began
            self.clock.restart()
            self.loader.take()  # the first batch's fetch belongs to no timed step
            self.interrupted = False
        self.gaps.batch_start()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # The common (inputs, targets) batch directly; Lightning's search of the batch otherwise.
        first = batch[0] if isinstance(batch, (tuple, list)) and batch else None
        self.samples_in_step += len(first) if isinstance(first, torch.Tensor) and first.dim() else extract_batch_size(batch)
        step = trainer.global_step  # read once: Lightning's property walks its loops (~1 us)
        if step != self.last_step:  # the optimizer stepped (not while accumulating)
            self._step_done(trainer, step)
        self.gaps.batch_end()

    def _step_done(self, trainer: pl.Trainer, step: int) -> None:
        self.last_step = step
        self.clock.tick()
        self.gaps.step_done()
        self.data_waits.append(self.loader.take())
        self.samples += self.samples_in_step
        self.step_samples.append(self.samples_in_step)
        self.samples_in_step = 0
        if trainer.log_every_n_steps and step % trainer.log_every_n_steps == 0:
            self._read_clock()
            self._log(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pause()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read_clock()
        self.loader.release()
        # Too few steps for the warm-up asked for: all but the first (which compiles, allocates...).
        steps = len(self.step_times)
        warm = self.warmup_steps if steps > self.warmup_steps else int(steps > 1)
        timed = slice(len(self.data_waits) - steps + warm, None) if steps else slice(0)  # the steps the clock timed
        gaps = self.device_gaps[timed] if self.gaps.cuda else None
        mine = RankFigures(self.data_parallel_rank, self.samples, sum(self.step_samples[warm:]),
                           self.step_times[warm:], self.data_waits[timed], self.first_step_at or time.time(),
                           **peak_memory_mb(self.device), device_gaps=gaps)
        ranks = gather(mine)
        self.summary = self._summarize(ranks)

    def _pause(self) -> None:
        if self.clock is None:  # not training yet: an evaluation, or fit's sanity check
            return
        self._read_clock()
        self.interrupted = True
        self.gaps.forget()

    def _read_clock(self) -> None:
        if self.clock is not None:
            self.step_times += self.clock.durations()
            self.device_gaps += self.gaps.take()

    def _log(self, trainer: pl.Trainer) -> None:
        """The figures of the steps since the last log, as this rank sees them (x replicas),
        handed to the loggers and the progress bar directly: LightningModule.log costs ~0.25 ms
        a call, more than the rest of the measuring put together."""
        recent = self.step_times[-trainer.log_every_n_steps:]
        if not recent:
            return
        samples_per_s = sum(self.step_samples[-len(recent):]) / sum(recent) * self.data_parallel_size
        figures = {"step_time_s": statistics.median(recent), "samples_per_s": samples_per_s,
                   "data_wait_s": statistics.median(self.data_waits[-len(recent):]),
                   "peak_memory_mb": peak_memory_mb(self.device)["peak_memory_mb"]}
        if self.tokens_per_sample:
            figures["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        for logger in trainer.loggers:  # rank 0's loggers write; the others' do nothing
            # Lightning labels a step's metrics with the optimizer steps done before it: one less.
            logger.log_metrics(figures, step=trainer.global_step - 1)
        # The progress bar shows what this dict holds (beside the loss) until the next update.
        trainer.progress_bar_metrics.update({name: round(figures[name]) for name in ("samples_per_s", "tokens_per_s")
                                             if name in figures})

    def _summarize(self, ranks: List[RankFigures]) -> Dict[str, Any]:
        """The run's figures: throughput counts each data-parallel replica once (the ranks of one
        pipeline or tensor-parallel group read the same samples) over the slowest rank's time."""
        replicas = {rank.data_parallel_rank: rank for rank in ranks}.values()
        measured_time = max(sum(rank.step_times) for rank in ranks)
        measured = sum(rank.measured_samples for rank in replicas)
        samples_per_s = measured / measured_time if measured_time else None
        tokens_per_s = samples_per_s * self.tokens_per_sample if samples_per_s and self.tokens_per_sample else None
        mfu = None
        if samples_per_s and self.flops_per_sample and self.peak_flops:
            mfu = self.flops_per_sample * samples_per_s / (self.peak_flops * len(ranks))
        medians = [statistics.median(rank.step_times) if rank.step_times else None for rank in ranks]
        p90s = [percentile(rank.step_times, 0.9) for rank in ranks]
        first_step_at = min(rank.first_step_at for rank in ranks)
        waits = [(sum(rank.data_waits) / sum(rank.step_times), statistics.median(rank.data_waits))
                 for rank in ranks if rank.step_times and rank.data_waits]
        fraction, wait = max(waits, default=(None, None))  # the rank that waits most
        idle = [sum(rank.device_gaps) / sum(rank.step_times) for rank in ranks if rank.step_times and rank.device_gaps]
        return {
            "step_time_median_s": max(filter(None, medians), default=None),
            "step_time_p90_s": max(filter(None, p90s), default=None),
            "data_wait_s": wait,
            "data_wait_fraction": fraction,
            "device_idle_fraction": max(idle, default=None),
            "samples_per_s": samples_per_s,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "peak_memory_mb": max(rank.peak_memory_mb for rank in ranks),
            "peak_reserved_mb": max((rank.peak_reserved_mb for rank in ranks if rank.peak_reserved_mb), default=None),
            "startup_s": first_step_at - started_at(),
            "train_s": time.time() - first_step_at,
            "samples_seen": sum(rank.samples for rank in replicas),
            "measured_steps": len(ranks[0].step_times),
            "warmup_steps": self.warmup_steps,
            "world_size": len(ranks),
            "data_parallel_size": self.data_parallel_size,
            "global_batch": self.step_samples[-1] * self.data_parallel_size if self.step_samples else None,
            "device": device_name(self.device),
            "tokens_per_sample": self.tokens_per_sample,
            "flops_per_sample": self.flops_per_sample,
            "peak_flops_per_device": self.peak_flops,
            "by_rank": {"peak_memory_mb": [rank.peak_memory_mb for rank in ranks],
                        "step_time_median_s": medians,
                        "data_wait_fraction": [sum(r.data_waits) / sum(r.step_times) if r.step_times else None
                                               for r in ranks]},
        }


def percentile(values: List[float], fraction: float) -> Optional[float]:
    """The `fraction` quantile (nearest rank), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def compute_dtype(trainer: pl.Trainer) -> torch.dtype:
    """The dtype matrix multiplications run in, from the precision plugin."""
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"
