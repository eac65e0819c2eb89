"""The built-in LightningModules: compact ones here (a residual MLP, a small ResNet and a
GPT-style decoder), and the field's own models in vision.py (torchvision's classifiers) and
causal_lm.py (Hugging Face transformers' causal LMs).

All share `ClassifierModule`, which owns the loss, the metrics, the optimizer and its learning-rate
schedule, so each model only defines its layers and `forward`. Every model keeps its repeated
layers in a list of >= 2 children of one class (`blocks` here): activation recomputation finds
the layers to checkpoint there, and a pipeline cuts between them.
"""
from __future__ import annotations

import functools
import math
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional, Sequence

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from typing_extensions import override

from runner.config.values import check_values
from runner.core.errors import require_at_least

# A torch optimizer class with its hyper-parameters bound, waiting for the parameters:
# what Hydra builds from a config node with `_partial_: true`.
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ClassifierModule(pl.LightningModule):
    """Cross-entropy training on `(inputs, targets)` batches, targets shaped [B] or [B, T].

    Subclasses build their layers and implement `forward(inputs) -> logits` with the classes
    on the last dimension.
    """

    def __init__(self, optimizer: Optional[OptimizerFactory] = None, warmup_steps: int = 0, lr_decay: str = "none",
                 min_lr_ratio: float = 0.0, label_smoothing: float = 0.0) -> None:
        check_values(warmup_steps=warmup_steps)
        if lr_decay not in LR_DECAYS:
            raise ValueError(f"lr_decay={lr_decay}: must be one of {', '.join(LR_DECAYS)}")
        if not 0 <= min_lr_ratio <= 1 or not 0 <= label_smoothing < 1:
            raise ValueError(f"min_lr_ratio={min_lr_ratio}, label_smoothing={label_smoothing}: must be in [0, 1]")
        super().__init__()
        # Lightning collects the subclass's constructor arguments too; the optimizer is a
        # callable, not a hyper-parameter worth saving in a checkpoint.
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
        self.warmup_steps, self.lr_decay, self.min_lr_ratio = warmup_steps, lr_decay, min_lr_ratio
        self.label_smoothing = label_smoothing

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of `forward`'s output against the targets (pipeline parallelism
        calls it on the last stage, once per micro-batch)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                               label_smoothing=self.label_smoothing)

    def _loss_and_accuracy(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = self(inputs)
        loss = self.loss(logits, targets)
        accuracy = (logits.argmax(-1) == targets).float().mean()
        return loss, accuracy

    @override
    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.loss(self(inputs), targets)  # no accuracy: an argmax over a 50k vocabulary costs a pass over the logits
        # Not prog_bar: Lightning reads a progress-bar metric off the device after every batch
        # (a synchronisation per micro-batch on a GPU); the bar reads it at logging steps (runner/rank/progress.py).
        self.log("train_loss", loss, on_step=True)
        return loss

    @override
    def validation_step(self, batch, batch_idx: int) -> None:
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log_dict({"val_loss": loss, "val_acc": accuracy}, sync_dist=True)

    @override
    def test_step(self, batch, batch_idx: int) -> None:
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log_dict({"test_loss": loss, "test_acc": accuracy}, sync_dist=True)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if not self.warmup_steps and self.lr_decay == "none":
            return optimizer
        total = self.trainer.estimated_stepping_batches if self._trainer else self.warmup_steps
        factor = functools.partial(lr_factor, warmup=self.warmup_steps, total=total, decay=self.lr_decay,
                                   floor=self.min_lr_ratio)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}}


LR_DECAYS = ("none", "cosine", "linear")
CHANNELS_LAST = ("auto", "true", "false")


class ChannelsLast(pl.LightningModule):
    """A convolution model's memory format: channels-last weights and input images where
    `channels_last` says so (auto: on CUDA, where cuDNN's convolutions run faster in it and a
    plain loop uses it; not on CPUs). The images are converted once on the device, as each batch
    arrives (Lightning's on_after_batch_transfer), before any forward sees them."""

    channels_last: str

    def set_channels_last(self, value: Any) -> None:
        if str(value).lower() not in CHANNELS_LAST:
            raise ValueError(f"channels_last={value}: must be one of {', '.join(CHANNELS_LAST)}")
        self.channels_last = str(value).lower()

    def uses_channels_last(self, device: torch.device) -> bool:
        if self.channels_last != "auto":
            return self.channels_last == "true"
        return device.type == "cuda"

    @override
    def setup(self, stage: str) -> None:
        # Before the strategy moves and wraps the model: the format survives the move to the device.
        if self.uses_channels_last(self.trainer.strategy.root_device):
            self.to(memory_format=torch.channels_last)

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, *rest = batch
        if images.dim() == 4 and self.uses_channels_last(images.device):
            return (images.contiguous(memory_format=torch.channels_last), *rest)
        return batch


def lr_factor(step: int, warmup: int, total: float, decay: str, floor: float) -> float:
    """The learning rate at optimizer step `step` as a fraction of the configured one: a linear
    warm-up from 1/warmup over `warmup` steps (Goyal et al.'s gradual warm-up), then `decay` to
    `floor` at step `total` (cosine or linear; none keeps it)."""
    if step < warmup:
        return (step + 1) / warmup
    if decay == "none" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return floor + (1 - floor) * shape


# --------------------------------------------------------------------------- MLP


class ResidualMLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


class MLPClassifier(ClassifierModule):
    """Residual MLP on flat feature vectors [B, input_dim] -> logits [B, num_classes]."""

    def __init__(
        self,
        input_dim: int = 32,
        hidden_dim: int = 64,
        num_blocks: int = 3,
        num_classes: int = 4,
        optimizer: Optional[OptimizerFactory] = None,
    ) -> None:
        check_values(input_dim=input_dim, hidden_dim=hidden_dim, num_blocks=num_blocks, num_classes=num_classes)
        super().__init__(optimizer)
        self.stem = nn.Linear(input_dim, hidden_dim)
        self.blocks = nn.ModuleList(ResidualMLPBlock(hidden_dim) for _ in range(num_blocks))
        self.head = nn.Sequential(nn.LayerNorm(hidden_dim), nn.Linear(hidden_dim, num_classes))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# --------------------------------------------------------------------------- ResNet


def conv_bn(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> nn.Sequential:
    # Named children keep "bn" in the batch-norm parameter names (weight decay skips them by
    # name); the conv has no bias because the batch norm right after it supplies one.
    conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding=kernel_size // 2, bias=False)
    return nn.Sequential(OrderedDict(conv=conv, bn=nn.BatchNorm2d(out_channels)))


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a shortcut (1x1 conv-bn when the shape changes), then relu."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv_bn1 = conv_bn(in_channels, out_channels, 3, stride)
        self.conv_bn2 = conv_bn(out_channels, out_channels, 3)
        reshapes = stride != 1 or in_channels != out_channels
        self.shortcut = conv_bn(in_channels, out_channels, 1, stride) if reshapes else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv_bn2(F.relu(self.conv_bn1(x)))
        return F.relu(out + self.shortcut(x))


class ResNetClassifier(ChannelsLast, ClassifierModule):
    """Small ResNet on images [B, in_channels, H, W] -> logits [B, num_classes].

    One stage per entry of `widths`; every stage after the first halves the resolution.
    `channels_last`: the memory format (ChannelsLast; auto: on CUDA only).
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 4,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int = 1,
        channels_last: Any = "auto",
        optimizer: Optional[OptimizerFactory] = None,
    ) -> None:
        check_values(in_channels=in_channels, num_classes=num_classes, widths=widths, blocks_per_stage=blocks_per_stage)
        require_at_least(1, stages=len(widths))
        super().__init__(optimizer)
        self.set_channels_last(channels_last)
        self.stem = nn.Sequential(conv_bn(in_channels, widths[0], 3), nn.ReLU())
        blocks, channels = [], widths[0]
        for stage, width in enumerate(widths):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))  # global average pool


# --------------------------------------------------------------------------- GPT


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. Separate q, k, v projections and views sized by
    `head_dim` (not by the number of heads) let tensor parallelism split the heads by
    splitting the projections' output features."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # [B, T, heads * head_dim] -> [B, heads, T, head_dim]
        q, k, v = (f(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))


class DecoderBlock(nn.Module):
    """Pre-LN transformer decoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTDecoder(ClassifierModule):
    """GPT-style decoder: tokens [B, T] (T <= seq_len) -> next-token logits [B, T, vocab_size].

    `val_acc` is next-token accuracy over all positions.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 32,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        optimizer: Optional[OptimizerFactory] = None,
    ) -> None:
        check_values(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model}: must be a multiple of n_heads={n_heads}")
        super().__init__(optimizer)
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(DecoderBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        # Training FLOPs per token (forward and backward), for model FLOPs utilisation: 6 per
        # weight a token meets (embedding lookups are free) plus attention's scores and
        # weighted sums over the context (PaLM, appendix B).
        weights = sum(p.numel() for part in (self.blocks, self.ln_f, self.head) for p in part.parameters())
        self.flops_per_token = 6 * weights + 12 * n_layers * d_model * seq_len

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """How tensor parallelism splits the decoder (torchtitan's plan without sequence parallelism):
        q, k, v and the first MLP layer by output features (whole heads per rank), the attention
        projection and the second MLP layer by input features, whose partial sums are all-reduced.
        Embeddings, norms and the head stay replicated, so the logits and the loss are as usual."""
        return {"blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(),
                "blocks.*.attn.v": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
                "blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()}

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
