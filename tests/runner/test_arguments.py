"""runner.config.arguments: the arguments of a user's own `_target_` nodes (a module written here, with
nested blocks and batch norm) against its constructors' signatures and annotations."""
from __future__ import annotations

import textwrap

import pytest

from runner.config.arguments import check_arguments, check_builds
from runner.core.errors import ConfigError

USER_CODE = '''
from typing import List, Literal, Optional

import pytorch_lightning as pl
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, norm: Literal["batch", "layer"] = "batch", dropout: Optional[float] = None):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if norm == "batch" else nn.LayerNorm(width)


class Net(pl.LightningModule):
    def __init__(self, blocks: List[Block], head_sizes: List[int] = (4,)):
        super().__init__()
        if not blocks:
            raise ValueError("blocks=[]: needs at least one block")
        self.blocks = nn.Sequential(*blocks)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_net.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.syspath_prepend(str(tmp_path))


def net(**changes):
    node = {"_target_": "user_net.Net", "blocks": [{"_target_": "user_net.Block", "width": 8},
                                                   {"_target_": "user_net.Block", "width": 8, "norm": "layer"}]}
    node.update(changes)
    return node


def test_a_good_nested_config_passes_and_builds_on_the_meta_device(user_module):
    check_arguments("model", net())
    check_builds(net(), {"_target_": "runner.data.SyntheticClassificationData"})


@pytest.mark.parametrize("node, message", [
    (net(blocks=[{"_target_": "user_net.Block", "width": "wide"}]), "model.blocks[0].width='wide': Block takes int"),
    (net(blocks=[{"_target_": "user_net.Block", "width": 8, "norm": "group"}]),
     "model.blocks[0].norm='group': Block takes Literal['batch', 'layer']"),
    (net(blocks=[{"_target_": "user_net.Block", "width": 8, "dropuot": 0.1}]),
     "model.blocks[0].dropuot: model.blocks[0] has no key 'dropuot' (did you mean dropout?)"),
    (net(blocks=[{"_target_": "user_net.Block"}]), "model.blocks[0].width: is required by Block (no default)"),
    (net(head_sizes=[4, "x"]), "model.head_sizes=[4, 'x']: Net takes List[int]"),
    (net(blocks=[{"_target_": "user_net.Blok", "width": 8}]), "model.blocks[0]._target_='user_net.Blok': cannot be imported"),
])
def test_a_bad_argument_is_one_line_naming_its_key(user_module, node, message):
    with pytest.raises(ConfigError) as error:
        check_arguments("model", node)
    assert str(error.value).startswith(message)


def test_what_the_constructor_refuses_is_refused_before_any_rank(user_module):
    with pytest.raises(ConfigError, match=r"^model.blocks=\[\]: needs at least one block$"):
        check_builds(net(blocks=[]), {"_target_": "runner.data.SyntheticClassificationData"})
