"""model=vision: any torchvision classification architecture by name (`arch=resnet50`,
`vit_b_16`, `convnext_tiny`...), built from torchvision's own code with no download: random
weights, or a weights file already on disk (`weights_path`, a state dict as torchvision saves it).

Batches are `(images [B, 3, H, W] float, labels [B])`, as data=imagefolder serves them. A ResNet
(resnet*, resnext*, wide_resnet*) is laid out as stem, one flat list of its residual blocks and
head, so that recompute wraps every block and a pipeline may cut between any two; other
architectures keep torchvision's layout, whose first list of repeated blocks (a ViT's encoder
layers, a ConvNeXt stage) serves the same.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from typing_extensions import override

from runner.config.values import check_values
from runner.core.errors import did_you_mean
from runner.models import ChannelsLast, ClassifierModule, OptimizerFactory


def torchvision_model(arch: str, num_classes: int, weights_path: Optional[str]) -> nn.Module:
    """torchvision's `arch` with `num_classes` outputs; ValueError naming the argument when the
    name or the file is wrong (the command turns it into one line)."""
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if arch not in known:
        raise ValueError(f"arch={arch}: not a torchvision classification model{did_you_mean(arch, known)}; "
                         f"torchvision.models.list_models() lists them")
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if weights_path is not None:
        check_values(weights_path=weights_path)
        state = torch.load(Path(weights_path).expanduser(), map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
    return model


class VisionClassifier(ChannelsLast, ClassifierModule):
    """A torchvision classifier: images [B, 3, H, W] -> logits [B, num_classes].

    The optimizer and schedule default to the Fleet collective guide's ResNet-50 setup (momentum
    SGD, 0.9, with a linear warm-up and a decay); `label_smoothing` is optional.
    `channels_last`: the memory format (runner.models.ChannelsLast; auto: on CUDA only).
    """

    def __init__(
        self,
        arch: str = "resnet50",
        num_classes: int = 1000,
        image_size: int = 224,
        weights_path: Optional[str] = None,
        channels_last: Any = "auto",
        optimizer: Optional[OptimizerFactory] = None,
        warmup_steps: int = 0,
        lr_decay: str = "cosine",
        min_lr_ratio: float = 0.0,
        label_smoothing: float = 0.0,
    ) -> None:
        check_values(num_classes=num_classes, image_size=image_size)
        super().__init__(optimizer, warmup_steps, lr_decay, min_lr_ratio, label_smoothing)
        self.set_channels_last(channels_last)
        self.arch, self.image_size = arch, image_size
        net = torchvision_model(arch, num_classes, weights_path)
        self.net: Optional[nn.Module] = None if hasattr(net, "layer1") and hasattr(net, "fc") else net
        if self.net is None:  # torchvision's ResNet family
            self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
            self.blocks = nn.Sequential(*net.layer1, *net.layer2, *net.layer3, *net.layer4)
            self.head = nn.Sequential(net.avgpool, nn.Flatten(1), net.fc)
        # Training FLOPs of one image (forward and backward: 3x the forward's), counted by torch's
        # FLOP counter on a twin of the model on the meta device (no memory, no arithmetic): MFU.
        from torch.utils.flop_counter import FlopCounterMode

        with torch.device("meta"):
            twin, image = torchvision_model(arch, num_classes, None), torch.zeros(1, 3, image_size, image_size)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            twin.eval()(image)
        self.flops_per_sample = 3 * counter.get_total_flops()

    @override
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.net is not None:
            return self.net(images)
        return self.head(self.blocks(self.stem(images)))
