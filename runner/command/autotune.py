"""`strategy=[auto]` in the job: gather the facts (plugins/auto.py), list the candidates
(runner/strategies/auto.py), pick one by rule or run short trials of them — each a real run of
its own processes in auto/trials/<k>/ — write auto/ and hand back the winner's spec and plan.
Decided once, before any rank of the run starts, so every rank trains the same choice.

    auto/candidates.csv      every candidate: status, reason, estimates, what its trial measured
    auto/choice.yaml         the mode, the facts, the winner and why each strategy was taken or left out
    auto/experiment/best.yaml  the winner as an experiment: lightfleet --config-dir RUN_DIR/auto experiment=best
    auto/trials/, sweep.yaml the trials' run directories (`lightfleet report RUN_DIR/auto` compares them)
"""
from __future__ import annotations

import csv
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import OmegaConf

from plugins.auto import gather_facts
from runner.rank.build import device_type, instantiate_checked
from runner.config.compat import load_table
from runner.config.checks import RunSpec, plan_for, validate
from runner.core.contribution import Facts
from runner.core.errors import ConfigError, Refusal
from runner.core.plan import Plan
from runner.records.files import (AUTO_DIR, CANDIDATES_CSV, CHOICE_YAML, FAILED, FINISHED, OUT_OF_MEMORY, REFUSED,
                                  SWEEP_YAML, TRIAL_LOG, TRIALS_DIR, failure_outcome, job_ending)
from runner.records.run_dir import create_run_dir, record_failure, write_yaml
from runner.strategies import schemas
from runner.strategies.auto import AutoConfig, Candidate, candidates, considered, rules, trial_order
from runner.core.world import World

# What a trial leaves out: it only measures speed and memory.
TRIAL_TRAINER = {"limit_val_batches": 0, "enable_checkpointing": False, "enable_progress_bar": False,
                 "num_sanity_val_steps": 0}
MEASURED = ("samples_per_s", "step_time_median_s", "peak_memory_mb")  # of a trial's results, into candidates.csv


def choose(spec: RunSpec, records: Path, command: Sequence[str]) -> Optional[Tuple[RunSpec, Plan]]:
    """The winner's spec and plan (None with search_only: chosen, nothing to train)."""
    auto: AutoConfig = spec.strategies["auto"]
    facts = facts_of(spec, auto)
    rows = load_table().allowed
    listed = candidates(facts, auto, rows)
    for c in listed:
        refuse_unplannable(spec, c)
    auto_dir = records / AUTO_DIR
    if auto.mode == "rules":
        winner, why = rules(facts, auto, rows)
    else:
        winner, why = search(spec, listed, auto, auto_dir, command, facts, rows)
    chosen = with_strategies(spec, winner.strategies)
    write_records(auto_dir, chosen, auto, facts, listed, winner, why)
    print("\n".join([f"auto ({auto.mode}): chose {winner.label}{'; ' + winner.reason if winner.reason else ''}",
                     *(f"auto: {name}: {reason}" for name, reason in sorted(why.items())),
                     f"auto: candidates in {auto_dir / CANDIDATES_CSV}; the choice again: "
                     f"lightfleet --config-dir {auto_dir} experiment=best"]), flush=True)
    if auto.search_only:
        return None
    return chosen, plan_for(chosen)


def facts_of(spec: RunSpec, auto: AutoConfig) -> Facts:
    world = World.of(spec.trainer)
    return gather_facts(lambda: instantiate_checked("model", spec.cfg.model), instantiate_checked("data", spec.cfg.data),
                        device=device_type(spec.trainer.accelerator),
                        world_size=world.known_size("auto"), num_nodes=world.num_nodes,
                        batch_size=spec.batch_size, device_memory_gb=auto.device_memory_gb)


def search(spec: RunSpec, listed: List[Candidate], auto: AutoConfig, auto_dir: Path, command: Sequence[str],
           facts: Facts, rows: Sequence[Any]) -> Tuple[Candidate, Dict[str, str]]:
    """Trial the candidates in `trial_order` until the budget is spent; the highest measured
    samples/s wins (rules decide when no trial finished)."""
    started, tried = time.monotonic(), 0
    pending = [(number, c) for number, c in enumerate(listed) if c.status == "candidate"]
    total = len(pending)
    while pending:
        done = [c for c in listed if c.status == "ok"]
        pending.sort(key=lambda item: trial_order(item[1], done, facts))
        number, c = pending.pop(0)
        if time.monotonic() - started > auto.budget_s or (auto.max_trials is not None and tried >= auto.max_trials):
            c.status, c.reason = "not tried", "budget spent"
            continue
        tried += 1
        run_trial(spec, c, auto, auto_dir / TRIALS_DIR / str(number), command)
        figures = f"{c.measured['samples_per_s']:,.1f} samples/s" if c.status == "ok" else f"{c.status}: {c.reason}"
        print(f"auto: trial {tried}/{total} {c.label}: {figures}", flush=True)
    finished = sorted((c for c in listed if c.status == "ok"), key=lambda c: -c.measured["samples_per_s"])
    if not finished:
        winner, why = rules(facts, auto, rows)
        winner.reason = "no trial finished: the rules' choice"
        return winner, why
    winner = finished[0]
    runner_up = f" (next: {finished[1].label}, {finished[1].measured['samples_per_s']:,.1f})" if len(finished) > 1 else ""
    _, why = considered(facts, auto)
    for name in schemas():
        if name in winner.strategies:
            why[name] = f"taken: the fastest trial, {winner.measured['samples_per_s']:,.1f} samples/s{runner_up}"
        elif name != "auto":
            why.setdefault(name, "left out: the fastest trial does not use it")
    return winner, why


def refuse_unplannable(spec: RunSpec, c: Candidate) -> None:
    """Mark `c` refused when the knobs' checks or the plan's rules refuse it here (candidates come
    from the table's rows; e.g. pipeline with sharding needs replicas of a pipeline: 4 processes or more)."""
    if c.status == "candidate":
        try:
            plan_for(with_strategies(spec, c.strategies))
        except (ConfigError, Refusal) as problem:
            c.status, c.reason = "refused", str(problem)


def run_trial(spec: RunSpec, c: Candidate, auto: AutoConfig, trial_dir: Path, command: Sequence[str]) -> None:
    """A short real run of candidate `c` in its own processes; its status and figures go into `c`,
    and a trial that did not finish records how it ended (failure.yaml), as a run does."""
    trial = with_strategies(spec, c.strategies, trial_dir=trial_dir, steps=auto.trial_steps)
    create_run_dir(trial.cfg, plan_for(trial), command, trial_dir)
    log = trial_dir / TRIAL_LOG
    with log.open("w") as output:
        done = subprocess.run([sys.executable, "-m", "runner.command.launch", str(trial_dir)], stdout=output,
                              stderr=subprocess.STDOUT)
    ending = job_ending(trial_dir)
    if ending.outcome == FINISHED:
        c.status = "ok"
        c.measured = {key: ending.record.get(key) for key in MEASURED}
        return
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    c.reason = lines[-1].strip() if lines else f"exit status {done.returncode}"
    record_failure(trial_dir, done.returncode, c.reason)
    c.status = failure_outcome(c.reason)


def with_strategies(spec: RunSpec, strategies: Dict[str, Dict[str, Any]], trial_dir: Optional[Path] = None,
                    steps: int = 0) -> RunSpec:
    """`spec` with these strategies instead of auto (gradient_merge's k micro-batches of batch / k
    keep the global batch); with `trial_dir`, as a short trial there that only measures."""
    plain = OmegaConf.to_container(spec.cfg, resolve=False)
    plain["strategy"] = {name: (asdict(schema(**strategies[name])) if name in strategies else None)
                         for name, schema in schemas().items()}
    if "gradient_merge" in strategies:
        plain["data"]["batch_size"] //= strategies["gradient_merge"]["k_steps"]
    if trial_dir is not None:
        plain["trainer"].update(TRIAL_TRAINER, max_steps=steps)
        plain.update(logger={}, callbacks={}, ckpt_path=None, test=False, evaluate=False)
        plain["paths"]["output_dir"] = str(trial_dir)
        plain["measure"].update(enabled=True, warmup_steps=min(plain["measure"]["warmup_steps"], steps // 2))
    return validate(OmegaConf.create(plain))


def write_records(auto_dir: Path, chosen: RunSpec, auto: AutoConfig, facts: Facts, listed: List[Candidate],
                  winner: Candidate, why: Dict[str, str]) -> None:
    auto_dir.mkdir(parents=True, exist_ok=True)
    with (auto_dir / CANDIDATES_CSV).open("w", newline="") as out:
        table = csv.writer(out)
        table.writerow(["candidate", "strategies", "status", "reason", "estimated_memory_gib", "estimated_speed",
                        *MEASURED])
        for number, c in enumerate(listed):
            table.writerow([number, c.label, c.status, c.reason, round(c.memory.total / 2**30, 4), round(c.speed, 3),
                            *(c.measured.get(key, "") for key in MEASURED)])
    write_yaml(auto_dir / CHOICE_YAML, {"mode": auto.mode, "chosen": winner.label, "strategies": winner.strategies,
                                        "reason": winner.reason, "why": why, "facts": asdict(facts),
                                        "knobs": asdict(auto)})
    # A candidate's "ok" is a trial that finished (runner/strategies/auto.py names its statuses).
    tried = {f"{TRIALS_DIR}/{n}": c for n, c in enumerate(listed) if c.status in ("ok", FAILED, OUT_OF_MEMORY, REFUSED)}
    write_yaml(auto_dir / SWEEP_YAML, {"jobs": {name: {"overrides": [f"strategy={c.label}"], "reason": c.reason,
                                                       "status": FINISHED if c.status == "ok" else c.status}
                                                for name, c in tried.items()}})
    write_experiment(auto_dir, chosen, winner)


def write_experiment(auto_dir: Path, chosen: RunSpec, winner: Candidate) -> None:
    """experiment/best.yaml and the model, data and trainer options it selects, resolved, so the
    choice reruns from any directory: lightfleet --config-dir AUTO_DIR experiment=best."""
    config = OmegaConf.to_container(chosen.cfg, resolve=True)
    for group in ("model", "data", "trainer"):
        (auto_dir / group).mkdir(exist_ok=True)
        write_yaml(auto_dir / group / "best.yaml", config[group])
    selected = {name: knobs for name, knobs in config["strategy"].items() if knobs is not None}
    body = yaml.safe_dump({"name": f"{config['name']}_auto", "seed": config["seed"], "measure": config["measure"],
                           "strategy": selected}, sort_keys=False)
    defaults = yaml.safe_dump({"defaults": [{"override /model": "best"}, {"override /data": "best"},
                                            {"override /trainer": "best"}, {"override /strategy": list(selected)}]},
                              sort_keys=False)
    (auto_dir / "experiment").mkdir(exist_ok=True)
    (auto_dir / "experiment" / "best.yaml").write_text(
        f"# @package _global_\n# strategy=[auto] chose {winner.label} ({auto_dir / CHOICE_YAML} says why).\n"
        f"# Run: lightfleet --config-dir {auto_dir} experiment=best\n{defaults}{body}")
