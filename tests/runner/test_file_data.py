"""The data of files (runner/data/tokens.py, images.py): what each split serves, in which order,
on which rank, and the one-line refusals of files that cannot serve. Tiny files are made here:
token files from numpy, a folder of generated PNGs. Training on them: tests/test_real_models.py."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers.commands import command_env
from tests.helpers.data_files import image_folder, on_device, token_file
from runner.data.tokens import TokenFileData

SEQ_LEN = 8


@pytest.fixture
def token_files(tmp_path) -> dict:
    return {"train_bin": str(token_file(tmp_path / "train.bin", 1000)),
            "val_bin": str(token_file(tmp_path / "val.bin", 100))}


def starts(loader) -> list:
    """The first token of every window the loader serves, in order."""
    return [int(x[0]) for inputs, targets in loader for x in inputs]


def data(token_files, **knobs) -> TokenFileData:
    return TokenFileData(**token_files, seq_len=SEQ_LEN, batch_size=4, **knobs)


def test_a_window_is_seq_len_plus_one_consecutive_tokens_as_inputs_and_next_tokens(token_files):
    inputs, targets = next(iter(data(token_files).train_dataloader()))
    assert inputs.shape == targets.shape == (4, SEQ_LEN) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets[:, -1] - inputs[:, 0], torch.full((4,), SEQ_LEN))


def test_sequential_windows_serve_each_window_at_most_once_per_epoch_shuffled(token_files, monkeypatch):
    """The file's 111 consecutive windows, shuffled every epoch from (the run's seed, the epoch):
    at batch 4 an epoch serves the first 108 of its order, and the 3 after sit that epoch out."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    loader = data(token_files, windows="sequential").train_dataloader()
    left_out = []
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        order = torch.randperm(111, generator=torch.Generator().manual_seed(epoch)) * (SEQ_LEN + 1)
        served = starts(loader)
        assert served == order[:108].tolist() and len(set(served)) == 108
        left_out.append(set(range(0, 1000 - SEQ_LEN, SEQ_LEN + 1)) - set(served))
    assert len(left_out[0]) == len(left_out[1]) == 3 and left_out[0] != left_out[1]


def test_validation_is_every_consecutive_window_in_order(token_files):
    assert starts(data(token_files).val_dataloader()) == list(range(0, 100 - SEQ_LEN, SEQ_LEN + 1))


def test_random_windows_start_anywhere_and_change_with_the_epoch_not_the_global_rng(token_files, monkeypatch):
    loader = data(token_files, samples_per_epoch=40).train_dataloader()
    first = starts(loader)
    torch.manual_seed(123)  # the global RNG plays no part
    assert starts(data(token_files, samples_per_epoch=40).train_dataloader()) == first
    assert len(first) == 40 and max(first) <= 1000 - SEQ_LEN - 1 and len(set(x % (SEQ_LEN + 1) for x in first)) > 1
    loader.sampler.set_epoch(1)
    assert starts(loader) != first
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # the run's seed: another order
    assert starts(data(token_files, samples_per_epoch=40).train_dataloader()) != first


@pytest.mark.parametrize("windows, epoch_windows", [("random", 42), ("sequential", 111)])
def test_ranks_take_disjoint_equal_shares_of_one_epochs_windows(token_files, windows, epoch_windows, monkeypatch):
    """2 ranks at batch 4 make the global batch G = 8 that 1 process accumulating 2 batches makes:
    the epoch's windows (42 random ones, or the file's 111 consecutive ones) are cut to a multiple
    of 8, in units of 4 (batches), and unit j goes to rank j mod 2."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")

    def units(processes: int, rank=None) -> list:
        module = data(token_files, windows=windows, samples_per_epoch=42)
        module.trainer = on_device(processes=processes, rank=rank, accumulation=2 // processes)
        return [[int(x[0]) for x in inputs] for inputs, _ in module.train_dataloader()]

    alone = units(1)
    shares = [units(2, rank) for rank in (0, 1)]
    assert sum(map(len, alone)) == epoch_windows // 8 * 8 and all(len(unit) == 4 for unit in alone)
    assert shares == [alone[0::2], alone[1::2]]
    if windows == "sequential":  # each window once: the ranks' shares are disjoint
        assert len({start for unit in alone for start in unit}) == epoch_windows // 8 * 8


def test_uint32_files_hold_ids_past_uint16(tmp_path):
    path = tmp_path / "big.bin"
    np.array([70000 + i for i in range(40)], dtype=np.uint32).tofile(path)
    module = TokenFileData(train_bin=str(path), val_bin=str(path), dtype="uint32", seq_len=4, batch_size=2)
    inputs, _ = next(iter(module.val_dataloader()))
    assert inputs[0].tolist() == [70000, 70001, 70002, 70003]


def test_workers_serve_the_same_batches(token_files):
    alone = starts(data(token_files).train_dataloader())
    assert starts(data(token_files, num_workers=2).train_dataloader()) == alone


# --------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    ({"train_bin": "missing.bin"}, "data.train_bin='missing.bin': no such file (a flat file of uint16 token ids"),
    ({"val_bin": "odd.bin"}, "data.val_bin='odd.bin': 7 bytes is not a whole number of uint16 tokens (2 bytes each)"),
    ({"seq_len": 200}, "data.seq_len=200: longer than val_bin (val.bin) allows: it holds 100 tokens and a window "
                       "needs seq_len + 1"),
    ({"windows": "randm"}, "data.windows='randm': must be one of random, sequential"),
    ({"val_bin": "???"}, "data.val_bin: is required: set data.val_bin=... on the command line or in an experiment"),
], ids=["missing", "not_whole_tokens", "seq_len_too_long", "windows", "not_given"])
def test_files_that_cannot_serve_are_refused_in_one_line(lightfleet, tmp_path, change, message):
    token_file(tmp_path / "train.bin", 1000)
    token_file(tmp_path / "val.bin", 100)
    (tmp_path / "odd.bin").write_bytes(b"1234567")
    knobs = {"train_bin": "train.bin", "val_bin": "val.bin", "seq_len": SEQ_LEN, **change}
    done = lightfleet("model=causal_lm", "data=tokens", *[f"data.{key}={value}" for key, value in knobs.items()])
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"lightfleet: error: {message}" + done.stderr.split(message, 1)[1].rstrip()]
    assert message in done.stderr and "Traceback" not in done.stderr


# --------------------------------------------------------------------------- data=imagefolder


def images(**knobs):
    from runner.data.images import ImageFolderData

    return ImageFolderData(**{"image_size": 16, "batch_size": 4, "num_workers": 0, **knobs})


def test_imagefolder_serves_normalized_crops_with_the_folders_labels(tmp_path):
    module = images(root=str(image_folder(tmp_path)))
    batch, labels = next(iter(module.train_dataloader()))
    assert batch.shape == (4, 3, 16, 16) and batch.dtype == torch.float32 and labels.dtype == torch.int64
    assert module.num_classes == 2
    val = [(x, y) for x, y in module.val_dataloader()]
    assert [y.tolist() for _, y in val] == [[0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]]  # in order: dark, then light
    dark, light = val[0][0].mean(), val[-1][0].mean()
    assert dark < 0 < light  # normalized with ImageNet's mean and deviation


def test_imagefolder_crops_and_order_depend_on_the_seed_and_epoch_not_on_workers(tmp_path, monkeypatch):
    root = str(image_folder(tmp_path))

    def epoch(num_workers, epoch=0):
        loader = images(root=root, num_workers=num_workers).train_dataloader()
        loader.sampler.set_epoch(epoch)
        return torch.cat([x for x, _ in loader])

    first = epoch(0)
    torch.manual_seed(99)  # the global RNG plays no part
    torch.testing.assert_close(epoch(2), first, rtol=0, atol=0)
    assert not torch.equal(epoch(0, epoch=1), first)
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    assert not torch.equal(epoch(0), first)


@pytest.mark.slow
@pytest.mark.parametrize("make, knobs, message", [
    (False, {"root": "nowhere"}, "data.root='nowhere': no such folder (train/ and val/ folders of class folders"),
    (True, {"val_split": "valid"}, "data.val_split='valid': no folder"),
    ("empty", {}, "data.train_split='train':"),
], ids=["no_root", "no_split", "no_images"])
def test_image_folders_that_cannot_serve_are_refused_in_one_line(lightfleet, tmp_path, make, knobs, message):
    if make:
        image_folder(tmp_path / "images", per_class=1)
    if make == "empty":
        for png in (tmp_path / "images" / "train").rglob("*.png"):
            png.unlink()
    overrides = {"root": "images", **knobs}
    done = lightfleet("model=vision", "data=imagefolder", *[f"data.{key}={value}" for key, value in overrides.items()])
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"lightfleet: error: {message}")


def test_the_shipped_confs_build_on_files(tmp_path):
    import hydra
    from omegaconf import OmegaConf

    from runner.core.paths import CONF_DIR

    token_file(tmp_path / "train.bin", 1000)
    token_file(tmp_path / "val.bin", 100)
    image_folder(tmp_path / "images", per_class=1)
    # 2 training images: a batch of 2, as an epoch serves only whole global batches.
    files = {"tokens": {"train_bin": str(tmp_path / "train.bin"), "val_bin": str(tmp_path / "val.bin"), "seq_len": 8},
             "imagefolder": {"root": str(tmp_path / "images"), "image_size": 16, "num_workers": 0, "batch_size": 2}}
    for name, knobs in files.items():
        conf = OmegaConf.merge(OmegaConf.load(CONF_DIR / "data" / f"{name}.yaml"), knobs)
        module = hydra.utils.instantiate(conf)
        inputs, targets = next(iter(module.train_dataloader()))
        assert len(inputs) == len(targets) == conf.batch_size


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv to drop root's file access")
def test_data_files_the_user_cannot_read_are_refused_before_any_directory_exists(tmp_path):
    """Issue 40 item 6. The tests run as root, who reads any file whatever its mode: the command runs
    as root without the capabilities that bypass file permissions (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH), as a user who does not own the files would."""
    token_file(tmp_path / "train.bin", 1000)
    token_file(tmp_path / "val.bin", 100)
    image_folder(tmp_path / "images", per_class=1)
    (tmp_path / "train.bin").chmod(0)
    (tmp_path / "images").chmod(0)
    as_a_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m", "runner",
                 "trainer.max_steps=1", "paths.output_dir=run"]
    for overrides, message in (
            (["model=causal_lm", "data=tokens", "data.train_bin=train.bin", "data.val_bin=val.bin", "data.seq_len=8"],
             "data.train_bin='train.bin': cannot be read: Permission denied (a flat file of uint16 token ids"),
            (["data=imagefolder", "data.root=images", "model=resnet"],
             "data.root='images': cannot be read: Permission denied (train/ and val/ folders")):
        done = subprocess.run([*as_a_user, *overrides], cwd=tmp_path, env=command_env(), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 2 and done.stderr.startswith(f"lightfleet: error: {message}"), done.stderr[-3000:]
        assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "run").exists()
