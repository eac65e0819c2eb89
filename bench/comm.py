"""Gradient-communication benchmark: what each DDP communication hook puts on the wire per
training step, against DDP's dense float32 all-reduce, in 2 processes over gloo.

    python bench/comm.py                        # every benchmark, results in bench/comm.json
    python bench/comm.py fp16_allreduce --steps 10 --out comm-fp16.json

The model is a ResNet-like gradient set (runner.models.ResNetClassifier, widths 64/128/256, two
blocks per stage: 2.8M parameters) trained with plain SGD on random 3x32x32 images, in
`torch.nn.parallel.DistributedDataParallel` with the hook registered (buffers not broadcast: only
gradient traffic counts). "Bytes sent" is, per step and per process, the size of the tensors the
hook hands to torch.distributed collectives (all_reduce, all_gather, broadcast, ...): its payload,
whatever algorithm (ring, tree) the backend then uses. Step times are printed for information
only: on a shared CPU machine they say little about a network.

Adding a benchmark is one entry in BENCHMARKS: a name and a hook factory with lightfleet's comm
hook contract, `factory() -> (state, hook)`, called once the process group exists.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ and plugins/ when lightfleet is not installed
from bench.spawning import free_port, machine  # noqa: E402

from plugins import fp16_allreduce  # noqa: E402
from runner.models import ResNetClassifier  # noqa: E402

HookFactory = Callable[[], Tuple[Any, Callable]]


def dgc_hook(sparsity: float = 0.999) -> Tuple[Any, Callable]:
    """DGC compressing from the first step at `sparsity` (goal at 0.999: <= 0.01 of allreduce's
    bytes, values + int32 indices). In a run replace_optimizer hands the model's SGD momentum to
    the hook state; this loop's SGD has none, so the state gets momentum 0.9 directly."""
    from plugins import dgc

    state, hook = dgc.build_hook(rampup_begin_step=0, rampup_step=1, sparsity=[sparsity])
    state.configure(momentum=0.9)
    return state, hook


BASELINE: Tuple[str, HookFactory] = ("allreduce", lambda: (None, allreduce_hook))  # what DDP does without a hook
BENCHMARKS: Dict[str, HookFactory] = {
    "fp16_allreduce": functools.partial(fp16_allreduce.build_hook, dtype="float16"),
    "fp16_allreduce(bfloat16)": functools.partial(fp16_allreduce.build_hook, dtype="bfloat16"),
    "dgc": dgc_hook,
}

WORLD_SIZE = 2
BATCH_SIZE = 8  # per process
WARMUP_STEPS = 1
# Collective -> position of the tensor a process contributes (all_gather's input is its 2nd argument).
SENT_ARGUMENT = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1,
                 "reduce_scatter_tensor": 1, "all_to_all_single": 1}


class CollectiveBytes:
    """Sums the bytes of the tensors handed to torch.distributed collectives while `active` (the
    real collectives run; hooks call them through the module, so they are seen)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.active = False
        for name, position in SENT_ARGUMENT.items():
            if hasattr(dist, name):
                setattr(dist, name, self._counting(getattr(dist, name), name, position))

    def _counting(self, collective: Callable, name: str, position: int) -> Callable:
        @functools.wraps(collective)
        def counting(*args, **kwargs):
            if self.active:
                sent = args[position] if len(args) > position else next(iter(kwargs.values()))
                tensors = sent if isinstance(sent, (list, tuple)) else [sent]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors)
                self.calls += 1
            return collective(*args, **kwargs)

        return counting


def measure(factory: HookFactory, steps: int, counter: CollectiveBytes, rank: int) -> Dict[str, float]:
    """Train `steps` steps (after warm-up) with the hook; bytes and seconds per step on this rank."""
    torch.manual_seed(0)  # same initial model in every process and for every hook
    model = ResNetClassifier(widths=(64, 128, 256), blocks_per_stage=2)
    with warnings.catch_warnings():  # torch 2.13 deprecates the argument, yet advises it to skip buffer syncs
        warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    state, hook = factory()
    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    sent, calls, seconds = [], [], []
    for step in range(WARMUP_STEPS + steps):
        inputs = torch.randn(BATCH_SIZE, 3, 32, 32, generator=data)
        targets = torch.randint(4, (BATCH_SIZE,), generator=data)
        counter.bytes = counter.calls = 0
        counter.active = step >= WARMUP_STEPS
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()
        elapsed = time.perf_counter() - start
        counter.active = False
        if step >= WARMUP_STEPS:
            sent.append(counter.bytes)
            calls.append(counter.calls)
            seconds.append(elapsed)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "bytes_per_step": statistics.mean(sent), "collective_calls_per_step": statistics.mean(calls),
            "seconds_per_step": statistics.median(seconds)}


def rank_main(rank: int, port: int, names: List[str], steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    counter = CollectiveBytes()
    factories = dict([BASELINE], **BENCHMARKS)
    results = {name: measure(factories[name], steps, counter, rank) for name in names}
    Path(f"{out}.rank{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()



def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmarks", nargs="*", choices=[[], *BENCHMARKS], metavar="NAME",
                        help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per hook (after 1 warm-up step)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "comm.json")
    args = parser.parse_args(argv)
    names = [BASELINE[0], *(args.benchmarks or BENCHMARKS)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results")
        mp.spawn(rank_main, args=(free_port(), names, args.steps, out), nprocs=WORLD_SIZE)
        ranks = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(WORLD_SIZE)]
    baseline = ranks[0][BASELINE[0]]["bytes_per_step"]
    results = {}
    for name in names:
        per_rank = [r[name] for r in ranks]
        bytes_per_step = max(r["bytes_per_step"] for r in per_rank)  # the busiest process
        results[name] = {**per_rank[0], "bytes_per_step": bytes_per_step,
                         "ratio_to_allreduce": bytes_per_step / baseline}
    record = {"world_size": WORLD_SIZE, "backend": "gloo", "steps": args.steps, "batch_size_per_process": BATCH_SIZE,
              "model": "ResNetClassifier(widths=(64, 128, 256), blocks_per_stage=2)",
              "machine": machine(),
              "results": results}
    print(f"{'hook':<28}{'bytes/step':>14}{'vs allreduce':>14}{'calls/step':>12}{'s/step':>9}")
    for name, r in results.items():
        print(f"{name:<28}{r['bytes_per_step']:>14,.0f}{r['ratio_to_allreduce']:>14.4f}"
              f"{r['collective_calls_per_step']:>12.1f}{r['seconds_per_step']:>9.3f}")
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
