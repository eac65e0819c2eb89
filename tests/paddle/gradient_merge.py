"""Fleet's gradient merge as Paddle 3.3.1 runs it, the reference for lightfleet's, run in a
subprocess of the test (so that the test process never imports Paddle beside torch):

    python tests/paddle/gradient_merge.py CASE.npz RESULT.npz

CASE.npz holds a linear classifier's initial `weight` [in, out] (Paddle's layout) and `bias`,
the micro-batches `inputs` [N, B, in] and `targets` [N, B] (int64), the SGD learning rate `lr`
and `runs`, a JSON list of {"k_steps", "avg"}. RESULT.npz gets, for run i, `i/weight` [N, in, out]
and `i/bias` [N, out]: the parameters after each of the N micro-batches.

Each run is Fleet itself in one CPU process: `fleet.init(is_collective=True)`, a
`DistributedStrategy` with `gradient_merge` and `gradient_merge_configs`, and
`fleet.distributed_optimizer(paddle.optimizer.SGD(lr), strategy).minimize(mean cross-entropy)`,
which applies Fleet's GradientMergeOptimizer meta-optimizer (Paddle's
`paddle.incubate.optimizer.GradientMergeOptimizer`) to a static program, executed one
micro-batch per `Executor.run` on the CPU. Fleet's meta-optimizers rewrite programs of Paddle's
old IR, so the program is built under `OldIrGuard`, where `paddle.nn.functional` has static
branches.
"""
from __future__ import annotations

import json
import sys

import numpy as np


def merged_run(case, k_steps: int, avg: bool) -> dict[str, np.ndarray]:
    """One run of Fleet's gradient merge over every micro-batch of `case`; the parameters after each."""
    import paddle
    import paddle.distributed.fleet as fleet
    import paddle.nn.functional as F
    from paddle.pir_utils import OldIrGuard

    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": k_steps, "avg": avg}
    micro_batch, in_features = case["inputs"].shape[1:]
    with OldIrGuard(), paddle.static.scope_guard(paddle.static.Scope()):
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            inputs = paddle.static.data("inputs", [micro_batch, in_features], "float32")
            targets = paddle.static.data("targets", [micro_batch], "int64")
            weight, bias = (paddle.create_parameter(list(case[name].shape), "float32", name=name,
                                                    default_initializer=paddle.nn.initializer.Assign(case[name]))
                            for name in ("weight", "bias"))
            loss = F.cross_entropy(F.linear(inputs, weight, bias), targets)
            optimizer = fleet.distributed_optimizer(paddle.optimizer.SGD(learning_rate=float(case["lr"])), strategy)
            optimizer.minimize(loss)
        executor = paddle.static.Executor(paddle.CPUPlace())
        executor.run(startup)
        after = [executor.run(main, feed={"inputs": x, "targets": y}, fetch_list=[weight, bias])
                 for x, y in zip(case["inputs"], case["targets"])]
    return {"weight": np.stack([w for w, _ in after]), "bias": np.stack([b for _, b in after])}


def main(case_path: str, result_path: str) -> None:
    import paddle.distributed.fleet as fleet

    case = np.load(case_path)
    fleet.init(is_collective=True)
    result = {}
    for i, run in enumerate(json.loads(str(case["runs"]))):
        for name, value in merged_run(case, run["k_steps"], run["avg"]).items():
            result[f"{i}/{name}"] = value
    np.savez(result_path, **result)


if __name__ == "__main__":
    main(*sys.argv[1:])
