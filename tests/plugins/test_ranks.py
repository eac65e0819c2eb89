"""plugins/ranks.py in one process: `own` gives a rank its own piece, or, from a checkpoint of
another number of ranks, what its caller's rule makes of the old ranks' pieces, said in one
lightfleet line; `mean` averages the floating tensors and keeps what every rank shares. The
rules on real runs: tests/test_resume_rules.py."""
from __future__ import annotations

import logging

import pytest
import torch

from plugins.ranks import Rule, averaged, mean, own


def test_on_the_same_number_of_ranks_each_takes_its_own_and_nothing_is_said(caplog):
    with caplog.at_level(logging.INFO, logger="plugins.ranks"):
        assert own(["mine"], "pieces", Rule("never used", lambda ranks, rank: pytest.fail("rule applied"))) == "mine"
    assert not caplog.records


def test_on_another_number_of_ranks_the_rule_decides_and_is_said_once(caplog):
    taken = []
    rule = Rule("each takes the last", lambda ranks, rank: taken.append(rank) or ranks[-1])
    with caplog.at_level(logging.INFO, logger="plugins.ranks"):
        assert own(["first", "second"], "pieces", rule) == "second"
    assert taken == [0]
    assert [record.getMessage() for record in caplog.records] == [
        "lightfleet: the checkpoint holds the pieces of 2 ranks, this run has 1: each takes the last"]


def test_the_mean_averages_floating_tensors_and_keeps_what_the_ranks_share():
    pieces = [{"step": 7, "buffers": {"w": torch.tensor([1.0, 2.0])}, "lr": [0.1], "count": torch.tensor(3)},
              {"step": 7, "buffers": {"w": torch.tensor([3.0, 6.0])}, "lr": [0.1], "count": torch.tensor(3)}]
    piece = own(pieces, "pieces", averaged("their mean"))
    assert piece["step"] == 7 and piece["lr"] == [0.1] and torch.equal(piece["count"], torch.tensor(3))
    assert torch.equal(piece["buffers"]["w"], torch.tensor([2.0, 4.0]))
    # One old rank: every new one takes its piece.
    assert torch.equal(mean(pieces[:1])["buffers"]["w"], pieces[0]["buffers"]["w"])


def test_the_mean_refuses_where_the_ranks_should_agree_and_do_not():
    with pytest.raises(ValueError, match=r"state\['step'\] differs between the checkpoint's ranks: \[7, 8\]"):
        mean([{"step": 7}, {"step": 8}])
