"""auto: choose the strategies for this model on this machine (Fleet `strategy.auto`); carried out
by plugins/auto.py, which gathers the facts and runs the trials. This module is the pure part:
the knobs, the candidates with their memory estimates, the rules, and the words that say why (docs/auto.md)."""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Dict, FrozenSet, List, Optional, Sequence, Tuple

from runner.core.contribution import Contribution, Facts, Memory, RunShape, Strategy
from runner.core.errors import ConfigError, require
from runner.strategies import schemas

KEY = "strategy.auto."
MODES = ("search", "rules", "rehearse")
# The numerics-changing strategies Fleet's rules turn on when they apply, in Fleet's order.
NUMERICS = ("lars", "lamb", "dgc", "localsgd")
# Candidates that cannot win: over the memory by the estimate, or refused by the plan.
EXCLUDED = ("pruned", "refused")
TRIAL_FAILED = ("failed", "out_of_memory")  # rank last in the rules' fallback of a search
# How the other candidates lost, by status (runner/command/autotune.py gives the trial and rehearsal statuses).
LOST = {"candidate": "rank lower", "ok": "measured slower", "pruned": "exceed the memory",
        "refused": "refused by the plan", "failed": "failed their trial or rehearsal",
        "out_of_memory": "ran out of memory in their trial", "not tried": "not tried (budget spent)",
        "fits": "fit and rank lower by their rehearsal", "does not fit": "do not fit by their rehearsal"}
@dataclass
class AutoConfig(Strategy):
    """Choose the strategies (Fleet: `strategy.auto`): from facts about the model, the data and the
    machine, every allowed combination that applies is a candidate, with its memory per process
    estimated; those that do not fit are pruned. `rules` picks one by rule; `search` measures
    short trials of the candidates and takes the fastest. The run then trains with the winner;
    when no candidate fits, the run is refused before it starts."""

    name: ClassVar[str] = "auto"

    mode: str = "search"
    """search: short measured trials of the candidates that fit, fastest estimate first; the
    highest samples/s wins. rules: no trials: of the candidates that fit, the first by Fleet's
    preferences (amp on GPUs only), then the speed model, then the larger micro-batch. rehearse:
    for a cluster this machine is not (trainer.devices x trainer.num_nodes, rehearse.device): every
    candidate rehearsed as `lightfleet rehearse` does, no trials, no GPU; those that fit ranked by
    predicted samples/s; writes auto/ and trains nothing (docs/auto.md)."""
    budget_s: Optional[float] = None
    """search: no trial starts after this many seconds of trials (null: none after 600 s and, unless
    max_trials is set, the search scaled to the job: trials take at most a quarter of its expected
    training time, its trainer.max_steps at the trials' measured step time plus its ranks' start-up,
    at least 2 trials; docs/auto.md)."""
    trial_steps: Optional[int] = None
    """search: optimizer steps per trial (null: 20, at most the job's trainer.max_steps); the
    first measure.warmup_steps are not measured."""
    max_trials: Optional[int] = None
    """search: at most this many candidates tried (null: as many as the budget allows); a top two
    within 5% of each other run once more besides."""
    allow_numerics_change: bool = False
    """Also consider the strategies that change the mathematics of training (lars, lamb, dgc,
    localsgd, adaptive_localsgd, fp16_allreduce), as Fleet's auto does silently."""
    device_memory_gb: Optional[float] = None
    """Memory per process to plan for (null: the GPU's, or on CPU the machine's shared by the processes)."""
    search_only: bool = False
    """Stop once chosen: write auto/ (candidates.csv, experiment/best.yaml) and train nothing."""

    def __post_init__(self) -> None:
        require(self.mode in MODES, KEY + "mode", self.mode, f"allowed: {', '.join(MODES)}", MODES)
        require(self.budget_s is None or self.budget_s > 0, KEY + "budget_s", self.budget_s,
                "must be > 0 (or null: scaled to the job)")
        require(self.trial_steps is None or self.trial_steps >= 2, KEY + "trial_steps", self.trial_steps,
                "must be >= 2 (or null: 20, at most the job's steps)")
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
    micro_batch: Optional[int] = None  # the data.batch_size it trains with (None: the data has none)
    status: str = "candidate"  # candidate | pruned | refused | ok | failed | out_of_memory | not tried
    reason: str = ""
    measured: Dict[str, Any] = field(default_factory=dict)
    trial_s: Optional[float] = None  # its trial's wall time, processes' start-up to end, as the search saw it
    rehearsed: Dict[str, Any] = field(default_factory=dict)  # its rehearsal's peak, needs and prediction (mode=rehearse)

    @property
    def label(self) -> str:
        return "+".join(member_label(name, knobs) for name, knobs in self.strategies.items()) or "none"


def member_label(name: str, knobs: Dict[str, Any]) -> str:
    return name + "".join(f"({k}={v})" for k, v in knobs.items())


def memory_text(size: float) -> str:
    """Bytes in the largest binary unit they reach: 1.14 GiB, 13.7 MiB, 96.0 KiB (never 0.00 GiB)."""
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if size >= scale:
            return f"{size / scale:.{digits}f} {unit}"
    return f"{size:.0f} bytes"


def micro_batch(batch_size: Optional[int], strategies: Dict[str, Dict[str, Any]]) -> Optional[int]:
    """The data.batch_size a run of these strategies trains with: gradient merging's k micro-batches
    of batch / k keep the global batch (and the numerics) the same."""
    if batch_size is None:
        return None
    return batch_size // strategies.get("gradient_merge", {}).get("k_steps", 1)


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
    memory = replace(memory, activations=memory.held_activations(facts))
    return memory, math.prod(knobs.speed(facts) for knobs in strategies.values())


def fits(memory: Memory, facts: Facts) -> bool:
    return facts.device_memory_bytes is None or memory.total <= facts.device_memory_bytes


def over_memory(memory: Memory, facts: Facts) -> str:
    return f"estimated {memory_text(memory.total)} per process > {memory_text(facts.device_memory_bytes)}"


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
    (gradient_merge) appear only with combinations that do not fit without them, and then only
    down to the largest micro-batch that fits (as DeepSpeed's autotuner, which takes the largest
    micro-batch that fits)."""
    usable, _ = considered(facts, auto)
    found: List[Candidate] = []
    for size in range(len(usable) + 1):
        for names in itertools.combinations(usable, size):
            if not allowed(names, rows):
                continue
            for knobs in itertools.product(*(schemas()[name]().variants(facts) for name in names)):
                found.append(candidate(facts, dict(zip(names, knobs))))
    largest_fitting: Dict[str, int] = {}  # by the strategies that are not memory-only
    for c in found:
        if fits(c.memory, facts):
            base = without_memory_only(c)
            largest_fitting[base] = max(largest_fitting.get(base, 0), c.micro_batch or 0)
    kept = [c for c in found if not any(schemas()[name].for_memory_only for name in c.strategies)
            or (c.micro_batch or 0) >= largest_fitting.get(without_memory_only(c), 0)]
    for c in kept:
        if not fits(c.memory, facts):
            c.status, c.reason = "pruned", over_memory(c.memory, facts)
    return sorted(kept, key=lambda c: (c.status == "pruned", -c.speed))


def candidate(facts: Facts, strategies: Dict[str, Dict[str, Any]]) -> Candidate:
    memory, speed = estimate(facts, built(strategies))
    return Candidate(strategies, memory, speed, micro_batch(facts.batch_size, strategies))


def without(c: Candidate, names: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    return {name: knobs for name, knobs in c.strategies.items() if name not in names}


def without_memory_only(c: Candidate) -> str:
    memory_only = [name for name in c.strategies if schemas()[name].for_memory_only]
    return Candidate(without(c, memory_only), c.memory, c.speed).label


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


def contenders(listed: Sequence[Candidate], facts: Facts, auto: AutoConfig) -> List[Candidate]:
    """The candidates that may win: those neither pruned nor refused. None: the run is refused in
    one line naming the smallest estimate and what would make it fit."""
    found = [c for c in listed if c.status not in EXCLUDED]
    if not found:
        raise ConfigError(KEY + "device_memory_gb", auto.device_memory_gb, nothing_fits(listed, facts))
    return found


def nothing_fits(listed: Sequence[Candidate], facts: Facts) -> str:
    """The smallest estimate over the memory (a refused candidate's would not run) and what would make it fit."""
    smallest = min([c for c in listed if c.status == "pruned"] or listed, key=lambda c: c.memory.total)
    limit, memory = facts.device_memory_bytes or 0, smallest.memory
    remedies = [f"more processes (now {facts.world_size})"]
    fixed = memory.total - memory.activations  # activations grow with the batch, the rest does not
    if facts.batch_size and memory.activations and fixed < limit:
        most = math.floor(facts.batch_size * (limit - fixed) / memory.activations)
        if most >= 1:
            remedies.append(f"data.batch_size <= {most} (now {facts.batch_size})")
    remedies.append(f"{KEY}device_memory_gb >= {math.ceil(memory.total / 2**30 * 1000) / 1000}")
    return (f"no candidate fits: the smallest estimate, {smallest.label}, is {memory_text(memory.total)} per process "
            f"> {memory_text(limit)}; to fit: {', '.join(remedies[:-1])} or {remedies[-1]}")


# How the chosen candidate compares with another: "by the speed model (0.95 vs 0.80)".
Comparison = Callable[[Candidate, Candidate], str]


@dataclass
class Choice:
    """The candidates that may win, best first (the first is chosen), how two of them compare, and
    for every strategy why it was taken or left out."""

    ranked: List[Candidate]
    compare: Comparison
    why: Dict[str, str]

    @property
    def winner(self) -> Candidate:
        return self.ranked[0]


def fleet_preferences(facts: Facts, auto: AutoConfig,
                      rows: Sequence[FrozenSet[str]]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """What Fleet's rules turn on whatever the memory, with why: amp on GPUs; if allowed, the
    numerics-changing strategies that apply, in Fleet's order, each while the table allows the
    set. And why they leave each other strategy of those kinds out."""
    usable, _ = considered(facts, auto)
    preferred: Dict[str, str] = {}
    left_out: Dict[str, str] = {}
    if "amp" in usable and facts.device == "cuda":
        preferred["amp"] = "16-bit matrix products run several times faster on GPUs"
    elif "amp" in usable:
        left_out["amp"] = "left out: on CPUs 16-bit autocast is slower than float32"
    others = [name for name, schema in schemas().items() if schema.changes_numerics and name not in NUMERICS]
    for name in [*NUMERICS, *others]:  # Fleet's order
        if name not in usable:
            continue
        if name in others:
            left_out[name] = f"left out: of those changing the numerics, Fleet's rules turn on {', '.join(NUMERICS)}"
        elif allowed([*preferred, name], rows):
            preferred[name] = "applies to this optimizer and world (strategy.auto.allow_numerics_change=true)"
        else:
            left_out[name] = f"left out: the table does not allow it with {'+'.join(preferred)}"
    return preferred, left_out


def rules(facts: Facts, auto: AutoConfig, listed: Sequence[Candidate], rows: Sequence[FrozenSet[str]]) -> Choice:
    """Fleet-like rules over the `listed` candidates, without trials: of those that fit and the
    plan allows (one whose trial failed last), the first by Fleet's preferences (amp on GPUs
    only; the numerics-changing strategies Fleet turns on, if allowed), then by the speed model,
    then by the larger micro-batch, then by fewer strategies."""
    preferred, left_out = fleet_preferences(facts, auto, rows)
    bound = {"amp", *(name for name, schema in schemas().items() if schema.changes_numerics)}

    def departures(c: Candidate) -> int:  # from Fleet's preferences
        return len((bound & set(c.strategies)) ^ set(preferred))

    def compare(a: Candidate, b: Candidate) -> str:
        if departures(a) != departures(b):
            return f"by Fleet's preferences ({'+'.join(preferred) or 'no amp on CPUs, no numerics change'})"
        if a.speed != b.speed:
            return f"by the speed model ({a.speed:.2f} vs {b.speed:.2f})"
        if a.micro_batch != b.micro_batch:
            return f"by the larger micro-batch ({a.micro_batch} vs {b.micro_batch}) at the same speed factor"
        return f"by fewer strategies at the same speed factor ({a.speed:.2f})"

    ranked = sorted(contenders(listed, facts, auto), key=lambda c: (
        c.status in TRIAL_FAILED, departures(c), -c.speed, -(c.micro_batch or 0), len(c.strategies)))
    return Choice(ranked, compare, accounts(ranked, listed, facts, auto, compare, preferred, left_out))


def accounts(ranked: Sequence[Candidate], listed: Sequence[Candidate], facts: Facts, auto: AutoConfig,
             compare: Comparison, preferred: Dict[str, str], left_out: Dict[str, str]) -> Dict[str, str]:
    """For every strategy, why it was taken or left out, `ranked[0]` being chosen. `preferred`,
    `left_out`: the reasons of preference, where the memory does not decide."""
    winner = ranked[0]
    usable, why = considered(facts, auto)
    for name in usable:
        with_it = [c for c in listed if name in c.strategies]
        best_with = next((c for c in ranked if name in c.strategies), None)
        if name in winner.strategies:
            rest = over_without(winner, name, listed, facts)
            if rest:
                why[name] = f"taken: without it, {rest}"
            elif name in preferred:
                why[name] = f"taken: {preferred[name]}"
            else:
                why[name] = f"taken: {winner.label} ranks first" + (f" {compare(winner, ranked[1])}" if ranked[1:] else "")
        elif name in left_out:
            why[name] = left_out[name]
        elif best_with is not None:
            # Its own candidate's figures first (those of its trial line), then the best with it, if another.
            alone = next((c for c in ranked if set(c.strategies) == {name}), best_with)
            why[name] = f"left out: {winner.label} fits and ranks before {alone.label} {compare(winner, alone)}" + (
                f" and before the best with it, {best_with.label}, {compare(winner, best_with)}"
                if best_with is not alone else "")
        elif not with_it:  # memory-only: listed only beside what does not fit without it
            why[name] = "left out: the estimate fits without it"
        else:
            why[name] = f"left out: {unavailable(with_it)}"
    return why


def over_without(c: Candidate, name: str, listed: Sequence[Candidate], facts: Facts) -> Optional[str]:
    """Why `c` without strategy `name` does not fit (None: it does): its rehearsal's verdict where it
    was rehearsed, else the estimate."""
    rest = without(c, [name])
    rehearsed = next((other for other in listed if other.strategies == rest and other.rehearsed), None)
    if rehearsed is not None:
        return rehearsed.reason if rehearsed.status == "does not fit" else None
    estimate = candidate(facts, rest)
    return None if fits(estimate.memory, facts) else over_memory(estimate.memory, facts)


def unavailable(with_it: Sequence[Candidate]) -> str:
    """Why none of these candidates (those with one strategy) could win: a failed or untried
    trial, else the smallest estimate over the memory and the plan's refusal."""
    tried = next((c for c in with_it if c.status not in EXCLUDED), None)
    if tried is not None:
        return f"{tried.label}: {tried.status}" + (f": {tried.reason}" if tried.reason else "")
    pruned = [c for c in with_it if c.status == "pruned"]
    refused = [c for c in with_it if c.status == "refused"]
    parts = []
    if pruned:
        smallest = min(pruned, key=lambda c: c.memory.total)
        parts.append(f"the smallest estimate with it, {smallest.label}, is over the memory ({smallest.reason})")
    if refused:
        parts.append(f"{len(refused)} with it refused by the plan ({refused[0].label}: {refused[0].reason})")
    return "; ".join(parts)


def standing(c: Candidate, choice: Choice, facts: Facts) -> str:
    """`c`'s estimate and place: its measured samples/s after a trial, else its rank by the rules."""
    limit = f" (of {memory_text(facts.device_memory_bytes)})" if facts.device_memory_bytes else ""
    batch = f", micro-batch {c.micro_batch}" if c.micro_batch is not None else ""
    if c.rehearsed:
        rehearsed = c.rehearsed
        rate = (f", predicted {rehearsed['predicted_samples_per_s']:,.1f} samples/s on {rehearsed['device']}"
                if rehearsed.get("predicted_samples_per_s") else f", speed factor {c.speed:.2f}")
        return (f"rehearsed peak {memory_text(rehearsed['peak_bytes'])}, needs {memory_text(rehearsed['needs_bytes'])} "
                f"per process with the reserve (of {memory_text(rehearsed['memory_bytes'])}){batch}{rate}")
    place = (f"measured {c.measured['samples_per_s']:,.1f} samples/s" if c.measured else
             f"rank {choice.ranked.index(c) + 1} of {len(choice.ranked)} that fit, speed factor {c.speed:.2f}")
    return f"estimated {memory_text(c.memory.total)} per process{limit}{batch}, {place}"


def verdict(mode: str, choice: Choice, listed: Sequence[Candidate], facts: Facts) -> List[str]:
    """One line for the winner (estimate, speed, how the others lost) and one for the runner-up."""
    winner = choice.winner
    others = Counter(c.status for c in listed if c is not winner)
    lost = ", ".join(f"{count} {LOST[status]}" for status, count in others.items())
    lines = [f"auto ({mode}): chose {winner.label}: {standing(winner, choice, facts)}"
             + (f"; {winner.reason}" if winner.reason else "") + (f"; of the others {lost}" if lost else "")]
    if choice.ranked[1:]:
        runner_up = choice.ranked[1]
        lines.append(f"auto: runner-up {runner_up.label}: {standing(runner_up, choice, facts)}; "
                     f"lost {choice.compare(winner, runner_up)}")
    return lines
