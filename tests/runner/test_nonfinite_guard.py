"""The non-finite guard's bookkeeping (runner/rank/divergence.py:NonFiniteGuard), in this process:
losses are kept as they come and checked where the flag is made, so the flag names the first
optimizer step whose loss was non-finite however many steps and micro-batches came between two
flags, and a run that never makes one is checked all the same every KEPT_AT_MOST losses."""
from __future__ import annotations

import torch

from runner.rank.divergence import KEPT_AT_MOST, NonFiniteGuard

CPU = torch.device("cpu")


def steps(guard: NonFiniteGuard, first: int, last: int, bad: set, micro_batches: int = 2) -> None:
    """Optimizer steps first..last of `micro_batches` losses each; those of the steps in `bad` NaN."""
    for step in range(first, last + 1):
        for _ in range(micro_batches):
            guard.note({"loss": torch.tensor(float("nan") if step in bad else 1.0)})
        guard.fold(step)


def test_the_flag_names_the_first_bad_step_whatever_came_between_two_flags():
    guard = NonFiniteGuard()
    steps(guard, 1, 4, bad=set())
    assert guard.flag(CPU).tolist() == [0]
    steps(guard, 5, 12, bad={7, 9})
    guard.note(torch.tensor(float("inf")))  # a micro-batch of step 13, which has not ended: not yet
    assert guard.flag(CPU).tolist() == [7]
    guard.fold(13)
    assert guard.flag(CPU).tolist() == [7]  # the first stays the first


def test_a_step_of_one_bad_micro_batch_among_finite_ones_is_bad():
    guard = NonFiniteGuard()
    for loss in (1.0, float("-inf"), 2.0):
        guard.note(torch.tensor(loss))
    guard.fold(3)
    assert guard.flag(CPU).tolist() == [3]


def test_a_run_that_never_makes_the_flag_is_checked_every_kept_at_most_losses():
    guard = NonFiniteGuard()
    steps(guard, 1, KEPT_AT_MOST, bad={KEPT_AT_MOST // 2}, micro_batches=1)
    assert not guard.losses and not guard.steps  # checked on the way: nothing kept without bound
    assert guard.first.item() == KEPT_AT_MOST // 2
