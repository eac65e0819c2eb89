"""auto's facts about a run, gathered on the driver before any rank starts (runner/command/autotune.py
chooses from them): the model is built on the meta device, so its size, optimizer family, block
list and the bytes one training step saves for backward are known without allocating it."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch import nn

from plugins.modules import repeated_block_list
from runner.core.contribution import Facts


def gather_facts(build_model: Callable[[], pl.LightningModule], datamodule: pl.LightningDataModule, *,
                 device: str, world_size: int, num_nodes: int, batch_size: Optional[int],
                 device_memory_gb: Optional[float]) -> Facts:
    """The facts of a run whose model `build_model` makes, on `device` ("cpu" or "cuda")."""
    with torch.device("meta"):
        model = build_model()
    blocks = repeated_block_list(model)
    per_node = max(1, world_size // num_nodes)
    return Facts(
        parameters=sum(p.numel() for p in model.parameters()),
        optimizer=optimizer_family(model.configure_optimizers()),
        blocks=len(list(blocks[1].children())) if blocks else 0,
        has_loss=callable(getattr(model, "loss", None)),
        activation_bytes=saved_activation_bytes(model, first_batch(datamodule)),
        batch_size=batch_size, world_size=world_size, num_nodes=num_nodes, device=device,
        device_memory_bytes=(int(device_memory_gb * 2**30) if device_memory_gb else memory_per_process(device, per_node)),
        bf16=device != "cuda" or torch.cuda.is_bf16_supported())


def optimizer_family(configured: Any) -> str:
    """sgd, sgd_momentum, adam or other: of the first optimizer in any of Lightning's return forms."""
    found = first_optimizer(configured)
    if isinstance(found, torch.optim.SGD):
        return "sgd_momentum" if found.defaults.get("momentum", 0) > 0 else "sgd"
    if isinstance(found, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    return "other"


def first_optimizer(configured: Any) -> Optional[torch.optim.Optimizer]:
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    values = configured.values() if isinstance(configured, dict) else configured if isinstance(configured, (list, tuple)) else ()
    return next((found for value in values if (found := first_optimizer(value)) is not None), None)


def first_batch(datamodule: pl.LightningDataModule) -> Any:
    datamodule.prepare_data()
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def saved_activation_bytes(model: nn.Module, batch: Any) -> int:
    """Bytes autograd saves for backward in one training forward of `batch` (on the meta device:
    shapes only), parameters left out: what activation memory is made of."""
    parameters = {id(p) for p in model.parameters()}
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if id(tensor) not in parameters and id(getattr(tensor, "_base", None)) not in parameters:
            saved += tensor.numel() * tensor.element_size()
        return tensor

    model.train()
    try:
        inputs, targets = (to_meta(part) for part in batch[:2])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            outputs = model(inputs)
            if callable(getattr(model, "loss", None)):
                model.loss(outputs, targets)
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return 0  # not an (inputs, targets) batch, or a forward the meta device cannot run: unknown
    return saved


def to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def memory_per_process(device: str, processes_per_node: int) -> int:
    """The GPU's memory, or the machine's memory shared by the processes of this node."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // processes_per_node
