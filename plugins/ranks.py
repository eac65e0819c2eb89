"""State that differs between ranks, gathered and taken back: every rank's piece of a checkpoint
(only rank 0 writes one, but every rank builds it: Lightning calls the callbacks' `state_dict` on
all of them) and every rank's figures. `gather` collects each rank's piece in rank order; on
resume `own` gives each rank its own back, and, when the checkpoint came from another number of
ranks, what the caller's `Rule` makes of the old ranks' pieces (each rule:
docs/reliability.md#resume-on-another-number-of-processes).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)  # lightfleet's own: the console shows it (runner/rank/train.py)


@dataclass(frozen=True)
class Rule:
    """What a rank takes when the checkpoint holds the pieces of another number of ranks:
    `take(the old ranks' pieces, this rank)`, and `says`, that rule in words for the run's log."""

    says: str
    take: Callable[[List[Any], int], Any]


def averaged(says: str) -> Rule:
    """Every rank takes the mean of the old ranks' pieces (`mean`)."""
    return Rule(says, lambda ranks, rank: mean(ranks))


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def gather(mine: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Every rank's `mine`, in rank order (a collective: every rank of `group` calls it)."""
    if not _distributed(group):
        return [mine]
    ranks: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, mine, group=group)
    return ranks


def own(ranks: List[Any], what: str, rule: Rule, group: Optional[dist.ProcessGroup] = None) -> Any:
    """This rank's entry of a list `gather` made or, when the checkpoint came from a run with
    another number of ranks, `rule`'s: said once, by the group's first rank, in one line."""
    size = dist.get_world_size(group) if _distributed(group) else 1
    rank = dist.get_rank(group) if size > 1 else 0
    if len(ranks) == size:
        return ranks[rank]
    if rank == 0:
        log.info(f"lightfleet: the checkpoint holds the {what} of {_ranks(len(ranks))}, this run has {size}: "
                 f"{rule.says}")
    return rule.take(ranks, rank)


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def mean(pieces: Sequence[Any], where: str = "state") -> Any:
    """The ranks' pieces (alike nested dicts, lists and tuples) with every floating tensor
    averaged element-wise; everything else (step counts, hyper-parameters, a loss scale) is the
    same on every rank and kept, or a ValueError names where the ranks differ."""
    first = pieces[0]
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        return torch.stack(list(pieces)).mean(0)
    if isinstance(first, dict):
        return {key: mean([piece[key] for piece in pieces], f"{where}[{key!r}]") for key in first}
    if isinstance(first, (list, tuple)):
        parts = [mean(part, f"{where}[{index}]") for index, part in enumerate(zip(*pieces, strict=True))]
        return tuple(parts) if isinstance(first, tuple) else parts
    tensor = isinstance(first, torch.Tensor)
    if not all(torch.equal(piece, first) if tensor else piece == first for piece in pieces[1:]):
        raise ValueError(f"{where} differs between the checkpoint's ranks: {list(pieces)}")
    return first
