"""`strategy=[auto]` in the job: gather the facts (plugins/auto.py), list the candidates
(runner/strategies/auto.py), judge them by the mode's `Judge` — rules; trials, each a real run of
its own processes in auto/trials/<k>/; or rehearsals for a cluster, each `lightfleet rehearse`'s
rehearsal in auto/rehearsals/<k>/ — write auto/ and hand back the winner's spec and plan.
Decided once, before any rank of the run starts, so every rank trains the same choice.

    auto/candidates.csv      every candidate: status, reason, micro-batch, estimates, what its trial
                             measured or its rehearsal found
    auto/choice.yaml         the mode, the facts, the winner and why each strategy was taken or left out
    auto/experiment/best.yaml  the winner, one self-contained file: lightfleet --config-dir RUN_DIR/auto experiment=best
    auto/trials/, sweep.yaml the trials' run directories (`lightfleet report RUN_DIR/auto` compares them)
    auto/rehearsals/<k>/     the rehearsals' run directories, each with its rehearsal.yaml

With dry_run=true, `preview` says what auto knows and would do, and nothing is written or trained.

Over 400 lines: one orchestration of auto's three judges (DESIGN.md: one interface, not a branch
per mode) and the records they share; each judge's own work lives with its mode (trials in
runner/strategies/_auto_search.py, rehearsals in runner/command/rehearse.py).
"""
from __future__ import annotations

import csv
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import OmegaConf

from plugins.auto import gather_facts
from runner.rank.build import device_type, instantiate_checked
from runner.config.compat import load_table
from runner.config.checks import RunSpec, validate
from runner.config.rehearse import RehearseConfig, Target
from runner.command.console import library_warnings_to_log
from runner.command.planning import plan_for
from runner.command.rehearse import RankFailed, kinds_of, rehearse_dir
from runner.core.clock import mark_start, started_at
from runner.core.contribution import Facts
from runner.core.errors import ConfigError, Refusal
from runner.core.paths import python_module
from runner.core.plan import Plan
from runner.core.prediction import load_devices
from runner.records.files import (AGAIN, AUTO_DIR, CANDIDATES_CSV, CHOICE_YAML, FAILED, FINISHED, OUT_OF_MEMORY,
                                  REFUSED, REHEARSALS_DIR, SWEEP_YAML, TRIAL_LOG, TRIALS_DIR, failure_outcome,
                                  job_ending)
from runner.records.run_dir import create_run_dir, record_failure, write_yaml
from runner.strategies import schemas
from runner.strategies._auto_search import (MIN_TRIALS, SEARCH_SHARE, RunCost, SearchPlan, scaled, search_plan,
                                            trial_steps)
from runner.strategies.auto import (AutoConfig, Candidate, Choice, accounts, candidates, contenders,
                                    memory_text, micro_batch, rules, trial_order, verdict)
from runner.core.world import World

# What a trial leaves out: it only measures speed and memory.
TRIAL_TRAINER = {"limit_val_batches": 0, "enable_checkpointing": False, "enable_progress_bar": False,
                 "num_sanity_val_steps": 0}
MEASURED = ("samples_per_s", "step_time_median_s", "peak_memory_mb")  # of a trial's results, into candidates.csv
REHEARSED = ("peak_bytes", "needs_bytes", "predicted_samples_per_s")  # of a rehearsal's, into candidates.csv
# The top two trials closer than this are within a short trial's noise on a shared machine: both run again.
CONFIRM_WITHIN = 0.05


@dataclass
class Chosen:
    """The winner's spec and plan, and what choosing took, in words for the run's done line."""

    spec: RunSpec
    plan: Plan
    words: str


@dataclass
class Judging:
    """What a judge is handed: the run, auto's knobs, the facts, the candidates (statuses and figures
    filled in by the judge), where auto's records go and the command line."""

    spec: RunSpec
    auto: AutoConfig
    facts: Facts
    listed: List[Candidate]
    auto_dir: Path
    command: Sequence[str]


class Judge:
    """One way of judging the candidates (auto's mode): `choose` ranks them (best first) and says how
    many runs that took; `preview` says, for dry_run=true, what it would do, running nothing; `facts`:
    those of the device judged for; `estimates_prune`: a candidate over the
    memory by the estimate is left out unjudged; `elsewhere`: why the winner trains elsewhere, not
    here (None: the run trains it now); `runs_dir`: the folder of auto/ its runs go in (None: it runs none)."""

    estimates_prune = True
    runs_dir: Optional[str] = None

    def facts(self, spec: RunSpec, auto: AutoConfig) -> Facts:
        return run_facts(spec, auto.device_memory_gb)

    def choose(self, judging: Judging) -> Tuple[Choice, int]:
        raise NotImplementedError

    def preview(self, judging: Judging) -> List[str]:
        raise NotImplementedError

    def words(self, seconds: float, runs: int) -> str:
        raise NotImplementedError

    def elsewhere(self, judging: Judging) -> Optional[str]:
        return None


class Rules(Judge):
    """Fleet-like rules over the estimates (runner/strategies/auto.py: rules)."""

    def choose(self, judging: Judging) -> Tuple[Choice, int]:
        return rules(judging.facts, judging.auto, judging.listed, load_table().allowed), 0

    def preview(self, judging: Judging) -> List[str]:
        choice, _ = self.choose(judging)
        return [*verdict(judging.auto.mode, choice, judging.listed, judging.facts), *reasons(choice)]

    def words(self, seconds: float, runs: int) -> str:
        return f"auto's rules {seconds:.1f} s"


class Search(Judge):
    """Short measured trials, the highest samples/s wins (`search`)."""

    runs_dir = TRIALS_DIR

    def choose(self, judging: Judging) -> Tuple[Choice, int]:
        return search(judging.spec, judging.listed, judging.auto, judging.auto_dir, judging.command, judging.facts)

    def preview(self, judging: Judging) -> List[str]:
        auto, spec = judging.auto, judging.spec
        fitting = len(contenders(judging.listed, judging.facts, auto))
        cost = RunCost.before_trials(time.time() - started_at())
        plan = search_plan(auto, job_steps(spec), fitting, cost)
        return [f"auto (search): would run trials of up to {plan.expected} of the {fitting} candidates "
                f"that fit, {plan_words(plan, auto, job_steps(spec), cost)}; dry_run=true runs none"]

    def words(self, seconds: float, runs: int) -> str:
        return f"auto's search {seconds:.1f} s, {runs} trial{'s' if runs != 1 else ''}"


class Rehearsal(Judge):
    """For a cluster this machine is not: each candidate rehearsed as `lightfleet rehearse` does
    (runner/command/rehearse.py: its rank kinds on fake tensors at the run's world size, for
    rehearse.device), no trials, no GPU; those that fit (peak + reserve against the device) ranked by
    predicted samples/s (the speed model where the device table has no prediction: a run on CPUs).
    The choice is for that cluster: nothing trains here."""

    estimates_prune = False  # the rehearsal measures what the estimate guesses
    runs_dir = REHEARSALS_DIR

    def facts(self, spec: RunSpec, auto: AutoConfig) -> Facts:
        """rehearse.device's, not this machine's: its memory, and bfloat16 where the table gives it a peak."""
        knobs, target = rehearsal_target(spec)
        bf16 = target.device_type == "cpu" or "bfloat16" in load_devices()[knobs.device].flops
        return run_facts(spec, target.memory_gb, target.device_type, bf16)

    def choose(self, judging: Judging) -> Tuple[Choice, int]:
        knobs, target = rehearsal_target(judging.spec)
        pending = self.pending(judging)
        kinds = kind_count(pending)
        print(self.cost(judging, pending), flush=True)
        started, done = time.monotonic(), 0
        for count, (number, c, spec, plan) in enumerate(pending, 1):
            run_dir = judging.auto_dir / self.runs_dir / str(number)
            spec.cfg.paths.output_dir = str(run_dir)
            create_run_dir(spec.cfg, plan, judging.command, run_dir)
            began = time.monotonic()
            try:
                found = rehearse_dir(run_dir, spec, plan, knobs, target, said=lambda line: print(f"auto:   {line}"))
            except RankFailed as failure:  # a layout this world cannot hold: the candidate is out
                c.status, c.reason = FAILED, str(failure)
            else:
                slowest = found.slowest if found.predictions else None
                c.rehearsed = {"peak_bytes": found.peak, "needs_bytes": found.needs, "memory_bytes": target.memory,
                               "device": target.name,
                               "predicted_samples_per_s": slowest.samples_per_s if slowest else None}
                # The verdict without its knob's name: "rank 0 (...) needs 37.6 MiB (peak ...) of 30.7 MiB, ..."
                c.status, c.reason = ("fits", "") if found.problem is None else ("does not fit", found.problem.allowed)
            c.trial_s = time.monotonic() - began
            done += len(kinds_of(spec, plan))
            left = (time.monotonic() - started) / done * (kinds - done)
            print(f"auto: rehearsal {count}/{len(pending)} {c.label}: {c.status}"
                  + (f": {c.reason}" if c.reason else "") + f" ({c.trial_s:.0f} s; about {left:.0f} s more)", flush=True)
        fitting = [c for c in judging.listed if c.status == "fits"]
        if not fitting:  # each candidate's verdict kept for the user
            write_candidates(judging.auto_dir, judging.listed)
            raise ConfigError(knobs.memory_key(), None, no_rehearsal_fits(judging.listed))

        def compare(a: Candidate, b: Candidate) -> str:
            rate_a, rate_b = a.rehearsed["predicted_samples_per_s"], b.rehearsed["predicted_samples_per_s"]
            if rate_a and rate_b and rate_a != rate_b:
                return f"by predicted samples/s on {target.name} ({rate_a:,.1f} vs {rate_b:,.1f})"
            if a.speed != b.speed:
                return f"by the speed model ({a.speed:.2f} vs {b.speed:.2f})"
            return (f"by the smaller need ({memory_text(a.rehearsed['needs_bytes'])} vs "
                    f"{memory_text(b.rehearsed['needs_bytes'])})")

        ranked = sorted(fitting, key=lambda c: (-(c.rehearsed["predicted_samples_per_s"] or 0), -c.speed,
                                                c.rehearsed["needs_bytes"], len(c.strategies)))
        return Choice(ranked, compare, accounts(ranked, judging.listed, judging.facts, judging.auto, compare,
                                                preferred={}, left_out={})), len(pending)

    def pending(self, judging: Judging) -> List[Tuple[int, Candidate, RunSpec, Plan]]:
        """The candidates to rehearse, with their spec and plan (the plan refused none of them)."""
        device = judging.facts.device
        return [(number, c, with_strategies(judging.spec, c.strategies), candidate_plan(judging.spec, c, device))
                for number, c in enumerate(judging.listed) if c.status == "candidate"]

    def cost(self, judging: Judging, pending: Sequence[Tuple[int, Candidate, RunSpec, Plan]]) -> str:
        """What rehearsing them all takes: rank kinds x seconds a kind (before any is rehearsed, as long
        as this command took to start: a rehearsed rank imports torch and Lightning and builds the model too)."""
        knobs, target = rehearsal_target(judging.spec)
        kinds = kind_count(pending)
        each = time.time() - started_at()
        # A rank's process keeps about two cores busy (torch's threads): side by side only where cores are free.
        side_by_side = min(knobs.at_once, max(1, (os.cpu_count() or 1) // 2))
        return (f"auto (rehearse): {len(pending)} candidates to rehearse at {judging.facts.world_size} processes for "
                f"{target.name} ({target.memory_gb:g} GiB), {kinds} rank kinds (more where ZeRO stage 1's heaviest rank "
                f"differs), {knobs.at_once} at a time: about {kinds * each / side_by_side:.0f} s (an estimate: "
                f"{each:.0f} s a kind, as long as this command took to start, {side_by_side} side by side on "
                f"{os.cpu_count()} cores)")

    def preview(self, judging: Judging) -> List[str]:
        return [f"{self.cost(judging, self.pending(judging))}; dry_run=true rehearses none"]

    def elsewhere(self, judging: Judging) -> Optional[str]:
        target = rehearsal_target(judging.spec)[1]
        devices = "CPU processes" if target.device_type == "cpu" else f"{target.name} GPUs"
        return (f"chosen for {judging.facts.world_size} {devices} ({judging.facts.num_nodes} node(s)), which this "
                f"machine only rehearsed: nothing trains here; on the cluster run: "
                f"lightfleet --config-dir {judging.auto_dir} experiment=best")


JUDGES: Dict[str, Judge] = {"rules": Rules(), "search": Search(), "rehearse": Rehearsal()}  # by strategy.auto.mode


def kind_count(pending: Sequence[Tuple[int, Candidate, RunSpec, Plan]]) -> int:
    """The rank kinds the candidates' layouts hold, all together (before any names a heaviest rank)."""
    return sum(len(kinds_of(spec, plan)) for _, _, spec, plan in pending)


def rehearsal_target(spec: RunSpec) -> Tuple[RehearseConfig, Target]:
    """The rehearse.* knobs and the device they rehearse for (trainer.accelerator's: CUDA or CPUs)."""
    knobs: RehearseConfig = OmegaConf.to_object(spec.cfg.rehearse)
    return knobs, knobs.target(spec.trainer.accelerator)


def no_rehearsal_fits(listed: Sequence[Candidate]) -> str:
    """The refusal's words: the rehearsed candidate that needs least, and its own verdict."""
    rehearsed = [c for c in listed if c.rehearsed]
    if not rehearsed:
        return f"no candidate could be rehearsed: {next((c.reason for c in listed if c.reason), 'none listed')}"
    least = min(rehearsed, key=lambda c: c.rehearsed["needs_bytes"])
    return f"no candidate fits: the one that needs least, {least.label}: {least.reason}"


def choose(spec: RunSpec, records: Path, command: Sequence[str]) -> Optional[Chosen]:
    """The winner's spec and plan (None with search_only or a judge that does not train here:
    chosen, nothing to train). Refused in one line (ConfigError) when no candidate fits."""
    started = time.monotonic()
    auto: AutoConfig = spec.strategies["auto"]
    judge = JUDGES[auto.mode]
    facts, listed = facts_and_candidates(spec, auto)
    auto_dir = records / AUTO_DIR
    judging = Judging(spec, auto, facts, listed, auto_dir, command)
    choice, runs = judge.choose(judging)
    chosen = with_strategies(spec, choice.winner.strategies)
    write_records(auto_dir, chosen, auto, facts, listed, choice)
    print("\n".join([*verdict(auto.mode, choice, listed, facts), *reasons(choice),
                     f"auto: candidates in {auto_dir / CANDIDATES_CSV}; the choice again: "
                     f"lightfleet --config-dir {auto_dir} experiment=best"]), flush=True)
    elsewhere = judge.elsewhere(judging)
    if elsewhere:
        print(f"auto ({auto.mode}): {elsewhere}", flush=True)
    if auto.search_only or elsewhere:
        return None
    return Chosen(chosen, plan_for(chosen), judge.words(time.monotonic() - started, runs))


def preview(spec: RunSpec) -> str:
    """For dry_run=true: the facts, the candidates and what the mode's judge would do; nothing is
    trained, rehearsed or written. Refused like a run when no candidate fits."""
    auto: AutoConfig = spec.strategies["auto"]
    facts, listed = facts_and_candidates(spec, auto)
    known = ", ".join(fact_text(name, value) for name, value in asdict(facts).items())
    lines = [f"auto: facts: {known}", "auto: candidates (estimated memory per process, speed factor, micro-batch):",
             *(f"  {c.label}: {memory_text(c.memory.total)}, {c.speed:.2f}, {c.micro_batch}: {c.status}"
               + (f": {c.reason}" if c.reason else "") for c in listed)]
    return "\n".join([*lines, *JUDGES[auto.mode].preview(Judging(spec, auto, facts, listed, Path(), ()))])


def job_steps(spec: RunSpec) -> Optional[int]:
    """The steps the job trains (None: trained by epochs, a number not known before its data is)."""
    return spec.trainer.max_steps if spec.trainer.max_steps > 0 else None


def plan_words(plan: SearchPlan, auto: AutoConfig, steps: Optional[int], cost: RunCost) -> str:
    """A search plan's trial steps, expected time (said to be an estimate, and from what) and bounds."""
    if cost.step_s is None:
        basis = (f"its launcher's and then its ranks' start-up, each taken as long as this command's, "
                 f"{cost.startup_s / 2:.0f} s; its steps not measured yet")
    else:
        basis = f"as the trials so far took: {cost.startup_s:.0f} s to start, {cost.step_s:.3g} s a step"
    if scaled(auto, steps):
        bound = (f"trials take at most {SEARCH_SHARE:.0%} of the job's expected training time ({steps} steps, "
                 f"about {cost.job_seconds(steps):.0f} s), at least {MIN_TRIALS}, none starting after "
                 f"{plan.budget_s:g} s (strategy.auto.budget_s or max_trials set them)")
    else:
        most = f"at most {auto.max_trials} trials (strategy.auto.max_trials), " if auto.max_trials else ""
        bound = f"{most}none starting after {plan.budget_s:g} s (strategy.auto.budget_s)"
    return (f"{plan.steps} steps each, about {plan.seconds:.0f} s in all (an estimate: {plan.trial_s:.0f} s a trial, "
            f"{basis}); {bound}")


def fact_text(name: str, value: Any) -> str:
    if name == "saved":  # the whole batch's, by precision (the split is in auto/choice.yaml)
        value = "not measured" if value is None else ", ".join(
            f"{precision} {memory_text(split['total'])}" for precision, split in value.items())
    elif name.endswith("_bytes") and value:
        value = memory_text(value)
    return f"{name}={value}"


def reasons(choice: Choice) -> List[str]:
    return [f"auto: {name}: {reason}" for name, reason in sorted(choice.why.items())]


def facts_and_candidates(spec: RunSpec, auto: AutoConfig) -> Tuple[Facts, List[Candidate]]:
    """The facts of this run and its candidates, those the plan refuses marked so (and, where the
    mode's judge decides the memory itself, none pruned by the estimate)."""
    judge = JUDGES[auto.mode]
    facts = judge.facts(spec, auto)
    listed = candidates(facts, auto, load_table().allowed)
    for c in listed:
        if c.status == "pruned" and not judge.estimates_prune:
            c.status, c.reason = "candidate", ""
        refuse_unplannable(spec, c, facts.device)
    return facts, listed


def run_facts(spec: RunSpec, device_memory_gb: Optional[float], device: Optional[str] = None,
              bf16: Optional[bool] = None) -> Facts:
    """The facts of this run (plugins/auto.py), planned for `device` (default: trainer.accelerator's
    on whatever machine plans it, auto: this machine's) and its `bf16` (default: this machine's)."""
    world = World.of(spec.trainer)
    with library_warnings_to_log(spec.cfg.verbose):  # the first batch's loader: torchdata's deprecation warning
        return gather_facts(lambda: instantiate_checked("model", spec.cfg.model),
                            instantiate_checked("data", spec.cfg.data),
                            device=device or device_type(spec.trainer.accelerator),
                            world_size=world.known_size("auto"), num_nodes=world.num_nodes,
                            batch_size=spec.batch_size, device_memory_gb=device_memory_gb, bf16=bf16)


def search(spec: RunSpec, listed: List[Candidate], auto: AutoConfig, auto_dir: Path, command: Sequence[str],
           facts: Facts) -> Tuple[Choice, int]:
    """Trial the candidates that fit in `trial_order` until the search's plan is spent (its length
    scaled to the job unless the user bounds it); the highest measured samples/s wins (rules decide
    when no trial finished). Also how many trials ran."""
    pending = [(number, c) for number, c in enumerate(listed) if c.status == "candidate"]
    total, steps = len(pending), job_steps(spec)
    cost = RunCost.before_trials(time.time() - started_at())
    plan = search_plan(auto, steps, total, cost)
    print(f"auto: {total} candidates fit; {plan.expected} trials planned, {plan_words(plan, auto, steps, cost)}",
          flush=True)
    started, tried = time.monotonic(), 0  # the budget counts seconds of trials
    timed: List[Tuple[float, int, float]] = []  # the finished trials' (seconds, steps, median step seconds)
    while pending:
        done = [c for c in listed if c.status == "ok"]
        pending.sort(key=lambda item: trial_order(item[1], done, facts))
        number, c = pending.pop(0)
        if time.monotonic() - started > plan.budget_s or (plan.most is not None and tried >= plan.most):
            c.status, c.reason = "not tried", "budget spent"
            continue
        tried += 1
        of = min(total, plan.most or total)
        print(f"auto: trial {tried}/{of} {c.label}: starting ({time.monotonic() - started:.0f} s of the budget "
              f"spent)", flush=True)
        c.trial_s = run_trial(spec, c, auto, auto_dir / TRIALS_DIR / str(number), command)
        figures = f"{c.measured['samples_per_s']:,.1f} samples/s" if c.status == "ok" else f"{c.status}: {c.reason}"
        print(f"auto: trial {tried}/{of} {c.label}: {figures} ({c.trial_s:.0f} s)", flush=True)
        if c.status == "ok" and c.measured.get("step_time_median_s"):
            timed.append((c.trial_s, plan.steps, c.measured["step_time_median_s"]))
            cost = RunCost.measured(timed)
            replanned = search_plan(auto, steps, total, cost)
            if scaled(auto, steps) and replanned.most != plan.most:  # the job's length now known in seconds
                more = max(0, replanned.expected - tried) * replanned.trial_s
                print(f"auto: {replanned.expected} trials planned now, about {more:.0f} s more: "
                      f"{plan_words(replanned, auto, steps, cost)}", flush=True)
            plan = replanned
    finished = sorted((c for c in listed if c.status == "ok"), key=lambda c: -c.measured["samples_per_s"])
    if not finished:
        choice = rules(facts, auto, listed, load_table().allowed)
        choice.winner.reason = "no trial finished: the rules' choice"
        return choice, tried
    if len(finished) >= 2 and within_noise(*finished[:2]):
        finished = confirmed(spec, listed, finished, auto, auto_dir, command)
        tried += 2
    return Choice(finished, faster, accounts(finished, listed, facts, auto, faster, preferred={}, left_out={})), tried


def within_noise(first: Candidate, second: Candidate) -> bool:
    return second.measured["samples_per_s"] >= (1 - CONFIRM_WITHIN) * first.measured["samples_per_s"]


def confirmed(spec: RunSpec, listed: List[Candidate], finished: List[Candidate], auto: AutoConfig, auto_dir: Path,
              command: Sequence[str]) -> List[Candidate]:
    """The top two trials, within a trial's noise of each other, run again (after the budget too:
    two trials more at most); each is ranked by the mean of its two trials. The winner's reason
    says whether the second trials changed the lead."""
    leader = finished[0]
    for c in finished[:2]:
        first = c.measured
        run_trial(spec, c, auto, auto_dir / TRIALS_DIR / f"{listed.index(c)}{AGAIN}", command)
        if c.status != "ok":  # a second trial that failed leaves the first one's figures
            c.status, c.measured, c.reason = "ok", first, f"its second trial failed: {c.reason}"
            continue
        trials = [first["samples_per_s"], c.measured["samples_per_s"]]
        c.measured = {**c.measured, "samples_per_s": sum(trials) / 2, "trials_samples_per_s": trials}
        print(f"auto: trial again {c.label}: {trials[1]:,.1f} samples/s (mean of two {c.measured['samples_per_s']:,.1f})",
              flush=True)
    ranked = sorted(finished, key=lambda c: -c.measured["samples_per_s"])
    verdict = "kept the lead" if ranked[0] is leader else f"took the lead from {leader.label}"
    ranked[0].reason = (f"the top two trials were within {CONFIRM_WITHIN:.0%}: both ran again; {ranked[0].label} "
                        f"{verdict} on the mean of two trials")
    return ranked


def faster(a: Candidate, b: Candidate) -> str:
    return f"by measured samples/s ({a.measured['samples_per_s']:,.1f} vs {b.measured['samples_per_s']:,.1f})"


def refuse_unplannable(spec: RunSpec, c: Candidate, device: str) -> None:
    """Mark `c` refused when the knobs' checks or the plan's rules refuse it on `device` (candidates
    come from the table's rows; e.g. pipeline with sharding needs replicas of a pipeline: 4 processes or more)."""
    if c.status == "candidate":
        try:
            candidate_plan(spec, c, device)
        except (ConfigError, Refusal) as problem:
            c.status, c.reason = "refused", str(problem)


def candidate_plan(spec: RunSpec, c: Candidate, device: str) -> Plan:
    return plan_for(with_strategies(spec, c.strategies), cuda_available=lambda: device == "cuda")


def run_trial(spec: RunSpec, c: Candidate, auto: AutoConfig, trial_dir: Path, command: Sequence[str]) -> float:
    """A short real run of candidate `c` in its own processes; its status and figures go into `c`,
    and a trial that did not finish records how it ended (failure.yaml), as a run does. Returns
    the seconds it took."""
    started = time.monotonic()
    mark_start()  # the trial's start-up and wall time (its results.yaml) count from its own start
    trial = with_strategies(spec, c.strategies, trial_dir=trial_dir, steps=trial_steps(auto, job_steps(spec)))
    create_run_dir(trial.cfg, plan_for(trial), command, trial_dir)
    log = trial_dir / TRIAL_LOG
    with log.open("w") as output, subprocess.Popen([*python_module("runner.command.launch"), str(trial_dir)],
                                                   stdout=output, stderr=subprocess.STDOUT) as done:
        try:
            done.wait()
        except BaseException:  # the command stopped (a signal, Ctrl-C): the trial's processes with it
            done.terminate()
            done.wait()
            raise
    ending = job_ending(trial_dir)
    if ending.outcome == FINISHED:
        c.status = "ok"
        c.measured = {key: ending.record.get(key) for key in MEASURED}
        return time.monotonic() - started
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    c.reason = lines[-1].strip() if lines else f"exit status {done.returncode}"
    record_failure(trial_dir, done.returncode, c.reason)
    c.status = failure_outcome(c.reason)
    return time.monotonic() - started


def with_strategies(spec: RunSpec, strategies: Dict[str, Dict[str, Any]], trial_dir: Optional[Path] = None,
                    steps: int = 0) -> RunSpec:
    """`spec` with these strategies instead of auto, at their micro-batch (gradient_merge's k
    micro-batches of batch / k keep the global batch); with `trial_dir`, as a short trial there
    that only measures."""
    plain = OmegaConf.to_container(spec.cfg, resolve=False)
    plain["strategy"] = {name: (asdict(schema(**strategies[name])) if name in strategies else None)
                         for name, schema in schemas().items()}
    split = micro_batch(spec.batch_size, strategies)
    if split != spec.batch_size:
        plain["data"]["batch_size"] = split
    if trial_dir is not None:
        plain["trainer"].update(TRIAL_TRAINER, max_steps=steps)
        plain.update(logger={}, callbacks={}, ckpt_path=None, test=False, evaluate=False)
        plain["paths"]["output_dir"] = str(trial_dir)
        plain["measure"].update(enabled=True, warmup_steps=min(plain["measure"]["warmup_steps"], steps // 2))
    return validate(OmegaConf.create(plain))


def write_records(auto_dir: Path, chosen: RunSpec, auto: AutoConfig, facts: Facts, listed: List[Candidate],
                  choice: Choice) -> None:
    write_candidates(auto_dir, listed)
    winner = choice.winner
    write_yaml(auto_dir / CHOICE_YAML, {"mode": auto.mode, "chosen": winner.label, "strategies": winner.strategies,
                                        "micro_batch": winner.micro_batch, "reason": winner.reason,
                                        "verdict": verdict(auto.mode, choice, listed, facts), "why": choice.why,
                                        "facts": asdict(facts), "knobs": asdict(auto)})
    # A candidate's "ok" is a trial that finished (runner/strategies/auto.py names its statuses).
    tried = {f"{TRIALS_DIR}/{n}": c for n, c in enumerate(listed)
             if c.status in ("ok", FAILED, OUT_OF_MEMORY, REFUSED) and (auto_dir / TRIALS_DIR / str(n)).is_dir()}
    write_yaml(auto_dir / SWEEP_YAML, {"jobs": {name: {"overrides": trial_overrides(c, facts), "reason": c.reason,
                                                       "status": FINISHED if c.status == "ok" else c.status}
                                                for name, c in tried.items()}})
    write_experiment(auto_dir, chosen, winner)


def write_candidates(auto_dir: Path, listed: Sequence[Candidate]) -> None:
    """candidates.csv: every candidate, its status and why, also when none is chosen."""
    auto_dir.mkdir(parents=True, exist_ok=True)
    with (auto_dir / CANDIDATES_CSV).open("w", newline="") as out:
        table = csv.writer(out)
        table.writerow(["candidate", "strategies", "status", "reason", "micro_batch", "estimated_memory_mib",
                        "estimated_speed", *MEASURED, *(f"rehearsed_{key}" for key in REHEARSED), "trial_s"])
        for number, c in enumerate(listed):
            table.writerow([number, c.label, c.status, c.reason, c.micro_batch, round(c.memory.total / 2**20, 2),
                            round(c.speed, 3), *(c.measured.get(key, "") for key in MEASURED),
                            *("" if c.rehearsed.get(key) is None else c.rehearsed[key] for key in REHEARSED),
                            "" if c.trial_s is None else round(c.trial_s, 1)])


def trial_overrides(c: Candidate, facts: Facts) -> List[str]:
    split = [f"data.batch_size={c.micro_batch}"] if c.micro_batch != facts.batch_size else []
    return [f"strategy={c.label}", *split]


def write_experiment(auto_dir: Path, chosen: RunSpec, winner: Candidate) -> None:
    """experiment/best.yaml: the winner as one self-contained experiment, its model, data, trainer,
    collective and strategy knobs inline and resolved, so that the file alone reruns the choice
    from any config directory's experiment/: lightfleet --config-dir DIR experiment=best."""
    config = OmegaConf.to_container(chosen.cfg, resolve=True)
    selected = {name: knobs for name, knobs in config["strategy"].items() if knobs is not None}
    # No model or data option under the inline ones: their keys would merge into the default's (mlp).
    defaults = [{"override /model": None}, {"override /data": None}, {"override /strategy": list(selected)}]
    body = {"defaults": defaults, "name": f"{config['name']}_auto", "seed": config["seed"],
            **{group: config[group] for group in ("model", "data", "trainer", "collective", "measure")},
            "strategy": selected}
    (auto_dir / "experiment").mkdir(exist_ok=True)
    (auto_dir / "experiment" / "best.yaml").write_text(
        f"# @package _global_\n# strategy=[auto] chose {winner.label} (choice.yaml beside experiment/ says why).\n"
        f"# Run: lightfleet --config-dir {auto_dir} experiment=best (or copy this file alone into another config "
        f"directory's experiment/)\n{yaml.safe_dump(body, sort_keys=False)}")
