"""auto's facts about a run, gathered on the driver before any rank starts (runner/command/autotune.py
chooses from them): the model is built on the meta device, so its size, optimizer family, block
list and the bytes one training step saves for backward are known without allocating it. The
forward runs on fake tensors of the run's device (shapes and dtypes only, dispatched as on that
device, so autocast applies its rules as it would in training), on any machine: a run planned
for CUDA is measured with CUDA's rules on a machine without a GPU too."""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from plugins.modules import float_buffer_modules, repeated_block_list
from runner.core.contribution import SAVED_PARTS, SAVED_PRECISIONS, Facts


def gather_facts(build_model: Callable[[], pl.LightningModule], datamodule: pl.LightningDataModule, *,
                 device: str, world_size: int, num_nodes: int, batch_size: Optional[int],
                 device_memory_gb: Optional[float], bf16: Optional[bool] = None) -> Facts:
    """The facts of a run whose model `build_model` makes, on `device` ("cpu" or "cuda"); `bf16`:
    whether that device computes in bfloat16 (None: this machine's GPU's, where `device` is cuda)."""
    with torch.device("meta"):
        model = build_model()
    blocks = repeated_block_list(model)
    per_node = max(1, world_size // num_nodes)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = optimizer_family(model.configure_optimizers())
    block_list = list(blocks[1].children()) if blocks else []
    saved = saved_activations(model, first_batch(datamodule), block_list, device)
    return Facts(
        parameters=parameters, optimizer=optimizer, blocks=len(block_list),
        has_loss=callable(getattr(model, "loss", None)),
        activation_bytes=saved["float32"]["total"] if saved else 0, saved=saved,
        batch_size=batch_size, world_size=world_size, num_nodes=num_nodes, device=device,
        device_memory_bytes=(int(device_memory_gb * 2**30) if device_memory_gb else memory_per_process(device, per_node)),
        bf16=(device != "cuda" or torch.cuda.is_bf16_supported()) if bf16 is None else bf16)


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


@dataclass
class SavedStorages:
    """Storage -> bytes of what one forward saves, split by where it was saved, and the most bytes
    the loss's backward holds at once beyond them."""

    outside: Dict[int, int] = field(default_factory=dict)
    head: Set[int] = field(default_factory=set)  # of `outside`: saved after a block had finished
    per_block: List[Dict[int, int]] = field(default_factory=list)
    inputs: Dict[int, int] = field(default_factory=dict)
    loss_backward: int = 0

    def counted(self) -> Dict[str, int]:
        """Bytes by part (Facts.saved's SAVED_PARTS)."""
        inside = {key: size for block in self.per_block for key, size in block.items() if key not in self.outside}
        rebuilt = [sum(size for key, size in block.items() if key not in self.outside and key not in self.inputs)
                   for block in self.per_block]
        return {"total": sum(self.outside.values()) + sum(inside.values()),
                "head": sum(self.outside[key] for key in self.head), "in_blocks": sum(inside.values()),
                "block_inputs": sum(size for key, size in self.inputs.items() if key not in self.outside),
                "largest_block": max(rebuilt, default=0), "loss_backward": self.loss_backward}


def saved_activations(model: nn.Module, batch: Any, blocks: List[nn.Module],
                      device: str) -> Optional[Dict[str, Dict[str, int]]]:
    """What one training forward of `batch` on `device` saves for backward, by precision and part
    (Facts.saved), with each part's bytes that do not shrink with the batch from a second forward
    of half the batch; None when the batch is not (inputs, targets) or the forward cannot run on
    fake tensors (unknown). `model` (on the meta device) is made fake in place, and 16-bit for the
    last precision."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    found = {}
    try:
        with mode:
            model.to_empty(device=device)
            whole = tuple(mode.from_tensor(part).to(device) if isinstance(part, torch.Tensor) else part
                          for part in batch[:2])
        half = halved(*whole)
        for precision in SAVED_PRECISIONS:
            if precision == "autocast_16bit_parameters":
                with mode:
                    to_16_bits(model)
            autocast = precision != "float32"
            at_whole = saved_storages(model, *whole, blocks, mode, device, autocast).counted()
            at_half = saved_storages(model, *half, blocks, mode, device, autocast).counted() if half else None
            found[precision] = {**at_whole, **{f"{part}_fixed": fixed_part(at_whole[part], at_half and at_half[part])
                                               for part in SAVED_PARTS}}
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return None
    return found


@contextlib.contextmanager
def autocast_rules(device: str, enabled: bool) -> Iterator[None]:
    """bfloat16 autocast with `device`'s rules (CUDA's keep layer_norm, softmax, pow and the losses
    in float32; the CPU's keep fewer). torch.autocast("cuda") turns itself off on a machine without
    a GPU; these switches do not, and fake CUDA tensors then follow CUDA's rules."""
    before = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, enabled)
    torch.set_autocast_dtype(device, torch.bfloat16)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, before[0])
        torch.set_autocast_dtype(device, before[1])
        torch.clear_autocast_cache()  # the weights' 16-bit copies, made anew by each forward as in training


class GpuAttention(TorchFunctionMode):
    """F.scaled_dot_product_attention on fake CUDA tensors as a GPU runs it. torch picks the kernel
    by asking the device; without a GPU it falls back to the math path, which saves the whole
    attention matrix, and pinning a kernel with torch.nn.attention.sdpa_kernel finds none. A
    Hopper GPU runs flash attention for 16-bit inputs without a mask (memory-efficient attention
    otherwise); both save the inputs, the output and the log-sum-exp, as the memory-efficient
    kernel called directly does here on any inputs (with the mask)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        return fused_attention(*args, **(kwargs or {}))


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention's arguments (grouped key/value heads need no flag: the kernel
    takes them as they are), cast as CUDA autocast casts sdpa's inputs."""
    if torch.is_autocast_enabled("cuda"):
        query, key, value = (t.to(torch.get_autocast_dtype("cuda")) for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


def to_16_bits(model: nn.Module) -> None:
    """The model as FSDP2 runs it under amp (plugins/sharding.py): parameters and floating inputs
    in bfloat16; batch norm's parameters and inputs in float32, its output in bfloat16."""
    kept = set(float_buffer_modules(model).values())
    for module in model.modules():
        if module not in kept:
            for name, parameter in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(parameter.to(torch.bfloat16), parameter.requires_grad))
    for module, dtype in ((model, torch.bfloat16), *((module, torch.float32) for module in kept)):
        module.register_forward_pre_hook(lambda _, args, dtype=dtype: tuple(
            arg.to(dtype) if isinstance(arg, torch.Tensor) and arg.is_floating_point() else arg for arg in args))
    for module in kept:
        module.register_forward_hook(lambda _, args, output: output.to(torch.bfloat16))


def halved(inputs: Any, targets: Any) -> Optional[Tuple[Any, Any]]:
    """The first half of a batch of tensors (None when it does not halve)."""
    if not (isinstance(inputs, torch.Tensor) and inputs.dim() and inputs.shape[0] >= 2 and inputs.shape[0] % 2 == 0):
        return None
    size = inputs.shape[0] // 2  # copies: a slice would hold on to the whole batch's storage
    return inputs[:size].clone(), targets[:size].clone() if isinstance(targets, torch.Tensor) else targets


def fixed_part(whole: int, half: Optional[int]) -> int:
    """Of `whole` bytes, those that would stay at a smaller batch (linear in the batch: 2 half - whole)."""
    return 0 if half is None else min(whole, max(0, 2 * half - whole))


def saved_storages(model: nn.Module, inputs: Any, targets: Any, blocks: List[nn.Module], mode: FakeTensorMode,
                   device: str, autocast: bool) -> SavedStorages:
    """The storages one training forward saves, each under the block running when it was first
    saved (a storage saved twice, or a view of one saved, is counted once, as it is held once),
    and what backward through the loss adds to them."""
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    found = SavedStorages(per_block=[{} for _ in blocks])
    running: List[int] = []
    finished: Set[int] = set()  # blocks whose forward ended: what is saved after them is the head's
    kept: List[torch.Tensor] = []  # alive until counted, so that no storage's address is reused

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, storage = tensor.untyped_storage()._cdata, tensor.untyped_storage()
        if key not in parameters and not any(key in where for where in (found.outside, *found.per_block)):
            (found.per_block[running[-1]] if running else found.outside)[key] = storage.nbytes()
            if not running and finished:
                found.head.add(key)
            kept.append(tensor)
        return tensor

    def enter(index: int, args: tuple) -> None:
        running.append(index)
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                found.inputs[arg.untyped_storage()._cdata] = arg.untyped_storage().nbytes()
                kept.append(arg)

    def leave(index: int) -> None:
        running.remove(index)
        finished.add(index)

    hooks = [hook for index, block in enumerate(blocks) for hook in (
        block.register_forward_pre_hook(lambda module, args, index=index: enter(index, args)),
        block.register_forward_hook(lambda module, args, output, index=index: leave(index)))]
    model.train()
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
                autocast_rules(device, autocast), GpuAttention() if device == "cuda" else contextlib.nullcontext():
            outputs = model(inputs)
            if callable(getattr(model, "loss", None)):
                model.loss(outputs, targets)
    finally:
        for hook in hooks:
            hook.remove()
    if callable(getattr(model, "loss", None)):
        found.loss_backward = loss_backward(model, outputs, targets, mode, device, autocast)
    return found


def loss_backward(model: nn.Module, outputs: Any, targets: Any, mode: FakeTensorMode, device: str,
                  autocast: bool) -> int:
    """The most bytes backward through `model.loss` holds at once beyond what forward saved: at the
    very start of backward, on top of everything saved, the gradients of the loss's own tensors (a
    language model's log-softmax over its vocabulary: one or two float32 logits, by the device's
    autocast rules). Counted by torch's MemTracker on fake tensors, the loss taken of a copy of
    `outputs` that backward stops at; 0 for a loss without a gradient, or with a custom autograd
    Function (its node runs only inside the engine)."""
    saved: List[Saved] = []
    unpacked: List[Saved] = []

    def unpack(held: Saved) -> torch.Tensor:
        unpacked.append(held)
        return held.tensor

    def release_unpacked() -> None:  # as the engine releases a node's saved tensors once it ran
        for held in unpacked:
            held.tensor = None
        unpacked.clear()

    with mode:
        logits = tree_map_only(torch.Tensor, lambda t: torch.empty_like(t).requires_grad_(t.requires_grad), outputs)
    with mode, autocast_rules(device, autocast), torch.autograd.graph.saved_tensors_hooks(
            lambda tensor: saved.append(Saved(tensor)) or saved[-1], unpack):
        loss = model.loss(logits, targets)
    waiting = incoming_gradients(loss.grad_fn) if loss.grad_fn is not None else Counter()
    if loss.grad_fn is None or not all(map(callable, (loss.grad_fn, *waiting))):
        return 0
    tracker = MemTracker()
    tracker.track_external(logits, *(held.tensor for held in saved))
    before = tracked_bytes(tracker.get_tracker_snapshot())
    with mode, tracker:
        backward_node_by_node(loss, waiting, release_unpacked)
    return tracked_bytes(tracker.get_tracker_snapshot("peak")) - before


@dataclass
class Saved:
    """A tensor saved for backward, held here so that loss_backward can let it go once the node
    that unpacked it ran."""

    tensor: Optional[torch.Tensor]


def incoming_gradients(root: Any) -> Counter:
    """Each autograd node after `root` -> how many gradients come to it in backward from `root`."""
    waiting: Counter = Counter()
    stack = [root]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None:
                if child not in waiting:
                    stack.append(child)
                waiting[child] += 1
    return waiting


def backward_node_by_node(loss: torch.Tensor, waiting: Counter, released: Callable[[], None]) -> None:
    """Backward from `loss` to the leaves, each node run once all its gradients (`waiting`) have
    come, its gradients let go once it ran and, through `released`, the saved tensors it unpacked:
    the order and the lifetimes of torch's autograd engine, which cannot run here, as it asks a
    CUDA device for its streams even for fake tensors. The leaves' gradients are not accumulated."""
    gradients = {loss.grad_fn: [torch.ones_like(loss)]}
    ready = [loss.grad_fn]
    while ready:
        node = ready.pop()
        inputs = gradients.pop(node)
        if node.next_functions:  # not a leaf's AccumulateGrad
            with torch.no_grad():  # as the engine runs it: no graph of the backward, which would hold its inputs
                hand_on(node, node(*inputs), gradients, waiting, ready)
        del inputs
        released()


def hand_on(node: Any, outputs: Any, gradients: Dict[Any, list], waiting: Counter, ready: list) -> None:
    """`node`'s gradients into the inputs of the nodes after it (summed where several meet); those
    that have all theirs are ready. A function of its own: a loop variable left holding a gradient
    would keep it alive."""
    for (child, slot), gradient in zip(node.next_functions, outputs if isinstance(outputs, tuple) else (outputs,)):
        if child is None:
            continue
        buffer = gradients.setdefault(child, [None] * len(child._input_metadata))  # one a node's input
        buffer[slot] = gradient if buffer[slot] is None or gradient is None else buffer[slot] + gradient
        waiting[child] -= 1
        if not waiting[child]:
            ready.append(child)


def tracked_bytes(snapshot: Dict[Any, Dict[str, int]]) -> int:
    """A MemTracker snapshot's bytes over all devices."""
    return sum(by_kind["Total"] for by_kind in snapshot.values())


def memory_per_process(device: str, processes_per_node: int) -> Optional[int]:
    """The GPU's memory, or the machine's memory shared by the processes of this node; None
    (unknown: nothing pruned) for a GPU this machine lacks, planning here a run for another."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // processes_per_node
