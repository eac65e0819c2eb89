"""What whole, verified checkpoint files cost: lightfleet's CheckpointIO (runner/rank/checkpoint_io.py:
a temporary file in the target's directory, flush + fsync, rename, directory fsync, then the sha256
manifest written the same way) against Lightning's TorchCheckpointIO (torch.save into memory, a
temporary file in the system temp directory, a move), on the same checkpoint, interleaved; and
lightfleet's with the fsyncs switched off, to say what the fsyncs cost apart from the digest.

    python bench/checkpoint.py                    # results in bench/checkpoint.json
    python bench/checkpoint.py --dir /scratch/x   # on the filesystem a run directory would be on
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List
from unittest import mock

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ when lightfleet is not installed
from bench.spawning import machine  # noqa: E402

from runner.rank.checkpoint_io import AtomicCheckpointIO  # noqa: E402


def checkpoint(megabytes: int) -> Dict:
    """A Lightning-shaped checkpoint: weights and Adam's two moments, in 4 MB tensors."""
    tensors = max(1, megabytes // 12)
    weights = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(tensors)}
    moments = {i: {"exp_avg": torch.randn(1024, 1024), "exp_avg_sq": torch.rand(1024, 1024)} for i in range(tensors)}
    return {"global_step": 100, "state_dict": weights, "optimizer_states": [{"state": moments}]}


def timed(save: Callable[[], None]) -> float:
    start = time.perf_counter()
    save()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory here)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[12, 120, 480], help="checkpoint sizes in MB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "checkpoint.json")
    args = parser.parse_args()
    where = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir or Path.cwd()))
    lightning, ours = TorchCheckpointIO(), AtomicCheckpointIO()

    def whole(path: Path) -> None:
        """lightfleet's save until on the disk: its writer thread's part waited for."""
        ours.save_checkpoint(state, path)
        ours.wait()

    def without_fsync() -> None:
        with mock.patch("os.fsync"):  # what the same writes take with the fsyncs left out
            whole(where / "ours_nofsync.ckpt")

    rows: List[Dict] = []
    for megabytes in args.sizes:
        state = checkpoint(megabytes)
        ways = {"lightning": lambda: lightning.save_checkpoint(state, where / "lightning.ckpt"),
                "lightfleet": lambda: whole(where / "ours.ckpt"),
                "lightfleet_without_fsync": without_fsync}
        times: Dict[str, List[float]] = {name: [] for name in ways}
        for round_ in range(args.rounds + 1):  # the first round warms the page cache and is dropped
            for name, save in ways.items():
                seconds = timed(save)
                if round_:
                    times[name].append(seconds)
        size = (where / "ours.ckpt").stat().st_size
        median = {name: statistics.median(values) for name, values in times.items()}
        row = {"bytes": size, **{f"{name}_s": value for name, value in median.items()},
               "ratio": median["lightfleet"] / median["lightning"],
               "fsyncs_share": (median["lightfleet"] - median["lightfleet_without_fsync"]) / median["lightfleet"]}
        rows.append(row)
        ms = {name: f"{value * 1e3:8.1f} ms" for name, value in median.items()}
        print(f"{size / 1e6:7.1f} MB  lightning {ms['lightning']}  lightfleet {ms['lightfleet']}  (without fsync "
              f"{ms['lightfleet_without_fsync']})  ratio {row['ratio']:.2f}  fsyncs {row['fsyncs_share']:.0%} of "
              f"lightfleet's time", flush=True)
        for name in ("lightning.ckpt", "ours.ckpt", "ours_nofsync.ckpt"):
            (where / name).unlink(missing_ok=True)
    for leftover in where.iterdir():
        leftover.unlink()
    where.rmdir()
    args.out.write_text(json.dumps({"machine": machine(), "dir_filesystem_of": str(args.dir or Path.cwd()),
                                    "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
