"""auto's search length (docs/auto.md): how long a job's trials may take and how many are expected,
from what a run costs. Pure; beside runner/strategies/auto.py, which chooses among the candidates
(a module whose name starts with _ is not a strategy of the registry)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from runner.strategies.auto import AutoConfig

# The search's length (docs/auto.md): a trial's steps unless strategy.auto.trial_steps says (at most
# the job's); with strategy.auto.budget_s null, trials take at most SEARCH_SHARE of the job's expected
# training time, at least MIN_TRIALS (a measured comparison), none starting after BUDGET_CAP_S.
TRIAL_STEPS = 20
SEARCH_SHARE = 0.25
MIN_TRIALS = 2
BUDGET_CAP_S = 600.0


@dataclass(frozen=True)
class RunCost:
    """What a run of this job is expected to take: its processes' start-up (and end), plus its steps."""

    startup_s: float
    step_s: Optional[float] = None  # None: no trial has measured a step yet (the steps then count nothing)

    def seconds(self, steps: int) -> float:
        """A trial's: its processes start in two waves, its launcher, then its ranks side by side."""
        return self.startup_s + steps * (self.step_s or 0.0)

    def job_seconds(self, steps: int) -> float:
        """The job's own training: one wave, its ranks (the command that launches them has started)."""
        return self.startup_s / 2 + steps * (self.step_s or 0.0)

    @classmethod
    def before_trials(cls, command_startup_s: float) -> RunCost:
        """Before any trial: each wave taken as long as this command took to start (its imports,
        the model's facts)."""
        return cls(2 * command_startup_s)

    @classmethod
    def measured(cls, trials: Sequence[Tuple[float, int, float]]) -> RunCost:
        """From finished trials, each (seconds, steps, median step seconds): the median start-up (a
        trial's seconds less its steps) and the fastest step, the winner's, which the job trains at."""
        return cls(statistics.median(max(0.0, seconds - steps * step) for seconds, steps, step in trials),
                   min(step for _, _, step in trials))


@dataclass(frozen=True)
class SearchPlan:
    """How long a search runs: `steps` a trial, none starting after `budget_s` seconds of trials,
    at most `most` trials (None: the budget alone bounds them); `expected` trials of `trial_s` each."""

    steps: int
    budget_s: float
    most: Optional[int]
    expected: int
    trial_s: float

    @property
    def seconds(self) -> float:
        return self.expected * self.trial_s


def scaled(auto: AutoConfig, job_steps: Optional[int]) -> bool:
    """Whether the search's length follows the job's: the user bounded it neither in time nor in
    trials, and the job trains a known number of steps (trainer.max_steps)."""
    return auto.budget_s is None and auto.max_trials is None and job_steps is not None


def trial_steps(auto: AutoConfig, job_steps: Optional[int]) -> int:
    """A trial's steps: strategy.auto.trial_steps, or TRIAL_STEPS, at most the job's (at least 2)."""
    return auto.trial_steps or (TRIAL_STEPS if job_steps is None else max(2, min(TRIAL_STEPS, job_steps)))


def search_plan(auto: AutoConfig, job_steps: Optional[int], fitting: int, cost: RunCost) -> SearchPlan:
    """The search's length for a job of `job_steps` steps (None: unknown, trained by epochs) with
    `fitting` candidates to try at `cost`: the user's budget_s and max_trials win; left null, the
    trials take at most SEARCH_SHARE of the job's expected training time, at least MIN_TRIALS,
    none starting after BUDGET_CAP_S."""
    steps = trial_steps(auto, job_steps)
    budget = auto.budget_s or BUDGET_CAP_S
    trial_s = cost.seconds(steps)
    most = auto.max_trials
    if scaled(auto, job_steps):
        most = max(MIN_TRIALS, math.floor(SEARCH_SHARE * cost.job_seconds(job_steps) / trial_s))
    # Trials start until the budget is spent: the last one may start just before its end.
    expected = min(fitting, most or fitting, math.floor(budget / trial_s) + 1)
    return SearchPlan(steps, budget, most, expected, trial_s)
