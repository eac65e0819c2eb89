"""Every built-in data module alike (conf/data/*.yaml, runner/data/), each built from its conf as the
command composes it, on files made here (tests/helpers/data_files.py): evaluation serves the same items at
every pass, in the split's order, through the evaluation transforms; training's random draws are
each item's own; tokens_per_sample is what a served sample holds, at every length; every knob does
what it says, each checked on its own; training is the global order (runner/data/order.py): 1,001
samples give the same global batches, in the same micro-batches, on 1, 2 and 3 processes, and a
resumed position serves the rest of its epoch. What only one module does: test_models.py (the synthetic
data), test_file_data.py (tokens, imagefolder), test_hf_text.py."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict

import numpy as np
import pytest
import torch
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from tests.helpers.data_files import (bpe_tokenizer, decoded_documents, documents, image_folder, on_device, picture_folder,
                                     token_file, word_tokenizer)
from tests.helpers.probe import knobs_of
from runner.config.checks import validate
from runner.core.paths import CONF_DIR
from runner.config.compose import compose_config
from runner.core.errors import ConfigError

CONFS = sorted(path.stem for path in (CONF_DIR / "data").glob("*.yaml"))
# conf -> the overrides that point it at the files (`files`: tests/helpers/data_files.py's field_files)
DATA = {
    "classification": [], "images": [], "language_model": [],
    "tokens": ["data.train_bin={files}/train.bin", "data.val_bin={files}/val.bin", "data.seq_len=16"],
    "imagefolder": ["data.root={pictures}", "data.image_size=16", "data.batch_size=4", "data.num_workers=0"],
    "hf_text": ["data.path={files}/corpus", "data.tokenizer={files}/tokenizer.json", "data.val_split=validation",
                "data.seq_len=16"],
}
# The knobs that give a module of files its test split (the synthetic data always has one).
TEST_SPLIT = {"tokens": {"test_bin": "{files}/val.bin"}, "imagefolder": {"test_split": "holdout"},
              "hf_text": {"test_split": "validation"}}
# ImageNet's channel means and deviations, as torchvision's references normalise with them.
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

Make = Callable[..., Any]  # make(**knobs): the module built from its composed conf with these knobs changed


@pytest.fixture(autouse=True)
def run_seed(monkeypatch):
    """The run's seed, which orders training and draws its random windows, crops and flips: 0, as
    in a run with seed=0 (an earlier test's seed_everything leaves its own in the environment)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")


@pytest.fixture(scope="module")
def files(field_files, tmp_path_factory) -> SimpleNamespace:
    """field_files, beside: a folder of one picture in every image (train, val and holdout splits
    of 4, 2 and 1 a class); text files of 3 lines each; a jsonl whose documents are in column body;
    a tokenizer with a second special token; a token file of ids 0, 1, 2..."""
    folder = tmp_path_factory.mktemp("data_modules")
    picture_folder(folder / "pictures", {"train": 4, "val": 2, "holdout": 1}, size=24)
    texts = documents(60)
    (folder / "lines").mkdir()
    for index in range(2):
        (folder / "lines" / f"{index}.txt").write_text("".join(text.replace("\n", " ") + "\n"
                                                               for text in texts[3 * index : 3 * index + 3]))
    (folder / "body.jsonl").write_text("".join(json.dumps({"body": text}) + "\n" for text in texts[10:40]))
    bpe_tokenizer(folder / "sep_tokenizer.json", texts, special_tokens=("<|sep|>", "<|endoftext|>"))
    return SimpleNamespace(field=field_files, folder=folder, pictures=folder / "pictures", body=texts[10:40],
                           counting=token_file(folder / "counting.bin", 20_000))


@pytest.fixture(scope="module")
def made(files) -> Callable[..., Any]:
    """made(conf, trainer=None, **knobs): the data module of conf/data/CONF.yaml, composed as the
    command composes it (spec_for's calls, once per conf), with `knobs` changed, set up for fit."""
    nodes: Dict[str, dict] = {}

    def make(name: str, trainer: Any = None, **knobs: Any) -> Any:
        if name not in nodes:
            overrides = [o.format(files=files.field, pictures=files.pictures) for o in DATA[name]]
            nodes[name] = OmegaConf.to_container(validate(compose_config([f"data={name}", *overrides])).cfg.data)
        module = instantiate({**nodes[name], **knobs}, _convert_="all")
        module.trainer = trainer or on_device()
        module.setup("fit")
        return module

    return make


def served(loader) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything a loader serves in one pass: its inputs and its targets, in order."""
    inputs, targets = zip(*loader)
    return torch.cat(inputs), torch.cat(targets)


def first_batch(loader) -> tuple[torch.Tensor, torch.Tensor]:
    return next(iter(loader))


def loader_of(module: Any, split: str):
    return getattr(module, f"{split}_dataloader")()


def distinct(rows: torch.Tensor) -> int:
    """How many different items `rows` (items along the first dimension) holds."""
    return len(torch.unique(rows.flatten(1), dim=0))


def windows(tokens: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The consecutive windows of seq_len + 1 tokens, in order, as (inputs, next tokens)."""
    cut = [tokens[start : start + seq_len + 1].astype(np.int64) for start in range(0, len(tokens) - seq_len, seq_len + 1)]
    stacked = torch.from_numpy(np.stack(cut))
    return stacked[:, :-1], stacked[:, 1:]


def test_every_conf_has_its_files_and_its_expectations():
    assert sorted(DATA) == sorted(EVALUATION) == sorted(INDEPENDENT) == sorted(KNOBS) == CONFS


# --------------------------------------------------------------------------- evaluation


def in_order(module: Any, split: str, files: SimpleNamespace):
    """The synthetic data's evaluation: the split's samples as drawn, in order."""
    return getattr(module, f"{split}_set").tensors


def token_file_windows(module: Any, split: str, files: SimpleNamespace):
    return windows(np.fromfile(files.field / "val.bin", np.uint16), module.seq_len)  # val.bin serves val and test


def text_windows(module: Any, split: str, files: SimpleNamespace):
    return windows(module.tokens[split], module.seq_len)  # the test split is the validation one


def centre_crops(module: Any, split: str, files: SimpleNamespace):
    """torchvision's reference evaluation of each image, in ImageFolder's order (class folders,
    then files, sorted): resize to 256/224 of the size, take the centre, normalise."""
    from PIL import Image
    from torchvision.transforms import functional

    size = 16
    folder = files.pictures / {"val": "val", "test": "holdout"}[split]
    images, labels = [], []
    for path in sorted(folder.glob("*/*.png")):
        image = functional.center_crop(functional.resize(Image.open(path).convert("RGB"), round(size * 256 / 224)), size)
        images.append(functional.normalize(functional.to_tensor(image), IMAGENET_MEAN, IMAGENET_STD))
        labels.append(sorted(p.name for p in folder.iterdir()).index(path.parent.name))
    return torch.stack(images), torch.tensor(labels)


# conf -> what its val and test loaders serve, found independently of the loaders
EVALUATION = {"classification": in_order, "images": in_order, "language_model": in_order,
              "tokens": token_file_windows, "hf_text": text_windows, "imagefolder": centre_crops}


@pytest.mark.parametrize("name", CONFS)
def test_every_pass_over_val_and_test_serves_the_same_items_in_order_through_the_evaluation_transforms(
        made, files, name, monkeypatch):
    test_split = {knob: value.format(files=files.field) for knob, value in TEST_SPLIT.get(name, {}).items()}
    module = made(name, **test_split)
    for split in ("val", "test"):
        monkeypatch.setenv("PL_GLOBAL_SEED", "0")
        module.trainer = on_device(epoch=0)
        first = served(loader_of(module, split))
        # Neither the global RNG, nor the run's seed, nor the epoch plays a part in evaluation.
        torch.manual_seed(1234)
        monkeypatch.setenv("PL_GLOBAL_SEED", "9")
        module.trainer = on_device(epoch=3)
        again = served(loader_of(module, split))
        expected = EVALUATION[name](module, split, files)
        for served_part, again_part, expected_part in zip(first, again, expected, strict=True):
            torch.testing.assert_close(again_part, served_part, rtol=0, atol=0)
            torch.testing.assert_close(served_part, expected_part, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- per-item randomness


def every_sample_its_own_noise(make: Make, files: SimpleNamespace) -> None:
    module = make()
    inputs, labels = served(module.train_dataloader())
    assert distinct(inputs) == len(inputs) == module.num_train  # no two samples share their noise
    assert set(first_batch(module.train_dataloader())[1].tolist()) == set(range(module.num_classes))


def every_sequence_its_own_draws(make: Make, files: SimpleNamespace) -> None:
    module = make()
    inputs, _ = first_batch(module.train_dataloader())
    assert distinct(inputs) == len(inputs)
    first_tokens = served(module.train_dataloader())[0][:, 0]
    assert set(first_tokens.tolist()) == set(range(module.vocab_size))  # each sequence starts where it draws


def every_window_its_own_start(make: Make, files: SimpleNamespace) -> None:
    """Random windows of a file of token ids 0, 1, 2...: a window's first token is its start."""
    module = make(train_bin=str(files.counting))
    assert distinct(first_batch(module.train_dataloader())[0][:, :1]) == module.batch_size
    starts = served(module.train_dataloader())[0][:, 0]
    assert len(starts) == 20_000 // 17 and distinct(starts[:, None]) > 0.95 * len(starts)  # drawn with replacement


def every_window_once(make: Make, files: SimpleNamespace) -> None:
    """hf_text draws nothing per window: the file's consecutive windows, each at most once, shuffled;
    those short of a whole global batch (runner/data/order.py) sit the epoch out."""
    module = make()
    inputs, _ = served(module.train_dataloader())
    expected, _ = windows(module.tokens["train"], module.seq_len)
    served_windows, all_windows = list(map(tuple, inputs.tolist())), set(map(tuple, expected.tolist()))
    assert len(served_windows) == len(set(served_windows)) == len(expected) // module.batch_size * module.batch_size
    assert set(served_windows) <= all_windows
    assert not torch.equal(inputs, expected[: len(inputs)])


def every_image_its_own_crop_and_flip(make: Make, files: SimpleNamespace) -> None:
    """Every image is the same picture: the items differ only where their crops and flips do."""
    module = make()
    batches = list(module.train_dataloader())
    assert len(batches) > 1 and all(distinct(images) == len(images) for images, _ in batches)
    images = torch.cat([images for images, _ in batches])
    assert distinct(images) == len(images) == 8


# conf -> what the items of one training epoch show when each draws its own randomness
INDEPENDENT = {"classification": every_sample_its_own_noise, "images": every_sample_its_own_noise,
               "language_model": every_sequence_its_own_draws, "tokens": every_window_its_own_start,
               "hf_text": every_window_once, "imagefolder": every_image_its_own_crop_and_flip}


@pytest.mark.parametrize("name", CONFS)
def test_the_items_of_one_batch_and_one_epoch_draw_their_randomness_independently(made, files, name):
    INDEPENDENT[name](lambda **knobs: made(name, **knobs), files)


# --------------------------------------------------------------------------- tokens per sample

LENGTHS = ("language_model", "tokens", "hf_text")  # the data of tokens: seq_len tokens a sample


@pytest.mark.parametrize("name", CONFS)
def test_tokens_per_sample_is_what_a_served_sample_holds_at_every_length(made, name):
    for seq_len in (8, 24):
        module = made(name, **({"seq_len": seq_len} if name in LENGTHS else {}))
        inputs, targets = first_batch(module.train_dataloader())
        if name not in LENGTHS:  # images and features hold no tokens: no tokens/s
            assert getattr(module, "tokens_per_sample", None) is None
            break
        assert inputs.shape[1] == targets.shape[1] == seq_len and module.tokens_per_sample == seq_len


# --------------------------------------------------------------------------- every knob
# Each check builds the module with one knob changed (make(knob=value)) and finds its effect in
# what the loaders serve; a knob of the constructor or the conf without a check fails
# test_every_knob_of_every_data_module_has_a_check.


def batch_size(make: Make, files: SimpleNamespace) -> None:
    module = make(batch_size=3)
    assert len(first_batch(module.train_dataloader())[0]) == len(first_batch(module.val_dataloader())[0]) == 3


def num_workers(make: Make, files: SimpleNamespace) -> None:
    loader = make(num_workers=1).train_dataloader()
    assert loader.num_workers == 1
    for part, alone in zip(first_batch(loader), first_batch(make(num_workers=0).train_dataloader())):
        torch.testing.assert_close(part, alone, rtol=0, atol=0)


def pin_memory(make: Make, files: SimpleNamespace) -> None:
    cuda = on_device("cuda")
    assert make(trainer=cuda).train_dataloader().pin_memory is True
    module = make(trainer=cuda, pin_memory=False)
    assert module.train_dataloader().pin_memory is False and module.val_dataloader().pin_memory is False


def epoch_order(length: int, global_batch: int, epoch: int = 0) -> torch.Tensor:
    """The global order's rule (runner/data/order.py) written out: an epoch's order of `length`
    items is a permutation drawn from the run's seed (0 here) plus the epoch, and the epoch serves
    its first floor(length / G) x G items; the rest sit the epoch out."""
    order = torch.randperm(length, generator=torch.Generator().manual_seed(epoch))
    return order[: length // global_batch * global_batch]


def num_train(make: Make, files: SimpleNamespace) -> None:
    """24 training samples at batch 5 (one process, G = 5): the epoch serves the first 20 of its
    order, and 4 sit it out."""
    module = make(num_train=24, batch_size=5)
    inputs, _ = served(module.train_dataloader())
    torch.testing.assert_close(inputs, module.train_set.tensors[0][epoch_order(24, 5)], rtol=0, atol=0)


def samples_served(split: str, knob: str) -> Callable:
    def check(make: Make, files: SimpleNamespace) -> None:
        assert len(served(loader_of(make(**{knob: 24}), split))[0]) == 24

    return check


def seed(make: Make, files: SimpleNamespace) -> None:
    assert not torch.equal(make(seed=1).train_set.tensors[0], make(seed=0).train_set.tensors[0])


SPLIT_DATA = {"batch_size": batch_size, "num_workers": num_workers, "pin_memory": pin_memory, "seed": seed,
              "num_train": num_train, "num_val": samples_served("val", "num_val"),
              "num_test": samples_served("test", "num_test")}


def input_shape(make: Make, files: SimpleNamespace) -> None:
    assert first_batch(make(input_shape=[2, 5, 3]).train_dataloader())[0].shape[1:] == (2, 5, 3)


def num_classes(make: Make, files: SimpleNamespace) -> None:
    assert set(make(num_classes=3).train_set.tensors[1].tolist()) == {0, 1, 2}


def vocab_size(make: Make, files: SimpleNamespace) -> None:
    assert set(make(vocab_size=5).train_set.tensors[0].unique().tolist()) == set(range(5))


def seq_len(make: Make, files: SimpleNamespace) -> None:
    inputs, targets = first_batch(make(seq_len=8).train_dataloader())
    assert inputs.shape[1] == targets.shape[1] == 8


def token_train_file(make: Make, files: SimpleNamespace) -> None:
    """train_bin=val.bin (4,000 tokens): an epoch of 235 random windows of it (as many as it has
    consecutive ones), of which the first 235 // 12 x 12 of the order serve (batch 12, G = 12)."""
    module = make(train_bin=str(files.field / "val.bin"))
    tokens = np.fromfile(files.field / "val.bin", np.uint16)
    starts = torch.randint(4_000 - 16, (235,), generator=torch.Generator().manual_seed(0))[: 235 // 12 * 12]
    expected = torch.stack([torch.from_numpy(tokens[start : start + 16].astype(np.int64)) for start in starts.tolist()])
    torch.testing.assert_close(served(module.train_dataloader())[0], expected, rtol=0, atol=0)


def token_val_file(make: Make, files: SimpleNamespace) -> None:
    """val_bin=train.bin: validation serves its 40,000 // 17 consecutive windows (val.bin holds 4,000 tokens)."""
    assert len(served(make(val_bin=str(files.field / "train.bin")).val_dataloader())[0]) == 40_000 // 17


def token_test_file(make: Make, files: SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="test_bin=None: the test stage needs a test split"):
        make().test_dataloader()
    module = make(test_bin=str(files.field / "val.bin"))
    torch.testing.assert_close(served(module.test_dataloader()), windows(np.fromfile(files.field / "val.bin", np.uint16), 16))


def dtype(make: Make, files: SimpleNamespace) -> None:
    inputs, _ = first_batch(make(dtype="uint32").val_dataloader())
    assert inputs[0].tolist() == np.fromfile(files.field / "val.bin", np.uint32)[:16].tolist()


def sequential_windows(make: Make, files: SimpleNamespace) -> None:
    """The file's 2,352 consecutive windows in the epoch's order, the first 2,352 // 12 x 12 of it (all)."""
    inputs, _ = served(make(windows="sequential").train_dataloader())
    expected, _ = windows(np.fromfile(files.field / "train.bin", np.uint16), 16)
    torch.testing.assert_close(inputs, expected[epoch_order(len(expected), 12)], rtol=0, atol=0)


def token_vocabulary(make: Make, files: SimpleNamespace) -> None:
    """The data's vocabulary, which the command holds against the model's."""
    from runner.config.arguments import check_sizes

    model = SimpleNamespace(vocab_size=300)
    check_sizes(model, make(), {}, {"_target_": "tokens"})
    with pytest.raises(ConfigError, match="model.vocab_size=300: fewer than the 500 token ids of the data"):
        check_sizes(model, make(vocab_size=500), {}, {"_target_": "tokens"})


def text_documents(module: Any, tokenizer: Path) -> list[str]:
    """The documents a module of text holds, training's then validation's."""
    return [document for split in ("train", "val") for document in decoded_documents(tokenizer, module.tokens[split].tolist())]


def text_path(make: Make, files: SimpleNamespace) -> None:
    module = make(path=str(files.folder / "lines"), lines=True, val_split=None, val_fraction=0.5, seq_len=4)
    assert sorted(text_documents(module, files.field / "tokenizer.json")) == sorted(
        line for path in sorted((files.folder / "lines").iterdir()) for line in path.read_text().splitlines())


def text_lines(make: Make, files: SimpleNamespace) -> None:
    def count(lines: bool) -> int:
        module = make(path=str(files.folder / "lines"), lines=lines, val_split=None, val_fraction=0.5, seq_len=4)
        return len(text_documents(module, files.field / "tokenizer.json"))

    assert (count(True), count(False)) == (6, 2)  # each line a document, or each of the 2 files


def text_column(make: Make, files: SimpleNamespace) -> None:
    module = make(path=str(files.folder / "body.jsonl"), text_column="body", val_split=None)
    assert sorted(text_documents(module, files.field / "tokenizer.json")) == sorted(files.body)


def tokenizer(make: Make, files: SimpleNamespace) -> None:
    from tokenizers import Tokenizer

    module = make(tokenizer=str(files.folder / "sep_tokenizer.json"))
    other = Tokenizer.from_file(str(files.folder / "sep_tokenizer.json"))
    assert module.vocab_size == other.get_vocab_size()
    first = decoded_documents(files.folder / "sep_tokenizer.json", module.tokens["val"].tolist())[0]
    assert module.tokens["val"][: len(other.encode(first).ids)].tolist() == other.encode(first).ids


def eos_token(make: Make, files: SimpleNamespace) -> None:
    """eos_token=<|sep|>: the token after each of the 40 validation documents is that one, not <|endoftext|>."""
    from tokenizers import Tokenizer

    path = files.folder / "sep_tokenizer.json"
    ids = {name: Tokenizer.from_file(str(path)).token_to_id(name) for name in ("<|sep|>", "<|endoftext|>")}
    for eos, module in (("<|sep|>", make(tokenizer=str(path), eos_token="<|sep|>")), ("<|endoftext|>", make(tokenizer=str(path)))):
        tokens = module.tokens["val"]
        assert tokens[-1] == ids[eos] and (tokens == ids[eos]).sum() == 40, eos


def split_of(knob: str, value: str, split: str, same_as: str) -> Callable:
    """`knob=value` makes split `split` the documents split `same_as` holds by default."""
    def check(make: Make, files: SimpleNamespace) -> None:
        assert np.array_equal(make(**{knob: value}).tokens[split], make().tokens[same_as])

    return check


def text_test_split(make: Make, files: SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="test_split=None: the test stage needs a test split"):
        make().test_dataloader()
    module = make(test_split="validation")
    torch.testing.assert_close(served(module.test_dataloader()), windows(module.tokens["val"], 16))


def val_fraction(make: Make, files: SimpleNamespace) -> None:
    def validating(fraction: float) -> int:
        module = make(val_split=None, val_fraction=fraction)
        return len(decoded_documents(files.field / "tokenizer.json", module.tokens["val"].tolist()))

    assert (validating(0.1), validating(0.2)) == (36, 72)  # of the 360 training documents


def split_seed(make: Make, files: SimpleNamespace) -> None:
    def validating(seed: int) -> np.ndarray:
        return make(val_split=None, val_fraction=0.1, split_seed=seed).tokens["val"]

    assert not np.array_equal(validating(1), validating(0))


def image_root(make: Make, files: SimpleNamespace) -> None:
    module = make(root=str(files.field / "images"))  # 16 images a class, 40 pixels a side, in each split
    assert len(served(module.val_dataloader())[0]) == 32


def image_val_split(make: Make, files: SimpleNamespace) -> None:
    """val_split=holdout: validation serves the holdout folder's 2 images."""
    assert len(served(make(val_split="holdout").val_dataloader())[0]) == 2


def image_train_split(make: Make, files: SimpleNamespace) -> None:
    """train_split=val: training takes the val folder's 4 images (classes a, a, b, b) at batch 3:
    the first 3 of the epoch's order (the train folder's 8 would give 6, the holdout's 2 none)."""
    _, labels = served(make(train_split="val", batch_size=3).train_dataloader())
    assert labels.tolist() == torch.tensor([0, 0, 1, 1])[epoch_order(4, 3)].tolist()


def image_test_split(make: Make, files: SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="test_split=None: the test stage needs a test split"):
        make().test_dataloader()
    assert len(served(make(test_split="val").test_dataloader())[0]) == 4


def image_size(make: Make, files: SimpleNamespace) -> None:
    module = make(image_size=20)
    for loader in (module.train_dataloader(), module.val_dataloader()):
        assert first_batch(loader)[0].shape[1:] == (3, 20, 20)


def prefetch_factor(make: Make, files: SimpleNamespace) -> None:
    assert make(num_workers=1, prefetch_factor=5).train_dataloader().prefetch_factor == 5


def min_crop_scale(make: Make, files: SimpleNamespace) -> None:
    """The same picture, cropped whole: every item is it, or it flipped."""
    images, _ = served(make(min_crop_scale=1.0).train_dataloader())
    assert distinct(images) == 2 and distinct(served(make().train_dataloader())[0]) == 8


def normalisation(knob: str) -> Callable:
    """mean=0, std=1: the images as ToTensor reads them, in [0, 1]; the defaults are ImageNet's."""
    def check(make: Make, files: SimpleNamespace) -> None:
        plain = served(make(mean=[0.0] * 3, std=[1.0] * 3).val_dataloader())[0]
        imagenet = served(make().val_dataloader())[0]
        torch.testing.assert_close(imagenet, (plain - torch.tensor(IMAGENET_MEAN).view(3, 1, 1))
                                   / torch.tensor(IMAGENET_STD).view(3, 1, 1), rtol=0, atol=1e-5)
        assert 0 <= plain.min() and plain.max() <= 1

    return check


KNOBS: Dict[str, Dict[str, Callable[[Make, SimpleNamespace], None]]] = {
    "classification": {**SPLIT_DATA, "input_shape": input_shape, "num_classes": num_classes},
    "images": {**SPLIT_DATA, "input_shape": input_shape, "num_classes": num_classes},
    "language_model": {**SPLIT_DATA, "vocab_size": vocab_size, "seq_len": seq_len},
    "tokens": {"batch_size": batch_size, "num_workers": num_workers, "pin_memory": pin_memory, "seq_len": seq_len,
               "train_bin": token_train_file, "val_bin": token_val_file, "test_bin": token_test_file, "dtype": dtype,
               "windows": sequential_windows, "samples_per_epoch": samples_served("train", "samples_per_epoch"),
               "vocab_size": token_vocabulary},
    "hf_text": {"batch_size": batch_size, "num_workers": num_workers, "pin_memory": pin_memory, "seq_len": seq_len,
                "path": text_path, "lines": text_lines, "text_column": text_column, "tokenizer": tokenizer,
                "eos_token": eos_token, "train_split": split_of("train_split", "validation", "train", "val"),
                "val_split": split_of("val_split", "train", "val", "train"), "test_split": text_test_split,
                "val_fraction": val_fraction, "split_seed": split_seed},
    "imagefolder": {"batch_size": batch_size, "num_workers": num_workers, "pin_memory": pin_memory, "root": image_root,
                    "train_split": image_train_split, "val_split": image_val_split,
                    "test_split": image_test_split, "image_size": image_size, "prefetch_factor": prefetch_factor,
                    "min_crop_scale": min_crop_scale, "mean": normalisation("mean"), "std": normalisation("std")},
}


@pytest.mark.parametrize("name", CONFS)
def test_every_knob_of_every_data_module_has_a_check(name):
    conf = CONF_DIR / "data" / f"{name}.yaml"
    assert set(KNOBS[name]) == knobs_of(get_class(OmegaConf.load(conf)._target_), conf)


@pytest.mark.parametrize("name, knob", [(name, knob) for name in CONFS for knob in sorted(KNOBS[name])])
def test_each_knob_does_what_it_says(made, files, name, knob):
    KNOBS[name][knob](lambda **knobs: made(name, **knobs), files)


# --------------------------------------------------------------------------- the global order on 1, 2 and 3 processes
# Issue 41's example: N = 1,001 training samples, which divide by neither 2 nor 3 processes. With
# the global batch kept (G = 6 batches of B: 1 process accumulating 6, 2 accumulating 3, 3
# accumulating 2), global batch k holds the same samples, cut into the same micro-batches (units
# of B), whatever the number of processes; the last 1,001 % G of each epoch's order sit it out.

N, B = 1001, 4
G = 6 * B
PROCESSES = (1, 2, 3)


@pytest.fixture(scope="module")
def thousand_and_one(files, tmp_path_factory) -> Dict[str, tuple]:
    """case -> (conf, knobs) that make every built-in data module train on N samples of batch B;
    each sample's inputs tell it apart (token ids 0, 1, 2..., a document of its own words, an
    image of its own noise)."""
    import datasets
    from PIL import Image

    folder = tmp_path_factory.mktemp("thousand_and_one")
    image_folder(folder / "images", per_class=N // 2, size=8)
    Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(folder / "images" / "train" / "dark" / "odd.png")
    word_tokenizer(folder / "words.json", (N + 4) * 16)
    texts = [" ".join(f"w{16 * doc + word}" for word in range(16)) for doc in range(N + 4)]  # 17 tokens with its end
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:N]}),
                          "validation": datasets.Dataset.from_dict({"text": texts[N:]})}).save_to_disk(folder / "corpus")
    synthetic = {"num_train": N, "batch_size": B}
    return {"classification": ("classification", synthetic), "images": ("images", synthetic),
            "language_model": ("language_model", synthetic),
            "tokens_random": ("tokens", {"train_bin": str(files.counting), "samples_per_epoch": N, "batch_size": B}),
            "tokens_sequential": ("tokens", {"train_bin": str(token_file(folder / "windows.bin", N * 17)),
                                             "windows": "sequential", "batch_size": B}),
            "imagefolder": ("imagefolder", {"root": str(folder / "images"), "batch_size": B}),
            "hf_text": ("hf_text", {"path": str(folder / "corpus"), "tokenizer": str(folder / "words.json"),
                                    "batch_size": B})}


def sample_ids(inputs: torch.Tensor) -> list[str]:
    """Each sample of a batch by a digest of its inputs' bytes (as tests/helpers/probe.py:SampleIds)."""
    return [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:12] for row in inputs]


def rank_loaders(module: Any, processes: int, epoch: int = 0, position: Any = None) -> list:
    """Each rank's training loader of `module`, `processes` data-parallel ranks accumulating to G."""
    loaders = []
    for rank in range(processes):
        module.trainer = on_device(processes=processes, rank=rank, accumulation=G // (processes * B), epoch=epoch,
                                   position=position)
        loaders.append(module.train_dataloader())
    return loaders


def global_batches(loaders: list) -> list[list[list[str]]]:
    """The global batches the ranks' loaders serve in one pass, each as its units in order: unit j
    of a global batch is the (j // D)-th micro-batch of rank j mod D's optimizer step."""
    processes = len(loaders)
    accumulation = G // (processes * B)
    per_rank = [[sample_ids(inputs) for inputs, _ in loader] for loader in loaders]
    assert len({len(batches) for batches in per_rank}) == 1 and len(per_rank[0]) % accumulation == 0
    return [[per_rank[unit % processes][step * accumulation + unit // processes] for unit in range(G // B)]
            for step in range(len(per_rank[0]) // accumulation)]


@pytest.mark.parametrize("case", ["classification", "images", "language_model", "tokens_random", "tokens_sequential",
                                  "imagefolder", "hf_text"])
def test_1001_samples_give_the_same_global_batches_on_1_2_and_3_processes(made, thousand_and_one, case):
    name, knobs = thousand_and_one[case]
    module = made(name, **knobs)
    alone = global_batches(rank_loaders(module, 1))
    assert len(alone) == N // G and all(len(unit) == B for batch in alone for unit in batch)
    served = [sample for batch in alone for unit in batch for sample in unit]
    if case != "tokens_random":  # random windows are drawn with replacement; every other sample serves at most once
        assert len(set(served)) == len(served) == N // G * G
    for processes in PROCESSES[1:]:
        assert global_batches(rank_loaders(module, processes)) == alone, f"{processes} processes"


@pytest.mark.parametrize("case", ["classification", "tokens_random", "tokens_sequential", "imagefolder", "hf_text"])
def test_a_resumed_position_serves_the_rest_of_its_epoch_and_the_whole_next_one(made, thousand_and_one, case):
    """A run resumed with 5 global batches of epoch 1 trained (the Position GlobalPosition restores),
    on 1, 2 or 3 processes: the loaders serve epoch 1's global batches from the 6th on, then every
    global batch of epoch 2."""
    from runner.data.order import Position

    name, knobs = thousand_and_one[case]
    module = made(name, **knobs)
    uninterrupted = rank_loaders(module, 1, epoch=1)
    epoch_1 = global_batches(uninterrupted)
    uninterrupted[0].sampler.set_epoch(2)
    epoch_2 = global_batches(uninterrupted)
    assert epoch_2 != epoch_1
    position = Position()
    position.epoch, position.samples = 1, 5 * G
    for processes in PROCESSES:
        loaders = rank_loaders(module, processes, epoch=1, position=position)
        assert global_batches(loaders) == epoch_1[5:], f"{processes} processes"
        for loader in loaders:  # Lightning sets each epoch's number on the loader's sampler
            loader.sampler.set_epoch(2)
        assert global_batches(loaders) == epoch_2, f"{processes} processes"
