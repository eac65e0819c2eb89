"""runner.config.values: the built-in models' and data's counts, sizes and paths, declared once. The
command refuses them before torch (tests/runner/test_cli.py); here, every built-in constructor
refuses each of its arguments that has a rule, with the line the command's check gives."""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
from omegaconf import OmegaConf

from runner.config.values import RULES, AtLeast, check_node, refusals
from runner.core.errors import ConfigError
from runner.core.paths import CONF_DIR
from tests.helpers.data_files import bpe_tokenizer, documents, image_folder, token_file


def image_files(folder: Path) -> Dict[str, Any]:
    return {"root": str(image_folder(folder / "images", per_class=1))}


def token_files(folder: Path) -> Dict[str, Any]:
    path = str(token_file(folder / "tokens.bin", 100))
    return {"train_bin": path, "val_bin": path, "seq_len": 8}


def text_files(folder: Path) -> Dict[str, Any]:
    (folder / "corpus.txt").write_text("".join(documents(4)))
    return {"path": str(folder / "corpus.txt"), "tokenizer": str(bpe_tokenizer(folder / "tokenizer.json", documents(4))),
            "seq_len": 8}


# Each built-in class, and the arguments it is built with besides the one refused (made in a folder).
BUILT_IN: Dict[str, Callable[[Path], Dict[str, Any]]] = {
    "runner.data.SyntheticClassificationData": lambda folder: {},
    "runner.data.SyntheticLanguageModelData": lambda folder: {},
    "runner.data.images.ImageFolderData": image_files,
    "runner.data.tokens.TokenFileData": token_files,
    "runner.data.hf_text.HFTextData": text_files,
    "runner.models.MLPClassifier": lambda folder: {},
    "runner.models.ResNetClassifier": lambda folder: {},
    "runner.models.GPTDecoder": lambda folder: {},
    "runner.models.vision.VisionClassifier": lambda folder: {"arch": "resnet18", "num_classes": 2, "image_size": 32},
    "runner.models.causal_lm.CausalLM": lambda folder: {"vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 1,
                                                        "n_heads": 2},
}


def built_in_class(target: str) -> Any:
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def refused_value(name: str, default: Any) -> Any:
    rule = RULES[name]
    if not isinstance(rule, AtLeast):
        return "nowhere/at/all"
    return [rule.lowest - 1] if isinstance(default, (list, tuple)) else rule.lowest - 1


def test_every_built_in_conf_names_a_class_of_the_table():
    targets = {OmegaConf.load(path)._target_ for group in ("model", "data") for path in (CONF_DIR / group).glob("*.yaml")}
    assert targets == set(BUILT_IN)


@pytest.mark.parametrize("target", sorted(BUILT_IN))
def test_each_built_in_constructor_refuses_what_its_arguments_rules_refuse(target, tmp_path):
    factory = built_in_class(target)
    parameters = inspect.signature(factory).parameters
    ruled = [name for name in parameters if name in RULES]
    assert ruled, target
    base = BUILT_IN[target](tmp_path)
    for name in ruled:
        value = refused_value(name, parameters[name].default)
        argument, item, why = next(refusals(name, value))
        with pytest.raises(ValueError, match=f"^{re.escape(f'{argument}={item}: {why}')}$"):
            factory(**{**base, name: value})
        with pytest.raises(ConfigError, match=f"^{re.escape(f'data.{argument}={item!r}: {why}')}$"):
            check_node("data", {"_target_": target, **base, name: value})


def test_a_users_own_class_is_left_to_its_constructor():
    check_node("data", {"_target_": "mypackage.MyData", "batch_size": -8, "root": "nowhere"})
