"""The data path of a plain training loop on a GPU, checked on the CPU (tests/test_gpu.py runs it on
one): every built-in data module pins its batches on CUDA (and only there), loader workers by default
where the data is in memory, batches copied to the device without blocking, channels-last images for
the convolution models. The plan's cudnn.benchmark is tests/runner/test_plan.py's; the device reads
per micro-batch are tests/test_runs.py's."""
from __future__ import annotations

import os

import pytest
import torch
from hydra.utils import instantiate
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.data_files import on_device
from runner.data.loading import AUTO_WORKERS
from runner.models import ResNetClassifier
from runner.models.vision import VisionClassifier

DATA = {"classification": [], "images": [], "language_model": [],
        "tokens": ["data.train_bin={files}/train.bin", "data.val_bin={files}/val.bin", "data.seq_len=16"],
        "imagefolder": ["data.root={files}/images", "data.image_size=16"],
        "hf_text": ["data.path={files}/corpus", "data.tokenizer={files}/tokenizer.json", "data.val_split=validation",
                    "data.seq_len=16"]}


@pytest.mark.parametrize("data", sorted(DATA))
def test_every_built_in_data_module_pins_its_batches_on_cuda_and_only_there(spec_for, field_files, data):
    spec = spec_for(f"data={data}", *(override.format(files=field_files) for override in DATA[data]))
    for device, pinned in (("cuda", True), ("cpu", False)):
        module = instantiate(spec.cfg.data, _convert_="all")
        module.trainer = on_device(device)
        module.setup("fit")
        assert module.train_dataloader().pin_memory is pinned and module.val_dataloader().pin_memory is pinned
        module.pin_memory = False  # the knob: data.pin_memory=false
        assert module.train_dataloader().pin_memory is False


@pytest.mark.parametrize("data", ["classification", "images", "language_model"])
def test_data_in_memory_gets_loader_workers_on_cuda_and_none_on_a_cpu(spec_for, data):
    module = instantiate(spec_for(f"data={data}").cfg.data, _convert_="all")
    module.setup("fit")
    expected = {("cpu", 1): 0, ("cuda", 1): min(AUTO_WORKERS, os.cpu_count() - 1),
                ("cuda", os.cpu_count()): 0}  # a node's processes leave each one core at least
    for (device, processes), workers in expected.items():
        module.trainer = on_device(device, processes=processes)
        assert module.train_dataloader().num_workers == workers, (device, processes)
    module.num_workers = 3  # the knob: data.num_workers=3
    assert module.train_dataloader().num_workers == 3
    with pytest.raises(ValueError, match=r"^num_workers=many: must be a number >= 0 or auto$"):
        type(module)(num_workers="many")


class Copies(TorchDispatchMode):
    """The copies made while it is on, with their non_blocking argument."""

    def __init__(self) -> None:
        super().__init__()
        self.non_blocking: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.non_blocking.append((kwargs or {}).get("non_blocking", False))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", [ResNetClassifier, lambda: VisionClassifier("resnet18", num_classes=4, image_size=16)],
                         ids=["resnet", "vision"])
def test_batches_reach_the_device_without_blocking_and_in_channels_last(model):
    module = model()
    batch = (torch.randn(2, 3, 16, 16), torch.tensor([0, 1]))
    copies = Copies()
    with copies:  # to another device than the CPU (the meta device stands in for a GPU)
        moved = module.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert copies.non_blocking == [True, True]
    module.channels_last = "true"  # model.channels_last=true
    images, labels = module.on_after_batch_transfer(batch, 0)
    assert images.is_contiguous(memory_format=torch.channels_last) and labels is batch[1]
    module.channels_last, module.trainer = "auto", on_device("cpu")
    assert module.on_after_batch_transfer(batch, 0) is batch  # on a CPU in float32 nothing changes
    assert module.on_after_batch_transfer(moved, 0)[0].device.type == "meta"


@pytest.mark.parametrize("model", [ResNetClassifier, lambda: VisionClassifier("resnet18", num_classes=4, image_size=16)],
                         ids=["resnet", "vision"])
@pytest.mark.parametrize("device, precision, setting, converted", [
    ("cuda", "32-true", "auto", True), ("cpu", "32-true", "auto", False), ("cpu", "bf16-mixed", "auto", False),
    ("cpu", "32-true", "true", True), ("cuda", "16-mixed", "false", False)])
def test_convolution_weights_take_channels_last_on_cuda_or_when_asked(model, device, precision, setting, converted):
    module = model()
    module.channels_last = setting
    module.trainer = on_device(device, precision=precision)
    module.setup("fit")
    weights = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)]
    assert weights and all(w.is_contiguous(memory_format=torch.channels_last) == converted for w in weights)
    images = module.on_after_batch_transfer((torch.randn(2, 3, 16, 16), torch.tensor([0, 1])), 0)[0]
    assert images.is_contiguous(memory_format=torch.channels_last) == converted or device == "cuda"
    with pytest.raises(ValueError, match=r"^channels_last=sometimes: must be one of auto, true, false$"):
        module.set_channels_last("sometimes")
