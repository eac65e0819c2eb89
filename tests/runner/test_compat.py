"""The allowed-combination table: names, availability, 'alone' rules, rows, refusal messages."""
from __future__ import annotations

import dataclasses

import pytest

from runner.config.compat import check, closest, load_table, strategies_from_argv
from runner.core.paths import CONF_DIR
from runner.core.errors import ConfigError, Refusal

TABLE = load_table()
# A small table of two rows: exercises the rules themselves.
FULL = dataclasses.replace(TABLE, allowed=(frozenset({"amp", "lars"}), frozenset({"amp", "lamb"})))


def test_known_strategies_are_the_config_files():
    assert set(TABLE.known) == {path.stem for path in CONF_DIR.joinpath("strategy").glob("*.yaml")}


@pytest.mark.parametrize("selection", [[], ["amp"], ["amp", "recompute"], ["recompute", "gradient_merge"],
                                       ["gradient_merge", "recompute", "amp"]])
def test_subsets_of_allowed_rows_pass(selection):
    check(selection, TABLE)


def test_unknown_name_suggests_the_near_one():
    with pytest.raises(ConfigError, match=r"strategy='recomput'.*did you mean recompute"):
        check(["amp", "recomput"], TABLE)


def test_named_twice_is_an_error():
    with pytest.raises(ConfigError, match="named twice"):
        check(["amp", "amp"], TABLE)


def test_alone_rule():
    check(["auto"], FULL)
    with pytest.raises(Refusal, match="auto must be used alone"):
        check(["auto", "amp"], FULL)


def test_forbidden_pair_gives_reason_and_closest_rows():
    with pytest.raises(Refusal) as refused:
        check(["lars", "lamb"], FULL)
    message = str(refused.value)
    assert "lars+lamb is not an allowed combination" in message
    assert "both replace the optimizer" in message
    assert "closest allowed: amp+lamb, amp+lars" in message  # the FULL table's rows
    assert "\n" not in message


def test_closest_prefers_rows_sharing_most():
    assert closest(frozenset({"amp", "recompute", "dgc"}), TABLE)[:2] == ["amp+recompute", "dgc+recompute"]


@pytest.mark.parametrize("overrides, expected", [
    (["strategy=[amp, recompute]"], ["amp", "recompute"]),
    (["strategy=amp"], ["amp"]),
    (["strategy=[]"], []),
    (["trainer.devices=2"], None),
    (["strategy=amp,lars"], None),          # a sweep, not a list
    (["strategy=[amp],[amp,lars]"], None),  # a sweep of lists
    (["strategy=[amp]", "strategy=[lars]"], ["lars"]),  # the last one wins, as in Hydra
])
def test_command_line_selection(overrides, expected):
    assert strategies_from_argv(overrides) == expected
