"""auto: choose the strategies for this model on this machine (Fleet `strategy.auto`); carried out
by plugins/auto.py, which gathers the facts and runs the trials. This module is the pure part:
the knobs, the candidates with their memory estimates, and the rules (docs/auto.md)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, FrozenSet, List, Optional, Sequence, Tuple

from runner.core.contribution import Contribution, Facts, Memory, RunShape, Strategy
from runner.core.errors import require
from runner.strategies import schemas

KEY = "strategy.auto."
MODES = ("search", "rules")
# The order rules mode adds strategies in when memory demands it, and numerics-changing ones when allowed.
FOR_MEMORY = (("recompute", {}), ("sharding", {"stage": 1}), ("sharding", {"stage": 2}), ("sharding", {"stage": 3}),
              ("gradient_merge", {"k_steps": 2}), ("gradient_merge", {"k_steps": 4}), ("pipeline", {}))
NUMERICS = ("lars", "lamb", "dgc", "localsgd")


@dataclass
class AutoConfig(Strategy):
    """Choose the strategies (Fleet: `strategy.auto`): from facts about the model, the data and the
    machine, every allowed combination that applies is a candidate, with its memory per process
    estimated; those that do not fit are pruned. `rules` picks one by rule; `search` measures
    short trials of the candidates and takes the fastest. The run then trains with the winner."""

    name: ClassVar[str] = "auto"

    mode: str = "search"
    """search: short measured trials of the candidates, fastest estimate first; the highest
    samples/s wins. rules: no trials, Fleet-like rules (well under a second)."""
    budget_s: float = 600.0
    """search: no trial starts after this many seconds of trials."""
    trial_steps: int = 20
    """search: optimizer steps per trial; the first measure.warmup_steps are not measured."""
    max_trials: Optional[int] = None
    """search: at most this many trials (null: as many as the budget allows)."""
    allow_numerics_change: bool = False
    """Also consider the strategies that change the mathematics of training (lars, lamb, dgc,
    localsgd, adaptive_localsgd, fp16_allreduce), as Fleet's auto does silently."""
    device_memory_gb: Optional[float] = None
    """Memory per process to plan for (null: the GPU's, or on CPU the machine's shared by the processes)."""
    search_only: bool = False
    """Stop once chosen: write auto/ (candidates.csv, experiment/best.yaml) and train nothing."""

    def __post_init__(self) -> None:
        require(self.mode in MODES, KEY + "mode", self.mode, f"allowed: {', '.join(MODES)}", MODES)
        require(self.budget_s > 0, KEY + "budget_s", self.budget_s, "must be > 0")
        require(self.trial_steps >= 2, KEY + "trial_steps", self.trial_steps, "must be >= 2")
        require(self.max_trials is None or self.max_trials >= 1, KEY + "max_trials", self.max_trials,
                "must be >= 1 (or null: no limit)")
        require(self.device_memory_gb is None or self.device_memory_gb > 0, KEY + "device_memory_gb",
                self.device_memory_gb, "must be > 0 (or null: the device's)")

    def contribute(self, run: RunShape) -> Contribution:
        return Contribution(notes=["auto: the job chooses the strategies when it starts; auto/ in the run "
                                   "directory says what was tried and why"])


@dataclass
class Candidate:
    """One combination with its knobs, its estimates and, once tried, what it measured."""

    strategies: Dict[str, Dict[str, Any]]  # name -> knobs over the defaults, in the table's names
    memory: Memory
    speed: float  # estimated throughput relative to no strategy
    status: str = "candidate"  # candidate | pruned | refused | ok | failed | out_of_memory | not tried
    reason: str = ""
    measured: Dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return "+".join(member_label(name, knobs) for name, knobs in self.strategies.items()) or "none"


def member_label(name: str, knobs: Dict[str, Any]) -> str:
    return name + "".join(f"({k}={v})" for k, v in knobs.items())


def allowed(names: Sequence[str], rows: Sequence[FrozenSet[str]]) -> bool:
    """The table's rule: one strategy (or none) alone, two or more only within one allowed row."""
    return len(names) <= 1 or any(set(names) <= row for row in rows)


def built(strategies: Dict[str, Dict[str, Any]]) -> Dict[str, Strategy]:
    return {name: schemas()[name](**knobs) for name, knobs in strategies.items()}


def estimate(facts: Facts, strategies: Dict[str, Strategy]) -> Tuple[Memory, float]:
    """Memory per process and relative speed of a run of these facts with these strategies on."""
    memory = Memory.of(facts)
    for knobs in strategies.values():
        memory = knobs.memory(memory, facts)
    return memory, math.prod(knobs.speed(facts) for knobs in strategies.values())


def fits(memory: Memory, facts: Facts) -> bool:
    return facts.device_memory_bytes is None or memory.total <= facts.device_memory_bytes


def considered(facts: Facts, auto: AutoConfig) -> Tuple[List[str], Dict[str, str]]:
    """The strategies auto may use for these facts, and why each other one is left out."""
    usable, left_out = [], {}
    for name, schema in schemas().items():
        if name == "auto":
            continue
        why = schema().applies(facts)
        if schema.changes_numerics and not auto.allow_numerics_change:
            why = "changes the numerics of training (strategy.auto.allow_numerics_change=true allows it)"
        if why is None:
            usable.append(name)
        else:
            left_out[name] = f"left out: {why}"
    return usable, left_out


def candidates(facts: Facts, auto: AutoConfig, rows: Sequence[FrozenSet[str]]) -> List[Candidate]:
    """Every allowed combination of the usable strategies, crossed with their knob variants,
    fastest estimate first; those over the memory are `pruned`. Memory-only strategies
    (gradient_merge) appear only with combinations that do not fit without them."""
    usable, _ = considered(facts, auto)
    found: List[Candidate] = []
    for size in range(len(usable) + 1):
        for names in itertools.combinations(usable, size):
            if not allowed(names, rows):
                continue
            for knobs in itertools.product(*(schemas()[name]().variants(facts) for name in names)):
                found.append(candidate(facts, dict(zip(names, knobs))))
    fitting = {c.label for c in found if fits(c.memory, facts)}
    kept = [c for c in found if not any(schemas()[name].for_memory_only for name in c.strategies)
            or without_memory_only(c) not in fitting]
    for c in kept:
        if not fits(c.memory, facts):
            c.status, c.reason = "pruned", (f"estimated {c.memory.total / 2**30:.2f} GiB per process > "
                                            f"{facts.device_memory_bytes / 2**30:.2f} GiB")
    return sorted(kept, key=lambda c: (c.status == "pruned", -c.speed))


def candidate(facts: Facts, strategies: Dict[str, Dict[str, Any]]) -> Candidate:
    memory, speed = estimate(facts, built(strategies))
    return Candidate(strategies, memory, speed)


def without_memory_only(c: Candidate) -> str:
    rest = {name: knobs for name, knobs in c.strategies.items() if not schemas()[name].for_memory_only}
    return Candidate(rest, c.memory, c.speed).label


def trial_order(c: Candidate, finished: Sequence[Candidate], facts: Facts) -> Tuple[bool, float]:
    """Sort key of the search: no strategy and single strategies first, fastest estimate first;
    then combinations by the product of their members' measured speed-ups over no strategy (a
    member not measured alone counts with its estimate), so that what the machine showed, not
    the rough factors, orders the rest."""
    if len(c.strategies) <= 1:
        return False, -c.speed
    baseline = next((done.measured["samples_per_s"] for done in finished if not done.strategies), None)
    alone = {done.label: done.measured["samples_per_s"] / baseline
             for done in finished if baseline and len(done.strategies) == 1}
    expected = math.prod(alone.get(member_label(name, knobs), schemas()[name](**knobs).speed(facts))
                         for name, knobs in c.strategies.items())
    return True, -expected


def rules(facts: Facts, auto: AutoConfig, rows: Sequence[FrozenSet[str]]) -> Tuple[Candidate, Dict[str, str]]:
    """Fleet-like rules: amp on GPUs; the numerics-changing strategies that apply, if allowed;
    then, while the estimate does not fit, recompute, sharding stages 1-3, gradient merging and
    the pipeline, each kept only while the table allows the set. Returns the choice and, for
    every strategy, why it was taken or left out."""
    usable, why = considered(facts, auto)
    chosen: Dict[str, Dict[str, Any]] = {}

    def take(name: str, knobs: Dict[str, Any], reason: str) -> None:
        if name not in usable:
            return
        if not allowed([*chosen, name], rows):
            why[name] = f"left out: the table does not allow it with {'+'.join(chosen)}"
            return
        chosen[name] = knobs
        why[name] = f"taken: {reason}"

    if facts.device == "cuda":
        take("amp", schemas()["amp"]().variants(facts)[0], "16-bit matrix products run several times faster on GPUs")
    elif "amp" in usable:
        why["amp"] = "left out: on CPUs 16-bit autocast is slower than float32"
    for name in NUMERICS:
        take(name, {}, "applies to this optimizer and world (strategy.auto.allow_numerics_change=true)")
    for name, knobs in FOR_MEMORY:
        current = candidate(facts, chosen)
        if fits(current.memory, facts):
            break
        needed = f"the estimate {current.memory.total / 2**30:.2f} GiB exceeds {facts.device_memory_bytes / 2**30:.2f} GiB"
        if name in chosen:  # a later stage or larger k replaces the earlier setting
            chosen[name] = knobs
            why[name] = f"taken with {knobs}: {needed}"
        else:
            take(name, knobs, needed)
    for name in usable:
        why.setdefault(name, "left out: the estimate fits without it")
    choice = candidate(facts, chosen)
    if not fits(choice.memory, facts):
        choice.reason = "does not fit by the estimate even so"
    return choice, why
