"""PaddlePaddle's own optimizers as the reference for ours, run in a subprocess of the test (so
that the test process never imports Paddle beside torch):

    python tests/paddle/optimizers.py CASE.npz RESULT.npz

CASE.npz holds `optimizer` (lamb or lars), `dtype`, `knobs` (a JSON string of the optimizer's
arguments, `excluded` the names without weight decay), the initial parameters `init/NAME` and the
gradients of each step `grad/STEP/NAME`; RESULT.npz gets the parameters after the last step.
Each parameter is a Paddle parameter of that name; its gradient is set by a backward of
sum(w * g), so the optimizer's step is Paddle's dygraph path as a user's training loop takes it.
"""
from __future__ import annotations

import json
import sys

import numpy as np


def paddle_optimizer(name: str, params: list, knobs: dict):
    import paddle

    excluded = set(knobs.pop("excluded"))
    if name == "lamb":  # Fleet's lamb meta-optimizer builds paddle.optimizer.Lamb
        return paddle.optimizer.Lamb(parameters=params, exclude_from_weight_decay_fn=lambda p: any(part in p.name for part in excluded),
                                     **knobs)
    # Fleet's lars meta-optimizer builds LarsMomentumOptimizer; it excludes by name substring.
    return paddle.incubate.optimizer.LarsMomentumOptimizer(parameter_list=params, exclude_from_weight_decay=sorted(excluded),
                                                           **knobs)


def main(case_path: str, result_path: str) -> None:
    import paddle

    paddle.set_device("cpu")
    case = np.load(case_path)
    dtype = str(case["dtype"])
    names = [key.split("/", 1)[1] for key in case.files if key.startswith("init/")]
    params = [paddle.create_parameter(list(case[f"init/{name}"].shape), dtype, attr=paddle.ParamAttr(name=name),
                                      default_initializer=paddle.nn.initializer.Assign(case[f"init/{name}"]))
              for name in names]
    optimizer = paddle_optimizer(str(case["optimizer"]), params, json.loads(str(case["knobs"])))
    steps = len({key.split("/")[1] for key in case.files if key.startswith("grad/")})
    for step in range(steps):
        loss = sum((param * paddle.to_tensor(case[f"grad/{step}/{name}"])).sum() for name, param in zip(names, params))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    np.savez(result_path, **{name: param.numpy() for name, param in zip(names, params)})


if __name__ == "__main__":
    main(*sys.argv[1:])
