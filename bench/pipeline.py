"""Pipeline schedules benchmark: peak activation memory per stage of 1F1B against GPipe, and the
measured pipeline bubble against the theoretical (p - 1) / (m + p - 1), in 2 processes over gloo.

    python bench/pipeline.py                        # results in bench/pipeline.json
    python bench/pipeline.py --micro-batches 16 --steps 5 --out pipeline-16.json

Both schedules train the same model (runner.models.MLPClassifier, hidden 512, 8 blocks) with the
real Lightning Trainer and plugins.pipeline's strategy (2 stages, one per process), alternating
1F1B, GPipe, 1F1B, ... step by step in one run. Per stage and step:
- activation memory: the bytes of the tensors autograd saves for backward that are alive at once
  (`SavedActivationBytes`, through saved-tensor hooks; parameters left out), at its peak;
- bubble: 1 - busy / step time, where busy is the time the stage spends in its forward and
  backward compute (timestamps around the torch stage's forward_one_chunk and
  backward_one_chunk), step time is the whole schedule step. Waiting for the other stage and the
  p2p transfers count as idle, so on CPU the measured bubble is above the theoretical one.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Dict, List

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ and plugins/ when lightfleet is not installed
from bench.spawning import machine  # noqa: E402

WORLD_SIZE = 2
SCHEDULES = ("1F1B", "GPipe")


class _Saved:
    """What the pack hook hands autograd: the saved tensor, counted until autograd drops it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivationBytes:
    """Peak bytes of the tensors autograd saves for backward that are alive at once, while used
    as `torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)`. A storage saved
    several times counts once; `parameters` (saved by reference, not activations) are left out."""

    def __init__(self, parameters: List[torch.Tensor]) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.saved: Dict[int, int] = {}  # storage address -> how many saves hold it
        self.current = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self.parameters:
            return tensor
        if not self.saved.get(address):
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.saved[address] = self.saved.get(address, 0) + 1
        packed = _Saved(tensor)
        weakref.finalize(packed, self._release, address, storage.nbytes())
        return packed

    def _release(self, address: int, nbytes: int) -> None:
        self.saved[address] -= 1
        if not self.saved[address]:
            self.current -= nbytes

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed


class StageProbe:
    """Per training step of this rank: peak saved-activation bytes, and the seconds of the
    schedule step and of its stages' forward and backward compute within it."""

    def __init__(self) -> None:
        self.steps: List[Dict[str, float]] = []

    def attach(self, strategy: Any, model: torch.nn.Module) -> None:
        for stage in strategy.stages:
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "busy")
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "busy")
        strategy.schedule.step = self._timed(strategy.schedule.step, "step", measure_memory=model)

    def _timed(self, method: Any, key: str, measure_memory: Any = None) -> Any:
        @functools.wraps(method)
        def timed(*args, **kwargs):
            if measure_memory is not None:
                self.steps.append({"busy": 0.0})
                meter = SavedActivationBytes(list(measure_memory.parameters()))
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                    start = time.perf_counter()
                    result = method(*args, **kwargs)
                self.steps[-1]["peak_bytes"] = meter.peak
            else:
                start = time.perf_counter()
                result = method(*args, **kwargs)
            self.steps[-1][key] = self.steps[-1].get(key, 0.0) + time.perf_counter() - start
            return result

        return timed


def worker(schedules: List[str], micro_batches: int, micro_batch_size: int, steps: int, repeats: int,
           out: Path) -> None:
    """One pipeline rank (run under torch.distributed.run): `repeats` rounds of one fit per schedule."""
    import pytorch_lightning as pl
    import torch.distributed as dist

    from plugins.pipeline import build_pipeline, split_stages
    from plugins.transforms import transform_in_configure_model
    from runner.data import SyntheticClassificationData
    from runner.models import MLPClassifier

    torch.set_num_threads(1)
    records: Dict[str, List[Dict[str, float]]] = {name: [] for name in schedules}

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.probe = StageProbe()

        def on_train_start(self, trainer, pl_module) -> None:
            self.probe.attach(trainer.strategy, pl_module)

    for _ in range(repeats):
        for name in schedules:
            pl.seed_everything(0, verbose=False)
            model = MLPClassifier(hidden_dim=512, num_blocks=8)
            transform_in_configure_model(model, [(split_stages, {"split_points": []})])
            callback = Probe()
            layout = {"dp_replicate": 1, "dp_shard": 1, "pp": WORLD_SIZE, "tp": 1}
            strategy = build_pipeline(name, micro_batch_size, micro_batches, vpp_degree=1, layout=layout,
                                      shard_optimizer_states=False)
            trainer = pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, max_steps=steps + 1, limit_val_batches=0,
                                 strategy=strategy,
                                 callbacks=[callback], logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out.parent))
            data = SyntheticClassificationData(batch_size=micro_batch_size * micro_batches,
                                               num_train=micro_batch_size * micro_batches * (steps + 1))
            trainer.fit(model, datamodule=data)
            records[name] += callback.probe.steps[1:]  # the first step allocates the p2p buffers
    out.with_suffix(f".rank{dist.get_rank()}").write_text(json.dumps(records))


def summarize(ranks: List[Dict[str, List[Dict[str, float]]]], micro_batches: int) -> Dict[str, Any]:
    stages = len(ranks)
    theory = (stages - 1) / (micro_batches + stages - 1)
    results: Dict[str, Any] = {}
    for name in ranks[0]:
        per_stage = []
        for steps in (rank[name] for rank in ranks):
            per_stage.append({"peak_activation_bytes": max(s["peak_bytes"] for s in steps),
                              "step_seconds": statistics.median(s["step"] for s in steps),
                              "bubble_measured": statistics.median(1 - s["busy"] / s["step"] for s in steps)})
        results[name] = {"stages": per_stage, "bubble_theoretical": theory}
    first, second = results["1F1B"]["stages"], results["GPipe"]["stages"]
    results["activation_ratio_1F1B_over_GPipe"] = [a["peak_activation_bytes"] / b["peak_activation_bytes"]
                                                   for a, b in zip(first, second)]
    return results


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (m)")
    parser.add_argument("--micro-batch-size", type=int, default=32, help="samples per micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per fit (after 1 warm-up step)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of 1F1B, GPipe fits, interleaved")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "pipeline.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set when launched as a rank
    args = parser.parse_args(argv)
    if args.worker:
        worker(list(SCHEDULES), args.micro_batches, args.micro_batch_size, args.steps, args.repeats, args.worker)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp) / "records"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
            "PYTHONPATH", "")])}
        for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            env.pop(var, None)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={WORLD_SIZE}", __file__, "--worker", str(records),
                        "--micro-batches", str(args.micro_batches), "--micro-batch-size", str(args.micro_batch_size),
                        "--steps", str(args.steps), "--repeats", str(args.repeats)],
                       env=env, check=True, capture_output=True)
        ranks = [json.loads(records.with_suffix(f".rank{rank}").read_text()) for rank in range(WORLD_SIZE)]
    results = summarize(ranks, args.micro_batches)
    record = {"world_size": WORLD_SIZE, "backend": "gloo", "stages": WORLD_SIZE, "micro_batches": args.micro_batches,
              "micro_batch_size": args.micro_batch_size, "steps": args.steps, "repeats": args.repeats,
              "model": "MLPClassifier(hidden_dim=512, num_blocks=8)",
              "bubble_method": "1 - (stage forward + backward compute time) / schedule step time, per stage",
              "machine": machine(),
              "results": results}
    print(f"{'schedule':<10}{'stage':>6}{'peak activations':>18}{'step s':>9}{'bubble':>9}{'theory':>9}")
    for name in SCHEDULES:
        for stage, r in enumerate(results[name]["stages"]):
            print(f"{name:<10}{stage:>6}{r['peak_activation_bytes']:>18,}{r['step_seconds']:>9.3f}"
                  f"{r['bubble_measured']:>9.3f}{results[name]['bubble_theoretical']:>9.3f}")
    print("1F1B / GPipe peak activations per stage: "
          + ", ".join(f"{ratio:.3f}" for ratio in results["activation_ratio_1F1B_over_GPipe"]))
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
