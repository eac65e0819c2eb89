"""The one place plans are made: by the command, for the run and for auto's trials (ranks read the
plan.yaml it saves). Here, in the command's layer, because a plan names the components of every
layer below: the strategies' plugins, lightfleet's DDP, the runner's own callbacks (runner/rank/callbacks.py).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

from omegaconf import OmegaConf

from runner.config.checks import RunSpec
from runner.config.collective import LIGHTFLEET_DDP
from runner.core.plan import RUNNER, Plan, make_plan
from runner.rank.callbacks import runner_callbacks


def plan_for(spec: RunSpec, cuda_available: Optional[Callable[[], bool]] = None) -> Plan:
    """The run's plan, once the table allows its strategies (the preflight's stage before this one;
    auto's candidates come from the table's rows): the one place plans are made (by the command, for
    the run and for auto's trials; ranks read the plan.yaml it saves). Besides the
    strategies', lightfleet's own contributions: the collective knobs' (their cross-field rule
    against trainer.benchmark refuses here), the fast path's (refused beside a strategy it cannot
    serve; the collective fusion flags' compile is its compile, in its mode) and the runner's
    callbacks. `cuda_available`: whether the run's devices have CUDA (None: this machine's)."""

    def this_machine() -> bool:  # deliberately lazy: asked only when a contribution needs the device type
        import torch

        return torch.cuda.is_available()

    fast_path = OmegaConf.to_object(spec.cfg.fast_path)
    # The collective knobs first: the fast path's fused optimizer rebuilds what their foreach set.
    plan = make_plan(spec.strategies, spec.trainer, spec.batch_size, cuda_available=cuda_available or this_machine,
                     lightfleet={"collective": partial(OmegaConf.to_object(spec.cfg.collective).contribute,
                                                       compile_mode=fast_path.compile_mode),
                                 "fast_path": fast_path.contribute, RUNNER: lambda run: runner_callbacks(spec)},
                     data_parallel=LIGHTFLEET_DDP)
    note = OmegaConf.to_object(spec.cfg.parameter_server).note()
    plan.notes += [note] if note else []
    return plan

