"""Paddle 3.3.1's dynamic loss scaling and AMP list check, the reference for lightfleet's amp, run
in a subprocess of the test (so that the test process never imports Paddle beside torch):

    python tests/paddle/loss_scaling.py CASES.json RESULT.json

CASES.json holds `scaling`, a list of runs {"knobs": Fleet's amp_configs loss-scaling keys,
"lr", "momentum" (0: plain SGD), "inputs": per step the two inputs x}, and `lists`, a list of
[custom_white_list, custom_black_list] pairs. Each run trains one weight w of two zeros on the
loss mean(w * x); an inf in x makes that step's scaled gradient overflow.

RESULT.json gets, per run, `fleet` and `grad_scaler`: per step, after it, the loss `scale`, the
counts of consecutive `good` and `bad` steps (null where the run keeps none) and `w`:
- fleet: Fleet itself in one CPU process, `fleet.init(is_collective=True)`, a
  DistributedStrategy with `amp` and those `amp_configs`, and `fleet.distributed_optimizer(SGD or
  Momentum).minimize(loss)`: Fleet's AMPOptimizer meta-optimizer decorates the static program
  (paddle.static.amp: `check_finite_and_unscale`, then `update_loss_scaling` where the scaling is
  dynamic), run one step per `Executor.run`. Built under `OldIrGuard`: Fleet's meta-optimizers
  rewrite programs of Paddle's old IR.
- grad_scaler: Paddle's dygraph `paddle.amp.GradScaler(**knobs)` in a user's loop (`scale`,
  `backward`, `step`, `update`). It turns itself off on a CPU place, so it is built believing the
  place is a GPU (`enabled_grad_scaler`); everything after that is its own code on the CPU.
and, per list pair, `fleet` and `auto_cast`: the error with which Fleet's amp (its
AutoMixedPrecisionLists, at minimize) and dygraph `paddle.amp.auto_cast` refuse the lists, or null.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Optional

import numpy as np


def fleet_steps(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run under Fleet's static amp; per step the scale, the counters and w after it."""
    import paddle
    import paddle.distributed.fleet as fleet
    from paddle.pir_utils import OldIrGuard

    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = run["knobs"]
    with OldIrGuard(), paddle.static.scope_guard(paddle.static.Scope()):
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [2], "float32")
            w = paddle.create_parameter([2], "float32", name="w",
                                        default_initializer=paddle.nn.initializer.Constant(0.0))
            loss = paddle.mean(w * x)
            fleet.distributed_optimizer(inner_optimizer(run), strategy).minimize(loss)
        ops = {op.type: op for op in main.global_block().ops}
        fetched = [ops["check_finite_and_unscale"].input("Scale")[0]]
        if "update_loss_scaling" in ops:  # dynamic scaling only
            fetched += [ops["update_loss_scaling"].output(name)[0] for name in ("OutGoodSteps", "OutBadSteps")]
        executor = paddle.static.Executor(paddle.CPUPlace())
        executor.run(startup)
        steps = []
        for inputs in run["inputs"]:
            scale, *counts, after = executor.run(main, feed={"x": np.array(inputs, np.float32)},
                                                 fetch_list=[*fetched, w])
            good, bad = (int(count[0]) for count in counts) if counts else (None, None)
            steps.append({"scale": float(scale[0]), "good": good, "bad": bad, "w": after.tolist()})
    return steps


def inner_optimizer(run: dict[str, Any], parameters: Optional[list] = None):
    """The run's SGD, or Momentum where it has one; `parameters` in dygraph only."""
    import paddle

    if run["momentum"]:
        return paddle.optimizer.Momentum(learning_rate=run["lr"], momentum=run["momentum"], parameters=parameters)
    return paddle.optimizer.SGD(learning_rate=run["lr"], parameters=parameters)


class _GpuPlace:
    """What GradScaler's constructor asks of the tracer's place: whether it is a GPU."""

    @staticmethod
    def is_gpu_place() -> bool:
        return True


class _TracerOnGpu:
    _expected_place = _GpuPlace()


def enabled_grad_scaler(knobs: dict[str, Any]):
    """paddle.amp.GradScaler(**knobs), built while its module's tracer reports a GPU place, so that
    its constructor does not disable it (its only device check; its tensors are made on the CPU)."""
    import paddle
    import paddle.amp.grad_scaler as grad_scaler_module

    tracer = grad_scaler_module._dygraph_tracer
    grad_scaler_module._dygraph_tracer = _TracerOnGpu
    try:
        scaler = paddle.amp.GradScaler(**knobs)
    finally:
        grad_scaler_module._dygraph_tracer = tracer
    assert scaler.is_enable()
    return scaler


def grad_scaler_steps(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run under Paddle's dygraph GradScaler; per step the scale, the counters and w after it."""
    import paddle

    scaler = enabled_grad_scaler(run["knobs"])
    w = paddle.create_parameter([2], "float32", default_initializer=paddle.nn.initializer.Constant(0.0))
    optimizer = inner_optimizer(run, [w])
    steps = []
    for inputs in run["inputs"]:
        # auto_cast does nothing on a CPU place, but sets the float16 dtype that GradScaler.scale requires.
        with paddle.amp.auto_cast(dtype="float16"):
            loss = paddle.mean(w * paddle.to_tensor(np.array(inputs, np.float32)))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.clear_grad()
        state = scaler.state_dict()
        steps.append({"scale": float(state["scale"][0]), "good": state["incr_count"], "bad": state["decr_count"],
                      "w": w.numpy().tolist()})
    return steps


def refusal(call) -> Optional[str]:
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def fleet_lists(white: list[str], black: list[str]) -> None:
    """Fleet's amp with these lists on a one-op program, up to minimize."""
    import paddle
    import paddle.distributed.fleet as fleet
    from paddle.pir_utils import OldIrGuard

    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"custom_white_list": white, "custom_black_list": black}
    with OldIrGuard():
        with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
            x = paddle.static.data("x", [2], "float32")
            w = paddle.create_parameter([2], "float32", default_initializer=paddle.nn.initializer.Constant(0.0))
            fleet.distributed_optimizer(paddle.optimizer.SGD(), strategy).minimize(paddle.mean(w * x))


def auto_cast_lists(white: list[str], black: list[str]) -> None:
    import paddle

    with paddle.amp.auto_cast(custom_white_list=white, custom_black_list=black):
        pass


def main(cases_path: str, result_path: str) -> None:
    import paddle
    import paddle.distributed.fleet as fleet

    paddle.set_device("cpu")
    # GradScaler's back-off message calls float() on its scale, of shape [1]; Paddle's
    # Tensor.__float__ is float(np.array(tensor)), which NumPy 2.4 (the constraints' pin) refuses
    # for anything but a 0-d array (TypeError). The same conversion of a 0-d view of the tensor:
    to_float = paddle.Tensor.__float__
    paddle.Tensor.__float__ = lambda tensor: to_float(tensor.reshape([]))
    cases = json.loads(open(cases_path).read())
    fleet.init(is_collective=True)
    result = {"scaling": [{"fleet": fleet_steps(run), "grad_scaler": grad_scaler_steps(run)}
                          for run in cases["scaling"]],
              "lists": [{"fleet": refusal(lambda: fleet_lists(white, black)),
                         "auto_cast": refusal(lambda: auto_cast_lists(white, black))}
                        for white, black in cases["lists"]]}
    with open(result_path, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
