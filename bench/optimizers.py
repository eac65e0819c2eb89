"""One optimizer step of plugins.lars.LARS and plugins.lamb.LAMB (torch._foreach_* over all
tensors) against a per-parameter Python loop of the same formulas, as a naive implementation
writes it, on ResNet-50's parameter tensors (161 tensors, 25.6M parameters, shapes built here:
no torchvision) with random gradients.

Both sides run interleaved (foreach, loop, foreach, loop, ...) from identical parameters with
the same gradients; each ratio is the median over the back-to-back pairs of loop/foreach. The
script checks that both sides end with the same parameters. Default torch threads.

    python bench/optimizers.py                          # 9 repeats, bench/optimizers.json
    python bench/optimizers.py --repeats 5 --out optimizers-full.json --width-divisors 1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plugins.lamb import LAMB  # noqa: E402
from plugins.lars import LARS  # noqa: E402
from runner.strategies.lamb import LambConfig  # noqa: E402
from runner.strategies.lars import LarsConfig  # noqa: E402


def default_knobs(config: Any) -> Dict[str, Any]:
    """The strategy's default knobs but its exclusion list (the tensors here have no names)."""
    knobs = asdict(config)
    del knobs["exclude_from_weight_decay"]
    return knobs


LARS_KNOBS = dict(lr=0.1, momentum=0.9, **default_knobs(LarsConfig()))
LAMB_KNOBS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, **default_knobs(LambConfig()))


def resnet50_shapes(width_divisor: int = 1, num_classes: int = 1000) -> List[Tuple[int, ...]]:
    """The parameter shapes of torchvision's resnet50, in its order: stem conv + bn, then
    bottleneck blocks [3, 4, 6, 3] (1x1, 3x3, 1x1 convs each with a bn; a 1x1 conv + bn
    downsample in each stage's first block), then the fc layer. `width_divisor` divides every
    channel count (the same 161 tensors, each smaller)."""
    shapes: List[Tuple[int, ...]] = []
    k = width_divisor

    def conv_bn(out_channels: int, in_channels: int, kernel: int) -> None:
        shapes.extend([(out_channels, in_channels, kernel, kernel), (out_channels,), (out_channels,)])

    conv_bn(64 // k, 3, 7)
    in_channels = 64 // k
    for width, blocks in ((64 // k, 3), (128 // k, 4), (256 // k, 6), (512 // k, 3)):
        for index in range(blocks):
            conv_bn(width, in_channels, 1)
            conv_bn(width, width, 3)
            conv_bn(4 * width, width, 1)
            if index == 0:
                conv_bn(4 * width, in_channels, 1)
            in_channels = 4 * width
    shapes.extend([(num_classes, in_channels), (num_classes,)])
    return shapes


# ----------------------------------------------------------------- naive per-parameter loops


def loop_lars_step(params, grads, buffers, lr, momentum, lars_coeff, lars_weight_decay, epsilon) -> None:
    for w, g, v in zip(params, grads, buffers):
        w_norm, g_norm = torch.norm(w), torch.norm(g)
        if w_norm > 0 and g_norm > 0:
            local_lr = lr * lars_coeff * w_norm / (g_norm + lars_weight_decay * w_norm + epsilon)
        else:
            local_lr = lr
        v.mul_(momentum).add_(local_lr * (g + lars_weight_decay * w))
        w.sub_(v)


def loop_lamb_step(params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps, lamb_weight_decay) -> None:
    beta1, beta2 = betas
    for w, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m_hat = m / (1 - beta1 ** step)
        v_hat = v / (1 - beta2 ** step)
        r = m_hat / (v_hat.sqrt() + eps) + lamb_weight_decay * w
        w_norm, r_norm = torch.norm(w), torch.norm(r)
        trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
        w.sub_(lr * trust * r)


# ----------------------------------------------------------------- the benchmark


def make_sides(name: str, weights: List[torch.Tensor], grads: List[torch.Tensor]):
    """(foreach step, loop step, foreach params, loop params) for `name`, from copies of `weights`."""
    foreach_params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(foreach_params, grads):
        p.grad = g
    loop_params = [w.clone() for w in weights]
    if name == "lars":
        optimizer = LARS(foreach_params, **LARS_KNOBS)
        buffers = [torch.zeros_like(w) for w in weights]

        def loop() -> None:
            loop_lars_step(loop_params, grads, buffers, **LARS_KNOBS)
    else:
        optimizer = LAMB(foreach_params, **LAMB_KNOBS)
        exp_avgs = [torch.zeros_like(w) for w in weights]
        exp_avg_sqs = [torch.zeros_like(w) for w in weights]
        steps = [0]

        def loop() -> None:
            steps[0] += 1
            loop_lamb_step(loop_params, grads, exp_avgs, exp_avg_sqs, steps[0], **LAMB_KNOBS)

    def foreach() -> None:
        optimizer.step()

    return foreach, loop, foreach_params, loop_params


def seconds(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(name: str, weights: List[torch.Tensor], grads: List[torch.Tensor], repeats: int) -> Dict[str, object]:
    """Interleaved timings of one step of each side, and the sanity check that they agree."""
    foreach, loop, foreach_params, loop_params = make_sides(name, weights, grads)
    foreach(), loop()  # warm-up: creates the state
    times: Dict[str, List[float]] = {"foreach": [], "loop": []}
    for i in range(repeats):
        order = (("foreach", foreach), ("loop", loop)) if i % 2 == 0 else (("loop", loop), ("foreach", foreach))
        for side, step in order:
            times[side].append(seconds(step))
    for a, b in zip(foreach_params, loop_params):  # sanity: the same formula on both sides
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    return {"foreach_ms": [round(1e3 * t, 2) for t in times["foreach"]],
            "loop_ms": [round(1e3 * t, 2) for t in times["loop"]],
            "median_foreach_ms": round(1e3 * statistics.median(times["foreach"]), 2),
            "median_loop_ms": round(1e3 * statistics.median(times["loop"]), 2),
            # median over the back-to-back pairs: each pair saw the same machine load
            "ratio_loop_over_foreach": round(statistics.median(
                loop / foreach for loop, foreach in zip(times["loop"], times["foreach"])), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per side (default 9)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "optimizers.json")
    parser.add_argument("--width-divisors", type=int, nargs="+", default=[1, 16], metavar="K",
                        help="ResNet-50 with every channel count divided by K (default: 1 16); the goal is "
                             "for K=1, K=16 keeps the 161 tensors but makes per-tensor overhead dominate")
    args = parser.parse_args()

    results: Dict[str, object] = {
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU used",
        "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats, "goal": "loop/foreach >= 3 for width_divisor 1", "cases": [],
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} interleaved repeats")
    for divisor in args.width_divisors:
        shapes = resnet50_shapes(divisor)
        generator = torch.Generator().manual_seed(0)
        weights = [0.05 * torch.randn(shape, generator=generator) for shape in shapes]
        grads = [0.01 * torch.randn(shape, generator=generator) for shape in shapes]
        numel = sum(w.numel() for w in weights)
        case: Dict[str, object] = {"width_divisor": divisor, "tensors": len(shapes), "parameters": numel}
        print(f"ResNet-50{'' if divisor == 1 else f' / {divisor}'}: {len(shapes)} tensors, {numel:,} parameters")
        for name in ("lars", "lamb"):
            entry = measure(name, weights, grads, args.repeats)
            case[name] = entry
            print(f"  {name}: foreach {entry['median_foreach_ms']:8.2f} ms, loop {entry['median_loop_ms']:8.2f} ms "
                  f"per step; loop/foreach {entry['ratio_loop_over_foreach']:.2f}x")
        results["cases"].append(case)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
