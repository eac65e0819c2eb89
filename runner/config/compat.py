"""Compatibility checker: is this combination of strategies allowed?

The rules are data (conf/compat.yaml); this module only reads them. It imports nothing heavy
(no torch, lightning, hydra or omegaconf), so a forbidden combination is refused in a fraction
of a second, before any process starts.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import yaml

from runner import strategies
from runner.core.errors import ConfigError, Refusal
from runner.core.paths import CONF_DIR

@dataclass(frozen=True)
class Table:
    known: Tuple[str, ...]  # the registry's strategies
    alone: FrozenSet[str]
    allowed: Tuple[FrozenSet[str], ...]
    reasons: Dict[FrozenSet[str], str]


@functools.lru_cache(maxsize=None)  # read once per process, however many sweep jobs are checked
def load_table(conf_dir: Path = CONF_DIR) -> Table:
    """The table in `conf_dir`/compat.yaml; a name it uses that no strategy has is an error."""
    raw = yaml.safe_load((conf_dir / "compat.yaml").read_text())
    known = strategies.names()
    table = Table(
        known=known,
        alone=frozenset(raw.get("alone", [])),
        allowed=tuple(frozenset(row) for row in raw.get("allowed", [])),
        reasons={frozenset(r["pair"]): r["why"] for r in raw.get("reasons", [])},
    )
    unknown = sorted(set(table.alone).union(*table.allowed, *table.reasons) - set(known))
    if unknown:
        raise ConfigError("conf/compat.yaml", unknown[0], f"names no strategy; known: {', '.join(known)}", known)
    return table


def check(selected: Sequence[str], table: Table) -> None:
    """Raise ConfigError for unknown names, Refusal for forbidden combinations."""
    for name in selected:
        if name not in table.known:
            raise ConfigError("strategy", name, f"unknown strategy; known: {', '.join(table.known)}", table.known)
    if len(set(selected)) != len(selected):
        raise ConfigError("strategy", list(selected), "a strategy is named twice")
    chosen = frozenset(selected)
    if len(chosen) < 2:
        return
    lonely = sorted(chosen & table.alone)
    if lonely:
        raise Refusal(f"{'+'.join(selected)}: {', '.join(lonely)} must be used alone")
    if any(chosen <= row for row in table.allowed):
        return
    why = [f"{'+'.join(sorted(pair))}: {reason}" for pair, reason in table.reasons.items() if pair <= chosen]
    because = "; ".join(why) if why else "no allowed combination contains it"
    raise Refusal(f"{'+'.join(selected)} is not an allowed combination ({because}); "
                  f"closest allowed: {', '.join(closest(chosen, table))}")


def closest(chosen: FrozenSet[str], table: Table, limit: int = 3) -> List[str]:
    """Allowed rows sharing the most strategies with the request (smallest rows first)."""
    ranked = sorted(table.allowed, key=lambda row: (-len(row & chosen), len(row), sorted(row)))
    return ["+".join(sorted(row)) for row in ranked[:limit]]


# `strategy=[a,b]` or `strategy=a`; `strategy=a,b` is a Hydra sweep and is left to the sweep path.
_SIMPLE_LIST = re.compile(r"^strategy=(?:\[([\w\s,]*)\]|(\w+))$")


def strategies_from_argv(overrides: Sequence[str]) -> Optional[List[str]]:
    """The strategy list a plain `strategy=[a,b]` override sets, or None when there is none (or
    it is a sweep). A command-line selection wins over an experiment's, so it decides alone."""
    found = None
    for override in overrides:
        match = _SIMPLE_LIST.match(override)
        if match:
            names = match.group(1) if match.group(2) is None else match.group(2)
            found = [name.strip() for name in names.split(",") if name.strip()]
    return found
