"""What preemption costs a run that is never preempted: the ranks agree after every optimizer
step whether any of them got a signal (runner/rank/preemption.py: `Preemption.agreed`, one all-reduce
of a small tensor), and whether a loss was non-finite (runner/rank/divergence.py: the guard notes
each loss and folds it into the vote). Measured side by side in 2 processes over gloo: blocks of training
steps of the quickstart MLP (runner.models.MLPClassifier, batch 64 per process, DDP) with the
agreement after each step and without it, interleaved; the ratio is the median over the pairs.

    python bench/preemption.py                 # results in bench/preemption.json
    python bench/preemption.py --pairs 5 --steps 50
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ and plugins/ when lightfleet is not installed
from bench.spawning import free_port, machine  # noqa: E402

from runner.models import MLPClassifier  # noqa: E402
from runner.rank.preemption import Preemption  # noqa: E402

WORLD_SIZE, BATCH_SIZE = 2, 64


def rank_main(rank: int, port: int, pairs: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 processes on a 2-core machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(rank)
    model = torch.nn.parallel.DistributedDataParallel(MLPClassifier())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs, labels = torch.randn(BATCH_SIZE, 32), torch.randint(4, (BATCH_SIZE,))
    preemption = Preemption(Path(out) / "unused.ckpt")
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))  # what `agreed` reads

    def block(agree: bool) -> float:
        dist.barrier()
        started = time.perf_counter()
        for step in range(steps):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            if agree:  # as Preemption.on_train_batch_end does
                preemption.guard.note({"loss": loss})
                preemption.guard.fold(step + 1)
                assert not preemption.agreed(trainer)
        return time.perf_counter() - started

    block(True), block(False)  # warm-up
    times: Dict[str, List[float]] = {"with": [], "without": []}
    for _ in range(pairs):
        times["with"].append(block(True))
        times["without"].append(block(False))
    agreements = []
    for _ in range(pairs):  # the agreement alone, for its absolute cost
        dist.barrier()
        started = time.perf_counter()
        for _ in range(steps):
            preemption.agreed(trainer)
        agreements.append((time.perf_counter() - started) / steps)
    Path(f"{out}.rank{rank}").write_text(json.dumps({**times, "agreement_s": agreements}))
    dist.destroy_process_group()


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=15, help="interleaved (with, without) blocks")
    parser.add_argument("--steps", type=int, default=100, help="training steps per block")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "preemption.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results")
        mp.spawn(rank_main, args=(free_port(), args.pairs, args.steps, out), nprocs=WORLD_SIZE)
        ranks: List[Dict[str, Any]] = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(WORLD_SIZE)]
    ratios = [w / wo for w, wo in zip(ranks[0]["with"], ranks[0]["without"])]
    step_s = statistics.median(ranks[0]["without"]) / args.steps
    agreement_s = statistics.median(ranks[0]["agreement_s"])
    record = {"world_size": WORLD_SIZE, "backend": "gloo", "pairs": args.pairs, "steps_per_block": args.steps,
              "model": "MLPClassifier() (quickstart), batch 64 per process", "machine": machine(),
              "ratio_with_to_without": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
              "step_ms": step_s * 1e3, "agreement_us": agreement_s * 1e6}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"steps with the agreement / without: {record['ratio_with_to_without']:.3f} (median of {args.pairs} "
          f"pairs, range {min(ratios):.3f}-{max(ratios):.3f}); a step {record['step_ms']:.2f} ms, "
          f"the agreement alone {record['agreement_us']:.0f} us; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
