"""Issue 42's collective bytes: the rehearsal's payload per (op, group) per step equals what the
strategies count in real 2-process runs (measure.traffic=true, plugins/traffic.py). The real runs
are tests/plugins/test_traffic.py's (tests/helpers/traffic.py's fixture, made once per module); the same configs are
rehearsed at 2 fake processes, and the rehearsal's step (its second, the steady state) is set
beside the real run's second step, rank by rank. Payload is the bytes a rank contributes: an
all-gather's input, a reduce-scatter's and an all-reduce's whole input (docs/rehearse.md)."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest

from tests.helpers.rehearsal import rehearse
from tests.helpers.traffic import COMMON, ROWS, traffic_of  # noqa: F401 (the real runs' fixture)

pytestmark = pytest.mark.slow

STEP = 2  # the rehearsal's measured step is its second
# Rows of test_traffic.py (each strategy that owns a collective) and the ranks compared: the
# pipeline's two stages send and receive differently.
COMPARED = {"ddp": [0], "fp16_allreduce": [0], "dgc": [0], "localsgd": [0], "zero1": [0], "zero2": [0],
            "zero3": [0], "zero3_amp": [0], "pipeline": [0, 1]}


def by_op(rows: List[Dict[str, Any]]) -> Dict[Tuple[str, int], Tuple[int, int]]:
    """(op, group size) -> (calls, bytes)."""
    return {(row["op"], row["group_size"]): (row["calls"], row["bytes"]) for row in rows}


@pytest.mark.parametrize("row", list(COMPARED))
def test_rehearsed_payload_bytes_equal_a_real_runs_counters(tmp_path, traffic_of, row):  # noqa: F811
    real = traffic_of(row)
    # The real run's command line, without its own counting (a rehearsal counts every collective itself).
    overrides = [o for o in (*COMMON, *ROWS[row]) if o != "measure.traffic=true"]
    for rank in COMPARED[row]:
        done, report = rehearse(tmp_path / "run", overrides, rank=rank, steps=STEP)
        assert done.returncode == 0, done.stderr[-3000:]
        counted = next(record for record in real[rank] if record["step"] == STEP)
        assert by_op(report["collectives"]) == by_op(counted["collectives"]), (row, rank)
