"""Python's cyclic garbage collector at the command's start and end.

Importing torch and Lightning makes some 500,000 objects, and the collector goes over all of them
each time they have grown by a quarter: 7 to 8 full collections before the first step (about 1 s of
CPU on 2 cores), then one more at interpreter exit, which clears the modules and collects them all
again (1.2-1.5 s, more than the start-up's checks: bench/RESULTS.md). A single run pauses the
collector while it imports and checks and, just before training or forking its ranks, freezes what
it holds (Python's `gc.freeze`, made for processes that fork): later collections, the ranks' and the
one at exit skip those objects, and forked ranks do not touch their pages. What start-up left
unreachable is frozen with the rest rather than collected (a collection then would cost 0.3-0.45 s;
it holds about 2 MB for the quickstart: imports and one composition and check). A rank started as a
fresh process (runner/train.py) imports the same way. A sweep composes and checks every job first,
so it keeps the collector on, and each job collects before freezing: what an earlier job left may
hold its tensors; so does a run whose strategy=[auto] weighs many candidates first (`resume`).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused() -> Iterator[None]:
    """The collector off inside (unless `settle` turned it on again), as it was after."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def resume() -> None:
    """The collector on again, before work whose garbage is not bounded; `settle` then collects it."""
    gc.enable()


def settle() -> None:
    """Before training: freeze what is held now and collect from here on; with the collector on
    (a sweep's job, or anywhere it was not paused) collect what is unreachable first."""
    if gc.isenabled():
        gc.collect()
    gc.freeze()
    gc.enable()
