"""What lightfleet's own callbacks cost a step where they have nothing to do in it.

Lightning's trainer calls each hook on every callback, overridden or not, each call through its
profiler (`trainer/call.py:_call_callback_hooks`: about 2.5 us a call on a CPU; a step's six hooks
on five callbacks about 75 us, 2% of a 3 ms step). It skips an attribute that is not callable: a
callback deriving from `OwnHooksOnly` has the per-batch hooks its class leaves as Lightning's
no-ops set to None, so it is called only where it acts (tests/runner/test_hooks.py counts the
calls Lightning makes).
"""
from __future__ import annotations

import pytorch_lightning as pl

# The hooks of every training and validation batch; the others run a few times a run.
BATCH_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
               "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end")


class OwnHooksOnly(pl.Callback):
    """A callback that Lightning calls at each batch only for the batch hooks its class defines."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name in BATCH_HOOKS:
            if getattr(cls, name) is getattr(pl.Callback, name):
                setattr(cls, name, None)
