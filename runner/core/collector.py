"""Python's cyclic garbage collector at the command's start and end.

Importing torch and Lightning makes some 500,000 objects, and the collector goes over all of them
each time they have grown by a quarter: 7 to 8 full collections before the first step, then one
more at interpreter exit, which clears the modules and collects them all again (1.5-3 s on 2 cores,
more than the start-up's checks). A single run pauses the collector while it imports and checks
(a bounded amount of garbage: one composition, one check) and, just before training or forking its
ranks, collects once and freezes what is left (Python's `gc.freeze`, made for processes that fork):
later collections, the ranks' and the one at exit skip those objects, and forked ranks do not touch
their pages. A rank started as a fresh process (runner/train.py) imports the same way. A sweep
composes and checks every job first, so it keeps the collector on.
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


def settle() -> None:
    """Before training: collect what start-up left, freeze what survives, and collect from here on."""
    gc.collect()
    gc.freeze()
    gc.enable()
