"""One command that checks lightfleet on a GPU in one go (about 7 minutes on one H100/H200):

1. Throughput against plain PyTorch loops, in this one process, each side built afresh, the order
   alternating round by round, eager and compiled:
   - GPT-2 124M: `experiment=gpt2_124m` (transformers' GPT-2 built from its config, bf16 autocast,
     AdamW, clip 1.0, random windows of a uint16 token file), 4 micro-batches of 12 x 1,024 tokens a
     step, against nanoGPT's loop (GPT2LMHeadModel, fused AdamW, the next batch fetched while the
     device computes, pinned non-blocking copies);
   - ResNet-50: `model=vision data=images` at 224 px, batch 128, `strategy=[amp]` (float16 with
     GradScaler), against torchvision's reference loop (channels_last, cudnn.benchmark, momentum
     SGD, a DataLoader with workers and pinned memory, non-blocking copies).
   lightfleet runs through its command (`runner.command.cli.main`) as a user runs it: its
   defaults, the steps bar, the CSV logger and checkpointing on (validation off, as the plain
   loops do none); throughput, MFU and peak memory are its own figures (results.yaml), the plain
   loops' are timed the same way (bench/throughput.py's Window).
2. auto's memory estimates for the eager runs, planned for CUDA, against the peaks they measured.
3. `python -m pytest -m gpu` on the test modules that hold GPU tests.

Prints one table of ratios and writes bench/gpu.json (--out). It runs on the GPU machine's own
torch; what that machine lacks travels as wheels, installed here from --wheels DIR (made on any
machine with pip, for the GPU machine's Python):

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        -d .whl hydra-core==1.3.8 omegaconf==2.3.1 torchdata==0.11.0
    pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3

    python bench/gpu.py --wheels .whl            # everything, CUDA only
    python bench/gpu.py --only gpt,memory        # some parts: gpt, resnet, compiled, memory, tests
    python bench/gpu.py --smoke                  # every code path on a CPU, tiny sizes (a rehearsal)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("gpt", "resnet", "memory", "compiled", "tests")
# The test modules that hold GPU tests (collecting only these keeps the sweepers' and Paddle's
# imports, which the GPU machine may lack, out of the run).
GPU_TESTS = ["tests/test_gpu.py", "tests/plugins/test_collective.py", "tests/plugins/test_sharding.py"]
NO_VALIDATION = ["trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0"]  # the plain loops validate nothing


def install_wheels(folder: Path) -> None:
    """Install the wheels of `folder` into a scratch directory first on this process's path and on
    its children's (PYTHONPATH); nothing is downloaded."""
    target = Path(tempfile.gettempdir()) / "lightfleet-bench-wheels"
    wheels = sorted(str(wheel) for wheel in folder.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(target), *wheels], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), str(ROOT), os.environ.get("PYTHONPATH")]))


@dataclass(frozen=True)
class Sizes:
    """What both sides of a model train: the full sizes on a GPU, tiny ones for --smoke."""

    device: str
    steps: int
    warmup: int
    rounds: int
    gpt: Dict[str, int]  # d_model, n_layers, n_heads, vocab_size, seq_len, batch, k_steps
    resnet: Dict[str, Any]  # arch, image_size, batch, num_classes

    @property
    def accelerator(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"


FULL = Sizes("cuda", steps=20, warmup=5, rounds=2,
             gpt={"d_model": 768, "n_layers": 12, "n_heads": 12, "vocab_size": 50304, "seq_len": 1024, "batch": 12,
                  "k_steps": 4},
             resnet={"arch": "resnet50", "image_size": 224, "batch": 128, "num_classes": 1000})
SMOKE = Sizes("cpu", steps=4, warmup=1, rounds=2,
              gpt={"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 512, "seq_len": 64, "batch": 4,
                   "k_steps": 2},
              resnet={"arch": "resnet18", "image_size": 32, "batch": 8, "num_classes": 10})


@dataclass
class Bench:
    sizes: Sizes
    work: Path
    deadline: float
    out: Path
    results: Dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """Write what is measured so far (a run stopped by a time limit keeps it)."""
        self.out.write_text(json.dumps(self.results, indent=1, default=str))


# --------------------------------------------------------------------------- lightfleet's side


def lightfleet(bench: Bench, name: str, overrides: List[str]) -> Dict[str, Any]:
    """Run the lightfleet command in this process; its results.yaml."""
    import yaml

    from runner.command.cli import main

    run_dir = bench.work / f"{name}-{time.monotonic_ns()}"
    args = [*overrides, *NO_VALIDATION, f"trainer.accelerator={bench.sizes.accelerator}", "trainer.devices=1",
            f"trainer.max_steps={bench.sizes.steps}", f"measure.warmup_steps={bench.sizes.warmup}",
            f"paths.output_dir={run_dir}"]
    try:
        code = main(args)
    except SystemExit as stop:
        code = stop.code
    if code:
        raise RuntimeError(f"lightfleet exited with {code} ({name}: {' '.join(overrides)}); its log: {run_dir}")
    return yaml.safe_load((run_dir / "results.yaml").read_text())


def gpt_overrides(bench: Bench) -> List[str]:
    gpt = bench.sizes.gpt
    return ["experiment=gpt2_124m", f"data.train_bin={bench.work / 'train.bin'}", f"data.val_bin={bench.work / 'val.bin'}",
            f"data.seq_len={gpt['seq_len']}", f"data.batch_size={gpt['batch']}", f"model.vocab_size={gpt['vocab_size']}",
            f"model.d_model={gpt['d_model']}", f"model.n_layers={gpt['n_layers']}", f"model.n_heads={gpt['n_heads']}",
            f"strategy.gradient_merge.k_steps={gpt['k_steps']}"]


def resnet_overrides(bench: Bench) -> List[str]:
    resnet = bench.sizes.resnet
    size = resnet["image_size"]
    return ["model=vision", f"model.arch={resnet['arch']}", f"model.num_classes={resnet['num_classes']}",
            "data=images", f"data.input_shape=[3,{size},{size}]", f"data.num_classes={resnet['num_classes']}",
            f"data.batch_size={resnet['batch']}", f"data.num_train={images_in_one_epoch(bench)}",
            f"data.num_val={resnet['batch']}", f"data.num_test={resnet['batch']}", "strategy=[amp]"]


def images_in_one_epoch(bench: Bench) -> int:
    """Every step in one epoch: no epoch's end inside the measured steps, on either side."""
    return bench.sizes.resnet["batch"] * (bench.sizes.steps + 1)


# --------------------------------------------------------------------------- the plain loops


def plain_gpt(bench: Bench, compiled: bool) -> Dict[str, Any]:
    """nanoGPT's training loop over transformers' GPT2LMHeadModel."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from bench.throughput import Window
    from runner.rank.measure import peak_flops

    gpt, device = bench.sizes.gpt, torch.device(bench.sizes.device)
    config = GPT2Config(vocab_size=gpt["vocab_size"], n_positions=gpt["seq_len"], n_embd=gpt["d_model"],
                        n_layer=gpt["n_layers"], n_head=gpt["n_heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    forward = torch.compile(model) if compiled else model
    tokens = np.memmap(bench.work / "train.bin", dtype=np.uint16, mode="r")
    block, batch, k = gpt["seq_len"], gpt["batch"], gpt["k_steps"]

    def get_batch() -> Any:
        starts = torch.randint(len(tokens) - block - 1, (batch,))
        x = torch.stack([torch.from_numpy(tokens[i:i + block].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(tokens[i + 1:i + 1 + block].astype(np.int64)) for i in starts])
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    weights = sum(p.numel() for part in (model.transformer.h, model.transformer.ln_f, model.lm_head)
                  for p in part.parameters())
    flops_per_token = 6 * weights + 12 * gpt["n_layers"] * gpt["d_model"] * block  # runner/models/causal_lm.py's
    reset_peak(device)
    window = Window(bench.sizes.warmup, bench.sizes.steps)
    x, y = get_batch()
    for step in range(1, bench.sizes.steps + 1):
        for _ in range(k):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = forward(x).logits
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / k
            x, y = get_batch()  # while the device computes
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.step_done(step, batch * k, device)
    samples_per_s = window.figures()["samples_per_s"]
    peak = peak_flops(device, torch.bfloat16)
    return {"samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * block,
            "mfu": flops_per_token * samples_per_s * block / peak if peak else None, **peak_memory(device)}


def plain_resnet(bench: Bench, compiled: bool) -> Dict[str, Any]:
    """torchvision's reference training loop (amp, channels_last, cudnn.benchmark) over the same
    synthetic images lightfleet's data=images draws."""
    import torch
    import torch.nn.functional as F
    import torchvision
    from torch.utils.data import DataLoader

    from bench.throughput import Window
    from runner.data import SyntheticClassificationData
    from runner.data.loading import AUTO_WORKERS

    resnet, device = bench.sizes.resnet, torch.device(bench.sizes.device)
    cuda = device.type == "cuda"
    size = resnet["image_size"]
    data = SyntheticClassificationData(input_shape=(3, size, size), num_classes=resnet["num_classes"],
                                       num_train=images_in_one_epoch(bench), num_val=1, num_test=1)
    data.setup()
    loader = DataLoader(data.train_set, batch_size=resnet["batch"], shuffle=True, drop_last=True, pin_memory=cuda,
                        num_workers=AUTO_WORKERS if cuda else 0, persistent_workers=cuda)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.get_model(resnet["arch"], num_classes=resnet["num_classes"]).to(device)
    model = model.to(memory_format=torch.channels_last) if cuda else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)
    forward = torch.compile(model) if compiled else model
    reset_peak(device)
    window = Window(bench.sizes.warmup, bench.sizes.steps)
    for step, (images, labels) in enumerate(loader, start=1):
        images = images.to(device, non_blocking=True)
        images = images.contiguous(memory_format=torch.channels_last) if cuda else images
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.float16 if cuda else torch.bfloat16):
            loss = F.cross_entropy(forward(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        window.step_done(step, len(images), device)
        if step == bench.sizes.steps:
            break
    return {"samples_per_s": window.figures()["samples_per_s"], **peak_memory(device)}


def reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: Any) -> Dict[str, Optional[float]]:
    import torch

    return {"peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}


# --------------------------------------------------------------------------- the parts


def side_by_side(bench: Bench, name: str, ours: Callable[[], Dict[str, Any]], plain: Callable[[], Dict[str, Any]],
                 rounds: int) -> Dict[str, Any]:
    """`rounds` rounds of both sides, who goes first alternating; lightfleet / plain per round
    (each side's figures saved as soon as it has them, under `name`)."""
    figures: Dict[str, List[Dict[str, Any]]] = {"lightfleet": [], "plain": []}
    bench.results[name] = figures
    for round_ in range(rounds):
        order = [("lightfleet", ours), ("plain", plain)]
        for side, run in order if round_ % 2 == 0 else order[::-1]:
            print(f"bench/gpu.py: {name}, round {round_ + 1}: {side}", flush=True)
            figures[side].append(run())
            bench.save()
            release_memory()
    ratios = [ours_["samples_per_s"] / plain_["samples_per_s"] for ours_, plain_ in zip(figures["lightfleet"],
                                                                                        figures["plain"])]
    return {"ratio": statistics.median(ratios), "ratios": ratios, **figures}


def release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def part_gpt(bench: Bench, compiled: bool = False) -> Dict[str, Any]:
    extra = [f"fast_path.compile={str(compiled).lower()}"]  # experiments/gpt2_124m.yaml compiles
    return side_by_side(bench, "compiled_gpt" if compiled else "gpt",
                        lambda: lightfleet(bench, "gpt", [*gpt_overrides(bench), *extra]),
                        lambda: plain_gpt(bench, compiled), 1 if compiled else bench.sizes.rounds)


def part_resnet(bench: Bench, compiled: bool = False) -> Dict[str, Any]:
    extra = [f"fast_path.compile={str(compiled).lower()}"]
    return side_by_side(bench, "compiled_resnet" if compiled else "resnet",
                        lambda: lightfleet(bench, "resnet", [*resnet_overrides(bench), *extra]),
                        lambda: plain_resnet(bench, compiled), 1 if compiled else bench.sizes.rounds)


def part_memory(bench: Bench) -> Dict[str, Any]:
    """auto's estimate, planned for CUDA, of each eager run against the peak lightfleet measured."""
    from bench.auto_memory import estimate_for

    measured = {"gpt": bench.results.get("gpt"), "resnet": bench.results.get("resnet")}
    overrides = {"gpt": gpt_overrides(bench), "resnet": resnet_overrides(bench)}
    found = {}
    for name, run in measured.items():
        if not run or "lightfleet" not in run:  # the part failed or did not run
            continue
        peak_mb = max(side["peak_memory_mb"] for side in run["lightfleet"])
        estimate = estimate_for([*overrides[name], "trainer.accelerator=gpu"])
        found[name] = {"estimate_gib": estimate["total"] / 2**30, "measured_gib": peak_mb / 2**10,
                       "ratio": estimate["total"] / 2**20 / peak_mb if peak_mb else None, "parts": estimate}
    return found


def part_tests(bench: Bench) -> Dict[str, Any]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *GPU_TESTS],
                          cwd=ROOT, capture_output=True, text=True, timeout=max(30, bench.left()))
    lines = (done.stdout + done.stderr).strip().splitlines()
    print("\n".join(lines[-25:]), flush=True)
    return {"returncode": done.returncode, "summary": lines[-1] if lines else "", "seconds": time.monotonic() - started}


# --------------------------------------------------------------------------- main


def make_tokens(folder: Path, vocab: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for name, count in (("train.bin", 20_000_000), ("val.bin", 200_000)):
        rng.integers(0, min(vocab, 50257), count, dtype=np.uint16).tofile(folder / name)


def table(results: Dict[str, Any]) -> str:
    rows = ["| what | lightfleet | plain loop | ratio |", "|---|---|---|---|"]
    for name, unit in (("gpt", "tokens_per_s"), ("compiled_gpt", "tokens_per_s"), ("resnet", "samples_per_s"),
                       ("compiled_resnet", "samples_per_s")):
        run = results.get(name)
        if not run or not run.get("lightfleet"):
            continue
        ours = ", ".join(f"{side[unit]:,.0f}" + (f" (MFU {side['mfu']:.1%})" if side.get("mfu") else "")
                         for side in run["lightfleet"])
        plain = ", ".join(f"{side[unit]:,.0f}" + (f" (MFU {side['mfu']:.1%})" if side.get("mfu") else "")
                          for side in run["plain"])
        ratio = f"{run['ratio']:.3f}" if "ratio" in run else ""
        rows.append(f"| {name} {unit.replace('_per_s', '/s')} | {ours} | {plain} | {ratio} |")
        waits = ", ".join(f"{side.get('data_wait_fraction') or 0:.1%} / {side.get('device_idle_fraction') or 0:.1%}"
                          for side in run["lightfleet"])
        rows.append(f"| {name}: waiting for data / device idle (lightfleet) | {waits} | | |")
    memories = results.get("memory", {})
    for name, memory in (memories.items() if "failed" not in memories else ()):
        rows.append(f"| auto's estimate, {name} (GiB) | {memory['estimate_gib']:.2f} | measured "
                    f"{memory['measured_gib']:.2f} | {memory['ratio']:.3f} |")
    if "summary" in results.get("tests", {}):
        rows.append(f"| pytest -m gpu | {results['tests']['summary']} | | |")
    rows += [f"| {name}: {run['failed']} | | | |" for name, run in results.items()
             if isinstance(run, dict) and "failed" in run]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: a rehearsal of every code path")
    parser.add_argument("--wheels", type=Path, help="a folder of wheels to install first (what the GPU machine lacks)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="no part starts after this many seconds")
    parser.add_argument("--rounds", type=int, help="rounds of each eager comparison (default: 2 on a GPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "gpu.json")
    args = parser.parse_args()
    if args.wheels:
        install_wheels(args.wheels)
    sys.path.insert(0, str(ROOT))
    import torch

    sizes = SMOKE if args.smoke else FULL
    sizes = replace(sizes, rounds=args.rounds or sizes.rounds)
    if sizes.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device (--smoke rehearses on a CPU)")
    parts = [part for part in args.only.split(",") if part]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        bench = Bench(sizes, Path(scratch), started + args.budget_s, args.out)
        make_tokens(bench.work, sizes.gpt["vocab_size"])
        bench.results["machine"] = {"device": torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu",
                                    "torch": torch.__version__, "smoke": args.smoke,
                                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        steps = [("gpt", "gpt", lambda: part_gpt(bench)), ("resnet", "resnet", lambda: part_resnet(bench)),
                 ("memory", "memory", lambda: part_memory(bench)),
                 ("compiled_gpt", "compiled", lambda: part_gpt(bench, compiled=True)),
                 ("tests", "tests", lambda: part_tests(bench)),
                 ("compiled_resnet", "compiled", lambda: part_resnet(bench, compiled=True))]
        for name, part, run in steps:
            if part not in parts:
                continue
            if bench.left() <= 0:
                bench.results[name] = {"skipped": "out of time (--budget-s)"}
                continue
            try:
                bench.results[name] = run()
            except Exception as error:  # noqa: BLE001 (one part's failure is a result; the others still run)
                bench.results.setdefault(name, {})["failed"] = f"{type(error).__name__}: {error}"  # beside what it measured
                print(f"bench/gpu.py: {name} failed: {error}", flush=True)
            bench.results["wall_s"] = time.monotonic() - started
            bench.save()
    print(table(bench.results))
    print(f"bench/gpu.py: {time.monotonic() - started:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
