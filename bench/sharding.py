"""Sharding memory benchmark: what each rank holds of parameters, gradients and optimizer states
under plain DDP and ZeRO stages 1-3 (plugins/sharding.py), next to the ZeRO paper's formulas for
mixed-precision Adam, in N processes over gloo on the CPU.

    python bench/sharding.py                          # N = 2 and 4, bfloat16, bench/sharding.json
    python bench/sharding.py --world-sizes 2 --dtype float32 --out sharding-fp32.json

The model is a GPT-style decoder (runner.models.GPTDecoder) trained with AdamW on random tokens,
in a plain loop built from the plugin's own pieces: DDP with gradients as bucket views and
`shard_optimizer_states` (stage 1), `apply_fsdp` (stages 2, 3). Bytes are those of the distinct
storages a rank holds (a DTensor: its local shard), read at three points of each step: after
forward (parameters, including those gathered for compute), after backward (gradients), and
after the optimizer step ("at rest": parameters, gradients before zero_grad, optimizer states).
"Peak" is the largest of parameters + gradients + optimizer states at those points; activations
and temporaries of the collectives are not counted (the CPU allocator keeps no statistics).

ZeRO's formulas (Rajbhandari et al. 2019, P parameters, N ranks, fp16 compute + fp32 Adam):
DDP 16P, stage 1 4P + 12P/N, stage 2 2P + 14P/N, stage 3 16P/N bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Dict, Iterable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ and plugins/ when lightfleet is not installed
from bench.spawning import free_port, machine  # noqa: E402

from plugins.sharding import apply_fsdp, shard_optimizer_states  # noqa: E402
from runner.models import GPTDecoder  # noqa: E402

MODEL = dict(vocab_size=1024, seq_len=64, d_model=256, n_heads=4, n_layers=4)
BATCH_SIZE = 4  # sequences per process
SEGMENT_MB = 4.0
STEPS = 3
STRATEGIES = ("ddp", "stage1", "stage2", "stage3")


def zero_formula(strategy: str, P: int, N: int) -> float:
    """Bytes per rank for mixed-precision Adam (fp16 params and grads, fp32 master + 2 moments)."""
    return {"ddp": 16 * P, "stage1": 4 * P + 12 * P / N, "stage2": 2 * P + 14 * P / N, "stage3": 16 * P / N}[strategy]


def held(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor: its local shard's)."""
    storages = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure(strategy: str, dtype: torch.dtype) -> Dict[str, float]:
    """Train STEPS steps with `strategy`; per-rank bytes of the last step."""
    torch.manual_seed(0)
    model = GPTDecoder(**MODEL)
    P = sum(p.numel() for p in model.parameters())
    mixed = dtype != torch.float32
    if strategy in ("ddp", "stage1"):
        with warnings.catch_warnings():  # torch 2.13 deprecates the argument it still advises
            warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
            trained = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if strategy == "stage1":
            optimizer = shard_optimizer_states(optimizer, dist.group.WORLD)
        # Mixed precision here is autocast: the float32 parameters are replicated and cast per op.
        autocast = torch.autocast("cpu", dtype=dtype, enabled=mixed)
    else:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
        apply_fsdp(model, mesh, reshard_after_forward=strategy == "stage3", segment_bytes=SEGMENT_MB * 2 ** 20,
                   param_dtype=dtype if mixed else None)
        trained = model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        autocast = torch.autocast("cpu", enabled=False)  # FSDP's MixedPrecisionPolicy casts the gathered parameters
    shards = list(model.parameters())  # what the optimizer steps: at stages 2/3 the sharded float32 masters
    local = getattr(optimizer, "optim", optimizer)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        tokens = torch.randint(MODEL["vocab_size"], (BATCH_SIZE, MODEL["seq_len"] + 1), generator=generator)
        optimizer.zero_grad()
        with autocast:
            logits = trained(tokens[:, :-1])
        params_forward = held([*shards, *model.parameters()])  # the shards plus what is gathered now
        F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)).backward()
        grads = held(p.grad for p in shards if p.grad is not None)
        params_backward = held([*shards, *model.parameters()])
        optimizer.step()
        states = held(t for s in local.state.values() for t in s.values() if torch.is_tensor(t))
        params_rest = held(shards)
    phases = {"after_forward": params_forward + states,  # last step's states existed already
              "after_backward": params_backward + grads + states,
              "at_rest": params_rest + grads + states}
    return {"parameters": P, "params_at_rest": params_rest, "params_after_forward": params_forward,
            "grads": grads, "optimizer_states": states, "total_at_rest": phases["at_rest"],
            "peak_model_state": max(phases.values())}


def rank_main(rank: int, world_size: int, port: int, dtype: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # torch 2.13 warns of every view a wrapped module returns; GPTDecoder changes none in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {name: measure(name, getattr(torch, dtype)) for name in STRATEGIES}
    Path(f"{out}.rank{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()



def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], metavar="N",
                        help="numbers of processes (default: 2 4)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                        help="compute dtype (default bfloat16; float32 trains without mixed precision)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "sharding.json")
    args = parser.parse_args(argv)
    record = {"command": " ".join(["python", "bench/sharding.py", *(argv if argv is not None else sys.argv[1:])]),
              "model": f"GPTDecoder({', '.join(f'{k}={v}' for k, v in MODEL.items())})", "dtype": args.dtype,
              "backend": "gloo", "steps": STEPS, "batch_size_per_process": BATCH_SIZE, "segment_MB": SEGMENT_MB,
              "machine": machine(),
              "results": {}}
    for world_size in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results")
            mp.spawn(rank_main, args=(world_size, free_port(), args.dtype, out), nprocs=world_size)
            ranks = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(world_size)]
        P = ranks[0]["ddp"]["parameters"]
        print(f"N={world_size}, P={P:,} parameters, {args.dtype}; MB per rank (the busiest rank)")
        print(f"{'':8}{'params':>9}{'gathered':>10}{'grads':>9}{'optim':>9}{'at rest':>9}{'peak':>9}"
              f"{'ZeRO':>9}{'peak/ZeRO':>11}")
        results = {}
        for name in STRATEGIES:
            r = {key: max(rank[name][key] for rank in ranks) for key in ranks[0][name]}
            r["zero_formula"] = zero_formula(name, P, world_size)
            r["peak_over_formula"] = round(r["peak_model_state"] / r["zero_formula"], 3)
            results[name] = r
            mb = [r[k] / 2 ** 20 for k in ("params_at_rest", "params_after_forward", "grads", "optimizer_states",
                                           "total_at_rest", "peak_model_state", "zero_formula")]
            print(f"{name:8}" + "".join(f"{v:>9.2f}" for v in mb[:1]) + f"{mb[1]:>10.2f}"
                  + "".join(f"{v:>9.2f}" for v in mb[2:]) + f"{r['peak_over_formula']:>11.3f}")
        record["results"][str(world_size)] = results
    print("ZeRO's formulas count fp16 parameters and gradients; here the sharded masters are float32, "
          "the gathered compute copies bfloat16/float16 (MixedPrecisionPolicy) and the gradients float32, "
          "so at rest every stage 2/3 rank holds 16P/N and stage 2 adds the gathered 2P during forward/backward "
          "(2P + 16P/N: ZeRO's 2P + 14P/N with float32 instead of fp16 gradient shards); stages 1 and DDP "
          "keep float32 parameters and gradients replicated under autocast (8P + 8P/N for stage 1, 16P for DDP).")
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written: {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
