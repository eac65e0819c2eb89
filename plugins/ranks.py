"""State that differs between ranks, gathered and taken back: every rank's piece of a checkpoint
(only rank 0 writes one, but every rank builds it: Lightning calls the callbacks' `state_dict` on
all of them) and every rank's figures. `gather` collects each rank's piece in rank order; on
resume `own` gives each rank its own back.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist
from pytorch_lightning.utilities import rank_zero_warn


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def gather(mine: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Every rank's `mine`, in rank order (a collective: every rank of `group` calls it)."""
    if not _distributed(group):
        return [mine]
    ranks: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, mine, group=group)
    return ranks


def own(ranks: List[Any], what: str, otherwise: str, group: Optional[dist.ProcessGroup] = None) -> Optional[Any]:
    """This rank's entry of a list `gather` made; None, with a warning naming `what` and what
    happens `otherwise`, when the checkpoint came from a run with another number of ranks."""
    size = dist.get_world_size(group) if _distributed(group) else 1
    if len(ranks) != size:
        rank_zero_warn(f"the checkpoint holds the {what} of {len(ranks)} ranks, this run has {size}: {otherwise}")
        return None
    return ranks[dist.get_rank(group) if size > 1 else 0]
