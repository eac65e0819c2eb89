"""The rehearsal (`lightfleet rehearse`, runner/rank/rehearse.py) against real runs (issue 42): for
every row of conf/compat.yaml (and the plain run) on the built-in GPT (conf/model/gpt.yaml, GPT-2's
shape shrunk) and torchvision's ResNet-18 (model=vision, small images), in 1 and 2 processes over
gloo on the CPU, each part of what a rank holds, rehearsed and measured.

    python bench/rehearsal.py                              # bench/rehearsal.json, the table printed
    python bench/rehearsal.py --models gpt --world-sizes 2 --rows plain sharding   # merged into it
    python bench/rehearsal.py --models resnet18 --measured-from-out   # the rehearsal changed: its side only

Measured: bench/auto_memory.py's `PeakMemory(step=2)` over the real run's second optimizer step
(its docstring defines each part), the busiest rank's peak of each. Rehearsed: every rank of the
same config and plan, `python -m runner.rank.rehearse ... --device-type cpu` (its second step),
the largest of each part over the ranks. Deviation = rehearsed / measured - 1; the goal is every
part within 15%.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/, plugins/ and bench/ when lightfleet is not installed
from bench.auto_memory import EXTRA, KINDS, QUIET, measure  # noqa: E402

PARTS = (*KINDS, *EXTRA)
GOAL = 0.15
MODELS = {
    "gpt": ["model=gpt", "data=language_model"],
    "resnet18": ["model=vision", "model.arch=resnet18", "model.num_classes=4", "model.image_size=32",
                 "data=images", "data.input_shape=[3,32,32]", "data.batch_size=16"],
}
# Two optimizer steps, PeakMemory watching the second.
REAL = [*(o for o in QUIET if o != "trainer.max_steps=1"), "trainer.max_steps=2", "+callbacks.memory.step=2"]
# What each strategy needs to act in a row (as tests/helpers/strategies.py's rows): gradient merging
# of 2 micro-batches, the optimizer replacements over the optimizer they replace, ZeRO's stage that
# shards the most (stage 1 beside a pipeline: the schema refuses more); amp in bfloat16: float16's
# loss scaler skips a real run's first steps while its scale overflows (no optimizer state yet at
# the second), which fake tensors cannot show (the rehearsal's report says so).
SETTINGS = {
    "amp": ["strategy.amp.dtype=bfloat16"],
    "gradient_merge": ["strategy.gradient_merge.k_steps=2"],
    "dgc": ["model/optimizer=sgd"],
    "lars": ["model/optimizer=sgd"],
    "lamb": ["model/optimizer=adamw"],
    "sharding": ["strategy.sharding.stage=3"],
}


def rows() -> Dict[str, List[str]]:
    """Label -> overrides: the plain run and every row of conf/compat.yaml with its settings."""
    from runner.config.compat import load_table

    found: Dict[str, List[str]] = {"plain": []}
    for row in load_table().allowed:
        settings = [o for name in row for o in SETTINGS.get(name, [])]
        if "pipeline" in row and "sharding" in row:
            settings = [o for o in settings if not o.startswith("strategy.sharding.stage")]
            settings.append("strategy.sharding.stage=1")
        names = sorted(row)
        found["+".join(names)] = [f"strategy=[{','.join(names)}]", *settings]
    return found


def rehearse(model: str, world_size: int, entry: Dict[str, Any], run_dir: Path) -> None:
    """Every rank of the entry's config rehearsed; the largest of each part into the entry, under
    "rehearsed" (or "failed": the rank's last line)."""
    from runner.command.planning import plan_for
    from runner.config.checks import validate
    from runner.config.compose import compose_config
    from runner.records.run_dir import create_run_dir

    quiet = [o for o in REAL if "callbacks.memory" not in o]
    overrides = [*MODELS[model], f"trainer.devices={world_size}", *quiet, *entry["overrides"]]
    spec = validate(compose_config([*overrides, f"paths.output_dir={run_dir}"]))
    create_run_dir(spec.cfg, plan_for(spec), ["lightfleet", "rehearse", *overrides], run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    reports = []
    for rank in range(world_size):
        out = run_dir / f"rank{rank}.json"
        done = subprocess.run([sys.executable, "-m", "runner.rank.rehearse", str(run_dir), "--rank", str(rank),
                               "--steps", "2", "--device-type", "cpu", "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            entry["failed"] = (done.stderr.strip().splitlines() or ["?"])[-1]
            return
        reports.append(json.loads(out.read_text()))
    entry["rehearsed"] = {part: max(report["memory"][part] for report in reports) for part in PARTS}
    entry["seconds"] = round(sum(report["seconds"] for report in reports), 1)


def deviations(entry: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """rehearsed / measured - 1 by part (0 where both are 0; None where only the measure is 0)."""
    found = {}
    for part in PARTS:
        real, rehearsed = entry["measured"][part], entry["rehearsed"][part]
        found[part] = rehearsed / real - 1 if real else (0.0 if not rehearsed else None)
    return found


def run(model: str, world_size: int, chosen: List[str], measured: Optional[List[Dict[str, Any]]] = None
        ) -> List[Dict[str, Any]]:
    """The rows rehearsed and measured; with `measured` (the rows of an earlier record) its real
    runs' figures are taken instead of running them again."""
    listed = [{"label": label, "overrides": overrides, "batch_size": 0, "micro_batch": 0}
              for label, overrides in rows().items() if label in chosen or not chosen]
    with tempfile.TemporaryDirectory() as tmp:
        if measured is None:
            measure(model, world_size, listed, Path(tmp) / "real", quiet=REAL, models=MODELS, timeout=3600)
        else:
            earlier = {entry["label"]: entry for entry in measured}
            for entry in listed:
                found = earlier.get(entry["label"], {})
                entry.update({key: found[key] for key in ("measured", "refused") if key in found})
        for index, entry in enumerate(listed):
            if "measured" in entry:
                rehearse(model, world_size, entry, Path(tmp) / f"rehearsed{index:03d}")
            if "rehearsed" in entry:
                entry["deviation"] = deviations(entry)
    for entry in listed:
        entry.pop("batch_size"), entry.pop("micro_batch")
    return listed


def print_table(name: str, listed: List[Dict[str, Any]]) -> None:
    print(f"\n{name}: rehearsed / measured - 1 by part (measured MB)")
    print(f"{'row':<34}" + "".join(f"{part[:12]:>18}" for part in PARTS))
    for entry in listed:
        if "deviation" not in entry:
            print(f"{entry['label']:<34} {entry.get('refused') or entry.get('failed')}"[:160])
            continue
        cells = [f"{value:+.1%} ({entry['measured'][part] / 2**20:.2f})" if value is not None else "n/a"
                 for part, value in entry["deviation"].items()]
        print(f"{entry['label']:<34}" + "".join(f"{cell:>18}" for cell in cells))


def summary(results: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    cells = [(f"{name} {entry['label']} {part}", value) for name, listed in results.items() for entry in listed
             if "deviation" in entry for part, value in entry["deviation"].items() if value is not None]
    worst = max(cells, key=lambda cell: abs(cell[1]))
    return {"compared": sum("deviation" in e for listed in results.values() for e in listed),
            "refused": sum("refused" in e for listed in results.values() for e in listed),
            "failed": [f"{name} {e['label']}: {e['failed']}" for name, listed in results.items() for e in listed
                       if "failed" in e],
            "largest": f"{worst[0]}: {worst[1]:+.1%}",
            "outside_goal": [f"{where}: {value:+.1%}" for where, value in cells if abs(value) > GOAL]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], metavar="N")
    parser.add_argument("--rows", nargs="+", default=[], metavar="LABEL",
                        help="plain, or a row as a+b, names sorted (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "rehearsal.json")
    parser.add_argument("--measured-from-out", action="store_true",
                        help="rehearse only; the real runs' figures from --out (the rehearsal changed, not the runs)")
    args = parser.parse_args(argv)
    earlier = json.loads(args.out.read_text())["results"] if args.measured_from_out else {}
    from bench.spawning import machine

    fresh: Dict[str, List[Dict[str, Any]]] = {}
    for model in args.models:
        for world_size in args.world_sizes:
            name = f"{model} x{world_size}"
            fresh[name] = run(model, world_size, args.rows, earlier.get(name, []) if args.measured_from_out else None)
            print_table(name, fresh[name])
    # Merged into what --out holds when done (not when started: runs of other rows may overlap), a
    # subset of models, world sizes or rows replacing only its own rows.
    record: Dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {"commands": []}
    record["commands"].append(" ".join(["python", "bench/rehearsal.py",
                                        *(argv if argv is not None else sys.argv[1:])]))
    record.update(machine=machine(), goal=f"every part within {GOAL:.0%}")
    results = record.setdefault("results", {})
    for name, listed in fresh.items():
        by_label = {entry["label"]: entry for entry in listed}
        kept = [by_label.pop(entry["label"], entry) for entry in results.get(name, [])]
        results[name] = kept + list(by_label.values())
    record["summary"] = summary(results)
    print(json.dumps(record["summary"], indent=2))
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
