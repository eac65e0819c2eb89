"""The run directory's files and how a job ended (runner/records/files.py): the outcome of a job
directory in each case, the names conf/ and Lightning give the files lightfleet reads back, and no
second spelling of a file name anywhere in runner/ or plugins/."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List, Set, Tuple

import pytest
import yaml
from hydra.utils import instantiate

from runner.config.compose import compose_config
from runner.records import files
from runner.records.files import (DIVERGED, FAILED, FINISHED, OUT_OF_MEMORY, PREEMPTED, REFUSED, Ending, job_ending,
                                  rank_traceback)
from runner.records.run_dir import record_failure

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))


def test_the_outcomes_are_the_strings_the_records_hold():
    assert files.OUTCOMES == ("finished", "failed", "out_of_memory", "refused", "preempted", "diverged",
                              "not_started")


@pytest.mark.parametrize("records, ending", [
    ({}, Ending(FAILED)),  # killed, or still running: nothing says how it ended
    ({files.RESULTS_YAML: {"samples_per_s": 12.5}}, Ending(FINISHED, {"samples_per_s": 12.5})),
    ({files.FAILURE_YAML: {"status": "failed", "exit_code": 1, "error": "boom"}},
     Ending(FAILED, {"status": "failed", "exit_code": 1, "error": "boom"})),
    ({files.FAILURE_YAML: {"status": "out_of_memory", "exit_code": 1, "error": "CUDA out of memory"}},
     Ending(OUT_OF_MEMORY, {"status": "out_of_memory", "exit_code": 1, "error": "CUDA out of memory"})),
    ({files.FAILURE_YAML: {"status": "preempted", "exit_code": 143, "error": "preempted by SIGTERM"}},
     Ending(PREEMPTED, {"status": "preempted", "exit_code": 143, "error": "preempted by SIGTERM"})),
    ({files.REFUSED_YAML: {"overrides": ["strategy=[lars,lamb]"], "reason": "no"}},
     Ending(REFUSED, {"overrides": ["strategy=[lars,lamb]"], "reason": "no"})),
    ({files.RESULTS_YAML: {"train_loss": 0.5}, files.FAILURE_YAML: {"status": "failed"}},
     Ending(FINISHED, {"train_loss": 0.5})),  # a second node's copy failed after rank 0 finished
], ids=["no_record", "finished", "failed", "out_of_memory", "preempted", "refused", "results_win"])
def test_how_a_job_directory_ended(tmp_path, records, ending):
    for name, data in records.items():
        write(tmp_path / name, data)
    assert job_ending(tmp_path) == ending


@pytest.mark.parametrize("error, status, outcome", [
    ("RuntimeError: boom", FAILED, FAILED),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", FAILED, OUT_OF_MEMORY),
    ("preempted by SIGTERM at step 3", PREEMPTED, PREEMPTED),
    ("diverged: the loss became non-finite (NaN or Inf) at step 5; no checkpoint was written before it",
     DIVERGED, DIVERGED),
])
def test_a_recorded_failure_reads_back_as_its_outcome(tmp_path, error, status, outcome):
    record_failure(tmp_path, 1, error, status)
    assert job_ending(tmp_path) == Ending(outcome, {"status": outcome, "exit_code": 1, "error": error})


def test_conf_and_lightning_write_the_files_where_lightfleet_reads_them(tmp_path):
    """The checkpoint callback and the CSV logger are configured in conf/, their file names are
    Lightning's: both must land on LAST_CHECKPOINT and METRICS_CSV."""
    cfg = compose_config([f"paths.output_dir={tmp_path}"])
    checkpoint = instantiate(cfg.callbacks.model_checkpoint)
    last = checkpoint.format_checkpoint_name({}, checkpoint.CHECKPOINT_NAME_LAST)
    assert last == str(tmp_path / files.LAST_CHECKPOINT)
    logger = instantiate(cfg.logger.csv)
    assert logger.experiment.metrics_file_path == str(tmp_path / files.METRICS_CSV)
    assert rank_traceback(3).startswith(f"{files.LOGS_DIR}/")


# ---- one spelling of each file name ----------------------------------------------------------------

NAMES = {value for key, value in vars(files).items() if key.isupper() and isinstance(value, str)} - set(files.OUTCOMES)
PARTS = {part for name in NAMES for part in name.split("/")}
FILE_NAMES = {part for part in PARTS if Path(part).suffix and not part.startswith(".")}  # config.yaml, last.ckpt
DIR_NAMES = PARTS - FILE_NAMES  # logs, checkpoints, .hydra


def docstrings(tree: ast.AST) -> Set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spelled_names(source: str) -> List[Tuple[int, str]]:
    """(line, literal) of each string literal (an f-string's pieces too) that spells a run-directory
    file name as a path: a file name or "dir/" in a literal without spaces, or a directory name as
    a part of a path (`x / "logs"`). Prose (docstrings, help texts, messages) may name a file in words."""
    tree = ast.parse(source)
    skipped = docstrings(tree)
    path_parts = {id(side) for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                  for side in (node.left, node.right)}
    spelled = re.compile("|".join([rf"(?<![\w.]){re.escape(name)}(?!\w)" for name in sorted(FILE_NAMES)] +
                                  [rf"(?<![\w.]){re.escape(name)}/" for name in sorted(DIR_NAMES)]))
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped
                  and ((spelled.search(node.value) and not re.search(r"\s", node.value))
                       or (id(node) in path_parts and node.value in DIR_NAMES)))


def test_the_scan_finds_file_names_spelled_out():
    source = ('"""Writes results.yaml."""\nimport os\n'
              'a = run_dir / "results.yaml"\nb = run_dir / "logs" / name\nc = f"ranks/{rank}"\n'
              'd = root.glob(f"**/checkpoints/last.ckpt")\ne = "auto"\nf = "my_results.yaml"\n'
              'g = f"no {x}: not a run directory (holding config.yaml)"\n')
    assert [line for line, _ in spelled_names(source)] == [3, 4, 5, 6]


def test_only_the_files_module_spells_the_run_directory_file_names():
    spelled: List[str] = []
    for path in sorted([*(PROJECT_ROOT / "runner").rglob("*.py"), *(PROJECT_ROOT / "plugins").rglob("*.py")]):
        relative = path.relative_to(PROJECT_ROOT).as_posix()
        if relative != "runner/records/files.py":
            spelled += [f"{relative}:{line}: {literal!r}" for line, literal in spelled_names(path.read_text())]
    assert not spelled, "name these with runner/records/files.py's constants:\n" + "\n".join(spelled)
