"""Lightning calls lightfleet's own callbacks at each batch only for the hooks they define
(runner/rank/hooks.py; issue 43): it called every batch hook of every callback, six a training
step on each of five callbacks, each through its profiler, for 3 that do something."""
from __future__ import annotations

import signal
from collections import Counter

import pytorch_lightning as pl
from pytorch_lightning.profilers import PassThroughProfiler

from runner.data import SyntheticClassificationData
from runner.models import MLPClassifier
from runner.rank.hooks import BATCH_HOOKS
from runner.rank.measure import LastValidation, RunMeter
from runner.rank.parent import SIGNALS
from runner.rank.preemption import Preemption
from runner.rank.resume import GlobalPosition, RandomStates

STEPS = 6  # 3 batches of 64 an epoch, validated at each epoch's end


class Dispatched(PassThroughProfiler):
    """Counts the actions Lightning profiles: each callback hook it calls is `[Callback]<name>.<hook>`."""

    def __init__(self) -> None:
        super().__init__()
        self.actions: Counter = Counter()

    def start(self, action_name: str) -> None:
        self.actions[action_name] += 1


def test_lightfleets_callbacks_are_called_at_each_batch_only_for_the_hooks_they_define(tmp_path):
    callbacks = [RunMeter(), LastValidation(), Preemption(), RandomStates(), GlobalPosition()]
    dispatched = Dispatched()
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}  # Preemption takes them during fit
    try:
        pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, val_check_interval=3, limit_val_batches=2,
                   num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, profiler=dispatched, callbacks=callbacks, default_root_dir=tmp_path,
                   ).fit(MLPClassifier(), datamodule=SyntheticClassificationData(num_train=192, num_val=64))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    calls = {(name, hook): dispatched.actions[f"[Callback]{name}.{hook}"]
             for name in (type(callback).__name__ for callback in callbacks) for hook in BATCH_HOOKS}
    called = {type(callback).__name__: {} for callback in callbacks}
    for (name, hook), count in calls.items():
        if count:
            called[name][hook] = count
    assert called == {"RunMeter": {"on_train_batch_start": STEPS, "on_train_batch_end": STEPS},
                      "LastValidation": {}, "Preemption": {"on_train_batch_end": STEPS}, "RandomStates": {},
                      "GlobalPosition": {}}
    # The hooks of a run's moments still reach every callback that defines them.
    assert dispatched.actions["[Callback]LastValidation.on_validation_end"] == 2
    assert dispatched.actions["[Callback]GlobalPosition.on_train_start"] == 1
