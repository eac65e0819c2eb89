"""lightfleet's own callbacks, in every run's plan (`<- lightfleet`), after the user's: the
measurements (runner/rank/measure.py), the preemption checkpoint and the guard against non-finite
training (preemption.py, divergence.py), what an exact resume needs (resume.py) and the progress
bar (progress.py); and its checkpoint writer (checkpoint_io.py: whole files with a manifest, read
as data only). Named here, beside them, as the
plan names every component: by import path, loaded in each rank. Imports no torch.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from runner.config.checks import RunSpec
from runner.core.contribution import Component, Contribution


def runner_callbacks(spec: RunSpec) -> Contribution:
    """The runner's callbacks and checkpoint writer for the run of `spec`."""
    measure = OmegaConf.to_object(spec.cfg.measure)
    pipeline = spec.strategies.get("pipeline")
    position = {"pipeline_micro_batches": pipeline.accumulate_steps} if pipeline else {}
    return Contribution(checkpoint_io=Component("runner.rank.checkpoint_io:AtomicCheckpointIO"), callbacks=[
        *([Component("runner.rank.measure:RunMeter", {"warmup_steps": measure.warmup_steps})] if measure.enabled else []),
        *([Component("plugins.traffic:TrafficRecorder")] if measure.traffic else []),  # the collectives' bytes
        Component("runner.rank.measure:LastValidation"),  # the step of the summary's val_loss
        # checkpoints/last.ckpt at a preemption signal; a stop where training stops being finite
        Component("runner.rank.preemption:Preemption", {"stop_on_nonfinite": spec.cfg.stop_on_nonfinite}),
        Component("runner.rank.resume:RandomStates"), Component("runner.rank.resume:GlobalPosition", position),  # exact resumes
        *([Component("runner.rank.progress:StepsProgressBar")] if shows_own_progress_bar(spec) else [])])


def shows_own_progress_bar(spec: RunSpec) -> bool:
    """Whether lightfleet's bar (runner/rank/progress.py: it counts steps where steps bound the run)
    replaces Lightning's default one: the bar is on and the config's callbacks bring none. Lightning
    allows one bar; a callback whose class name ends in ProgressBar (Lightning's, rich's, ours) is one."""
    trainer = spec.trainer
    brought = any(str(node.get("_target_", "")).endswith("ProgressBar") for node in spec.cfg.callbacks.values() if node)
    return trainer.enable_progress_bar is not False and not trainer.barebones and not brought
