"""The check that a resume is exact (tests/test_resume.py, tests/test_combinations.py,
tests/test_real_models.py, tests/test_preemption.py): a run made with `checkpoint_overrides(step)`
saves every rank's final state (tests/helpers/probe.py:FinalState) and a checkpoint every `step`
steps; `resumes_exactly` resumes it from the middle and `assert_same_end` compares both ends, bit
for bit, with the losses logged from the resumed step on."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

import torch


# What the uninterrupted run adds: every rank's final state, and a checkpoint every `step` steps.
def checkpoint_overrides(step: int) -> list:
    return ["+callbacks.final._target_=tests.helpers.probe.FinalState",
            f"+callbacks.model_checkpoint.every_n_train_steps={step}", "+callbacks.model_checkpoint.save_top_k=-1"]


def losses(run: Path) -> dict:
    rows = csv.DictReader((run / "csv" / "metrics.csv").open())
    return {int(r["step"]): r["train_loss"] for r in rows if r["train_loss"]}


def resumes_exactly(lightfleet: Callable, tmp_path: Path, full: str, step: int) -> None:
    """Resume run directory `full` (made with `checkpoint_overrides(step)`) from its checkpoint at
    `step` and compare the end of both runs."""
    (middle,) = (tmp_path / full / "checkpoints").glob(f"*-step={step}.ckpt")
    resumed = lightfleet("resume", full, f"ckpt_path='{middle}'", "paths.output_dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "trainer.max_steps" not in resumed.stdout  # the same run's length: no note that it changed
    assert_same_end(tmp_path / full, tmp_path / "resumed", step)


def assert_same_end(full: Path, resumed: Path, step: int) -> None:
    """Every rank of run `resumed` (resumed at `step`) ended exactly as run `full`, which was never
    interrupted, and logged the same losses from `step` on."""
    ranks = sorted(path.name for path in full.glob("final.rank*.pt"))
    assert ranks and ranks == sorted(path.name for path in resumed.glob("final.rank*.pt"))
    for name in ranks:
        expected, got = (torch.load(run / name, weights_only=False) for run in (full, resumed))
        assert got["global_step"] == expected["global_step"] > step
        assert got["parameters"].keys() == expected["parameters"].keys()
        for key, value in expected["parameters"].items():
            assert torch.equal(got["parameters"][key], value), f"{name}: {key} differs after resume"
        assert len(got["optimizer"]) == len(expected["optimizer"])
        for mine, reference in zip(got["optimizer"], expected["optimizer"]):
            for key, value in reference.items():
                same = torch.equal(mine[key], value) if isinstance(value, torch.Tensor) else mine[key] == value
                assert same, f"{name}: optimizer state {key} differs after resume"
    assert losses(resumed) == {logged: loss for logged, loss in losses(full).items() if logged >= step}
