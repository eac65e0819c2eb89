"""The rehearsal's one adapter for torch's private API (issue 42): a fake world of N processes
(torch's fake process group), fake tensors (FakeTensorMode: shapes, dtypes and devices without
memory or arithmetic), and what counts a rehearsed step (torch.distributed._tools' memory
tracker; a dispatch mode counting collectives, FLOPs and memory traffic).

Everything private lives here, as Hydra's does in runner/config/hydra_api.py:
tests/plugins/test_rehearsal.py fails loudly, naming the import, when torch moves one of them.
The real code's hooks ask this module (`real_tensors`, `on_meta_while_fake`, `to_device`) and are
no-ops outside a rehearsal.

Over 400 lines on purpose: shared/DESIGN.md keeps torch's private API behind ONE adapter module,
with one test naming every private name; the rehearsed DDP, the trackers and the step counter all
lean on that API, so splitting them would spread it over several modules.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map_only

# --- torch's private API: every name a rehearsal uses, imported here and nowhere else.
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType  # noqa: E402
from torch._C._distributed_c10d import _compute_bucket_assignment_by_size, _create_work_from_future  # noqa: E402
from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: E402
from torch.nn.parallel.distributed import _BucketCapacityConfig  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402

# The contract's op names (docs/rehearse.md) for the c10d ops and the functional collectives.
COLLECTIVES = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "reduce_": "reduce",
}
# The tensor argument whose bytes are the payload this rank contributes (the contract's: what it
# sends; for an all-gather its input, for a reduce-scatter its input): by the op's schema name.
PAYLOAD_ARGUMENTS = ("tensors", "input_tensors", "input", "inputs", "input_tensor", "tensor")


def join_fake_world(rank: int, world_size: int) -> None:
    """This process as `rank` of a fake process group of `world_size`: every collective returns at
    once, nothing is sent (Lightning then skips its own init_process_group)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@contextlib.contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """The mode a rehearsal runs in: tensors made inside are fake; real ones (a batch read from a
    file) are taken in as they come. Compiled code runs eagerly (torch.compile cannot compile
    over fake tensors of another mode)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.compiler.set_stance("force_eager"):
        yield mode


def rehearsing() -> bool:
    """Whether fake tensors are on (the hooks below do nothing otherwise). The strategies' object
    broadcasts then hand every rank its own object: the fake group carries no data, and what
    Lightning broadcasts (a directory's name, a checkpoint's path) is the same on every rank."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def real_tensors() -> contextlib.AbstractContextManager:
    """Fake tensors off for a while: device meshes (their creation runs a data-dependent op), the
    model's construction, reading the batch. A no-op outside a rehearsal."""
    return unset_fake_temporarily()


def as_fake(tree: Any) -> Any:
    """`tree` (a batch read on real tensors) with its real tensors made fake tensors of the running
    rehearsal, as the step's own are: the memory tracker then counts the batch as it did when the
    data module's setup made its data on fake tensors."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return tree_map_only(torch.Tensor, mode.from_tensor, tree)


@contextlib.contextmanager
def on_meta_while_fake() -> Iterator[None]:
    """Build the model on the meta device outside fake mode when rehearsing: a module made inside
    holds fake parameters that cannot be moved (fake mode keeps weak references to them)."""
    if not rehearsing():
        yield
        return
    with real_tensors(), torch.device("meta"):
        yield


def to_device(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)`; a meta model (a rehearsal's) gets fresh, empty tensors there instead,
    and stays there: Lightning's later moves of it (to the strategy's device at setup, to the CPU
    at teardown) are no-ops, since torch swaps a fake parameter for its moved copy and refuses
    once fake mode has seen it (a weak reference), and one fake device stands for all."""
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        # to_empty gives each module its own copy of a shared parameter: tie them again (a head
        # tied to the token embedding is one parameter in a run, sharded and gathered once).
        first: Dict[int, str] = {}
        ties = []
        for name, parameter in module.named_parameters(remove_duplicate=False):
            if id(parameter) in first:
                ties.append((name, first[id(parameter)]))
            first.setdefault(id(parameter), name)
        module.to_empty(device=device)
        for name, original in ties:
            owner, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(owner), attribute, module.get_parameter(original))
        module._apply = lambda fn, recurse=True: module
    else:
        module.to(device)


# --------------------------------------------------------------------------- DDP


class CompletedWork(TorchDispatchMode):
    """The fake process group's asynchronous collectives made to complete with their tensors, as a
    real backend's do: its works' futures hold no value, and DDP communication hooks (fp16, DGC,
    post-local SGD) read theirs (`fut.value()[0]`)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and isinstance(out, tuple) and len(out) == 2 \
                and isinstance(out[1], torch.ScriptObject):  # (tensors, work)
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(out[0])
            return out[0], _create_work_from_future(future).boxed()
        return out


class Bucket:
    """What a DDP communication hook reads of torch's GradBucket."""

    def __init__(self, index: int, buffer: torch.Tensor, parameters: List[torch.Tensor], last: bool) -> None:
        self._index, self._buffer, self._parameters, self._last = index, buffer, parameters, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> List[torch.Tensor]:
        return self._parameters

    def gradients(self) -> List[torch.Tensor]:
        return [p.grad for p in self._parameters]

    def is_last(self) -> bool:
        return self._last


def data_parallel(module: nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """DistributedDataParallel(module, **kwargs), a RehearsedDDP in a rehearsal."""
    return (RehearsedDDP if rehearsing() else DistributedDataParallel)(module, **kwargs)


class _NoReducer:
    """What callers of DDP's reducer ask of it before a synchronised backward: nothing to do here."""

    def _rebuild_buckets(self) -> bool:
        return False

    def prepare_for_backward(self, outputs: Any) -> None:
        pass


class RehearsedDDP(DistributedDataParallel):
    """DistributedDataParallel as a rehearsal runs it (DDP's C++ reducer cannot run on fake
    tensors): the same buckets, assigned by torch's own functions with DDP's limits (torch 2.14:
    every parameter in one bucket until the rebuild, unless it looks for unused parameters; rebuilt
    once after the first synchronised backward in the order it made the gradients, each bucket
    closed once it holds its limit, the first's 1 MB only where `bucket_cap_mb` is not given; a
    flat buffer each: a second copy of the gradients, which
    `MemoryTracking` counts as temporaries, as a real DDP's reducer makes them in the step; under
    `gradient_as_bucket_view` the gradients themselves, each copied in as autograd makes it, as
    DDP's reducer does), reduced once a
    synchronised backward has made the gradients, each through the registered communication hook
    (DDP's all-reduce of the average by default). DDP overlaps them with backward; the bytes and
    collectives are the same. A DDP to whoever asks (Lightning's strategy, the pipeline's stages:
    `no_sync` and the reducer's calls before a synchronised backward), built without DDP's own setup."""

    def __init__(self, module: nn.Module, bucket_cap_mb: Optional[float] = None, gradient_as_bucket_view: bool = False,
                 process_group: Any = None, find_unused_parameters: bool = False, **_: Any) -> None:
        nn.Module.__init__(self)
        self.module = module
        self.process_group = process_group
        self.require_backward_grad_sync = True
        self.static_graph = False
        self.find_unused_parameters = find_unused_parameters
        self.reducer = _NoReducer()
        self.hook_state: Any = process_group
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.hook: Any = allreduce_hook
        self.views = gradient_as_bucket_view
        self.capacity = _BucketCapacityConfig.create(bucket_cap_mb, None, use_python_reducer=False)
        self.trained = [p for p in module.parameters() if p.requires_grad]
        limits, _ = self.capacity.compute_bucket_size_limits(static_graph=False,
                                                             find_unused_parameters=find_unused_parameters)
        indices, _ = _compute_bucket_assignment_by_size(self.trained, limits)
        self._assign(list(reversed(indices)))
        for parameter in self.trained:
            parameter.register_post_accumulate_grad_hook(self._gradient_ready)
        self._queued = False
        # DDP rebuilds its buckets once, in the order the first synchronised backward made the
        # gradients (not when it looks for unused parameters): recorded until then.
        self._ready: Optional[List[nn.Parameter]] = None if find_unused_parameters else []

    def _assign(self, indices: List[List[int]]) -> None:
        """Buckets of the trained parameters at `indices` (torch's assignment); a flat buffer each;
        gradients already made copied into theirs under views."""
        self.buckets: List[List[nn.Parameter]] = [[self.trained[i] for i in bucket] for bucket in indices]
        self.flats: List[torch.Tensor] = []  # the buckets (under gradient_as_bucket_view: the gradients)
        self.slots: Dict[int, Tuple[int, int]] = {}  # a parameter's id -> (its bucket, its offset there)
        for index, parameters in enumerate(self.buckets):
            self.flats.append(torch.empty(sum(p.numel() for p in parameters), dtype=parameters[0].dtype,
                                          device=parameters[0].device))
            offset = 0
            for parameter in parameters:
                self.slots[id(parameter)] = (index, offset)
                offset += parameter.numel()
                if self.views and parameter.grad is not None:
                    parameter.grad = self._view(parameter).copy_(parameter.grad)

    def _view(self, parameter: nn.Parameter) -> torch.Tensor:
        index, offset = self.slots[id(parameter)]
        return self.flats[index][offset:offset + parameter.numel()].view_as(parameter)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        self.hook_state, self.hook = state, hook

    def _get_ddp_logging_data(self) -> Dict[str, Any]:
        return {}

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        if self.views and parameter.grad is not None:  # autograd's own gradient lives only until here
            view = self._view(parameter)
            if parameter.grad.data_ptr() != view.data_ptr():
                parameter.grad = view.copy_(parameter.grad)
        if self.require_backward_grad_sync and self._ready is not None:
            self._ready.append(parameter)
        if self.require_backward_grad_sync and not self._queued:  # once per backward, at its end
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self) -> None:
        self._queued = False
        with CompletedWork():
            for index, parameters in enumerate(self.buckets):
                flat = self.flats[index]
                offset = 0
                for parameter in parameters:
                    size = parameter.numel()
                    if parameter.grad is not None and not self.views:  # views: the bucket holds them
                        flat[offset:offset + size].copy_(parameter.grad.reshape(-1))
                    offset += size
                reduced = self.hook(self.hook_state, Bucket(index, flat, parameters, index == len(self.buckets) - 1))
                flat = reduced.wait()
                offset = 0
                for parameter in parameters:
                    if parameter.grad is not None:
                        view = flat[offset:offset + parameter.numel()].view_as(parameter)
                        parameter.grad = view if self.views else parameter.grad.copy_(view)
                    offset += parameter.numel()
        # DDP's rebuild, once (before its next forward; here still in the step before it, so the
        # new buffers exist before a tracker): a hook keeping state by bucket (DGC) meets the new
        # layout in the next step, holding both for a moment.
        if self._ready is not None:
            if len(self._ready) == len(self.slots):  # as the reducer's rebuild_buckets
                limits = [self.capacity.first_bucket_bytes_cap, self.capacity.bucket_bytes_cap]
                position = {id(p): i for i, p in enumerate(self.trained)}
                indices, _ = _compute_bucket_assignment_by_size(
                    self._ready, limits, [False] * len(self._ready), [position[id(p)] for p in self._ready])
                self._assign(indices)
            self._ready = None


# --------------------------------------------------------------------------- memory


MEMORY_PARTS = {  # the report's part -> MemTracker's categories
    "parameters": ("Parameter",),
    "gradients": ("Gradient",),
    "optimizer_states": ("Optstate",),
    "activations": ("Activation",),
    "temporaries": ("Temp", "Other"),
    "buffers": ("Buffer",),
}


class _RunningModulesTracker(MemTracker):
    """torch's MemTracker, its per-op update of the running modules' peaks made to look only at them:
    torch's walks every module it has seen (by weak reference) at every op, so a step costs modules
    x ops (16 blocks of a 70B spent 30 s of a 61 s step in it; 80, most of 12 minutes). The
    running modules are its `parents`, by name; their statistics are kept by name as its forward
    hook makes them. The snapshots, and so every figure, are torch's."""

    def __init__(self) -> None:
        super().__init__()
        self._named: Dict[str, Dict[nn.Module, Any]] = defaultdict(dict)  # name -> {module: its statistics}
        self.after_op: Optional[Any] = None  # called with the current snapshot after every op it counts

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        super()._pre_fw_hook(module, inputs)
        statistics = self.memory_tracking[module]
        self._named[statistics.mod_fqn][module] = statistics

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
        """torch's, without its hook on each parameter's incoming gradient, which tags the gradient
        as one before autograd accumulates it: under accumulation a micro-batch's incoming gradient
        is a temporary added into the one the parameter holds (its post-accumulate hook, kept, tags
        what the parameter then holds)."""
        found = super()._track_module_params_and_buffers(module, install_grad_hooks)
        for parameter in module.parameters():
            if parameter in self._param_to_grad_hook_handles:  # removing twice is harmless: the exit does
                self._param_to_grad_hook_handles[parameter][0].remove()
        return found

    def _update_peak_stats(self, peak_state: Any) -> None:
        seen = self.memory_tracking
        self.memory_tracking = {module: statistics for name in self._mod_tracker.parents
                                for module, statistics in self._named.get(name, {}).items()}
        try:
            super()._update_peak_stats(peak_state)
        finally:
            self.memory_tracking = seen
        if self.after_op is not None:
            self.after_op(self._curr_mem_snap)


class MemoryTracking:
    """torch's MemTracker over a `with` block: every tensor's bytes by the parts docs/rehearse.md
    defines (parameters, FSDP2's gathered ones included; gradients; optimizer states; activations;
    temporaries; buffers). What exists already (parameters, gradients, optimizer states; a
    ZeroRedundancyOptimizer's are its local optimizer's; DDP's buckets) is counted from the start.
    Not FSDPMemTracker: it changes what FSDP2 does for a unit of several modules (a gather per
    module instead of one per unit, torch 2.14). The tracker refuses a module's second forward in
    one iteration, which micro-batches make (accumulation, a pipeline's schedule): each forward
    outside backward starts its module's statistics afresh, folded into each part's peak first.

    MemTracker tags a tensor by when it was made; the parts are what a tensor is: a module's
    parameters are parameters whenever it runs (FSDP2 gathers them in its unit's pre-forward, and
    again for recompute's rebuild inside backward, where MemTracker would call them activations);
    the optimizer's states are what it holds from step to step (MemTracker tags all its step makes
    as state: the step's intermediates are temporaries here); DDP's buckets are temporaries, as a
    real DDP's reducer makes them in the step (not the modules' buffers); what a recomputed block's
    forward makes inside it is temporaries (autograd keeps none of it). Each part's peak is taken
    after every op (MemTracker keeps snapshots at modules' hooks and at the step's peak only)."""

    def __init__(self, model: nn.Module, optimizers: List[torch.optim.Optimizer], stages: Sequence[Any] = ()) -> None:
        self.model = model
        self.stage_modules = [stage.submod for stage in stages]  # a pipeline's traced copies, which the step runs
        self.tracker = _RunningModulesTracker()
        self.tracker.track_external(model, *(getattr(optimizer, "optim", optimizer) for optimizer in optimizers))
        # DDP's buckets and what its communication hook keeps between steps (DGC's momentum and
        # residual), a pipeline stage's buffers for the gradients it receives, made before the
        # tracker: "Other", temporaries; its buffers for the activations it receives are its inputs,
        # which its forward saves: activations.
        held = [t for module in model.modules() if isinstance(module, RehearsedDDP)
                for t in (*(module.flats if not module.views else ()), *held_tensors(module.hook_state))]
        held += [t for stage in stages for t in receive_buffers(stage, gradients=True)]
        self.tracker.track_external(*(t for t in held if self.tracker._WINFO.get(t.untyped_storage()) is None))
        for tensor in (t for stage in stages for t in receive_buffers(stage, gradients=False)):
            self.tracker._update_and_maybe_create_winfos(tensor, _MemRefType.ACT)
        self._state = self._categories(self.tracker.get_tracker_snapshot())["optimizer_states"]  # kept between steps
        self._stack = contextlib.ExitStack()
        self._peaks: Dict[str, int] = dict.fromkeys(MEMORY_PARTS, 0)  # each part's most, over the snapshots
        self._gather: Optional[AfterEachOp] = None  # on while FSDP2 gathers a unit
        self._unit_inputs: set = set()  # the unit's inputs' storages
        self._transient: List[AfterEachOp] = []  # on while a recomputed block runs its forward
        self.tracker.after_op = lambda snapshot: self._fold([[snapshot]])

    def _fold(self, snapshot_lists: Any) -> None:
        """Each part's peak over the tracker's snapshots (after every op, at modules' hooks)."""
        for snapshots in snapshot_lists:
            for snapshot in snapshots:
                parts = self._categories(snapshot)
                made_in_step = max(0, parts["optimizer_states"] - self._state)  # the optimizer's intermediates
                parts["optimizer_states"] -= made_in_step
                parts["temporaries"] += made_in_step
                for part in MEMORY_PARTS:
                    self._peaks[part] = max(self._peaks[part], parts[part])

    @staticmethod
    def _categories(snapshot: Dict[Any, Dict[Any, int]]) -> Dict[str, int]:
        by_category: Dict[str, int] = defaultdict(int)
        for per_device in snapshot.values():
            for category, size in per_device.items():
                by_category[getattr(category, "value", category)] += size
        return {part: sum(by_category.get(name, 0) for name in names) for part, names in MEMORY_PARTS.items()}

    def _afresh(self, module: nn.Module, args: Any) -> None:
        self._parameters(module.parameters(recurse=False))
        if not self.tracker._mod_tracker.is_bw and module in self.tracker.memory_tracking:
            self._fold(self.tracker.memory_tracking.pop(module).snapshots.values())

    def _parameters(self, parameters: Iterator[torch.Tensor]) -> None:
        for parameter in parameters:
            self.tracker._update_and_maybe_create_winfos(parameter, _MemRefType.PARAM)

    @contextlib.contextmanager
    def on_real_tensors(self) -> Iterator[None]:
        """Counts what runs with fake tensors off (`real_tensors`) too: the strategies' callbacks,
        which read a real loss and step the fake parameters as an optimizer does (local SGD's
        averaging; MemTracker counts only ops under the fake mode it started in). What they make is
        tagged as an optimizer step's (temporaries, beyond the state) until it becomes a parameter:
        the averaging makes each parameter, one after another, a view of one new flat buffer,
        which is then parameters beside the old ones not yet replaced; so after each op the
        parameters are tagged again and the parts taken."""
        entry, self.tracker._fake_mode_on_entry = self.tracker._fake_mode_on_entry, None
        self.tracker._in_opt = True
        try:
            with AfterEachOp(self._after_op):
                yield
        finally:
            self.tracker._fake_mode_on_entry, self.tracker._in_opt = entry, False
            self._parameters(self.model.parameters())

    def _after_op(self, *_: Any) -> None:
        self._parameters(self.model.parameters())
        self._fold([[self.tracker.get_tracker_snapshot()]])

    def _gathering(self, module: nn.Module, args: Any) -> None:
        """Before FSDP2 gathers a unit (its pre-forward): what it makes from here on is watched,
        but what it makes of the module's inputs (their casts to the unit's dtype: activations)."""
        self._unit_inputs = storage_ids(args)
        self._gather = AfterEachOp(self._made, around=self._gather_op)
        self._gather.__enter__()

    @contextlib.contextmanager
    def _as_intermediates(self, on: bool) -> Iterator[None]:
        """With `on`, what the tracker tags inside (new tensors, and buffers written in place that it
        first sees there) tagged as an optimizer step's intermediates, which `_fold` counts as
        temporaries, while the tracker takes its modules' peaks (MemTracker would call them
        activations, made in a forward); `_temporaries` then tags them temporaries for good."""
        entry = self.tracker._in_opt
        self.tracker._in_opt = entry or on
        try:
            yield
        finally:
            self.tracker._in_opt = entry

    def _temporaries(self, out: Any) -> None:
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and self._tagged(tensor) == _MemRefType.OPT:
                self.tracker._update_and_maybe_create_winfos(tensor, _MemRefType.TEMP)

    def _gather_op(self, args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
        """One op of the gather, but its casts of the unit's inputs (activations), as intermediates."""
        return self._as_intermediates(not storage_ids((args, kwargs)) & self._unit_inputs)

    def _made(self, args: tuple, kwargs: dict, out: Any) -> None:
        """Each op's tensors tagged in the gather (`_gather_op`): temporaries, its all-gather's
        buffers. FSDP2 copies its gathered parameters into buffers it keeps (at one process the
        shards themselves, no all-gather; a unit of the whole model's parameters would be
        activations until registered), `_gathered_unit` then tags the parameters among them."""
        if not storage_ids((args, kwargs)) & self._unit_inputs:
            self._temporaries(out)

    def _tagged(self, tensor: torch.Tensor) -> Optional[_MemRefType]:
        winfo, _ = self.tracker._WINFO.get(tensor.untyped_storage(), (None, None))
        return getattr(winfo, "reftype", None)

    def _checkpointed(self, module: nn.Module, args: Any) -> None:
        """A recomputed block's forward (not its rebuild in backward, MemTracker's AC region, whose
        tensors are activations): autograd keeps nothing of what it makes, so what it makes are
        temporaries (MemTracker calls them activations, made in a forward) until it returns."""
        if torch._C._current_graph_task_id() == -1:  # not in backward (autograd's word: a pipeline runs its own)
            self._transient.append(AfterEachOp(lambda args, kwargs, out: self._temporaries(out),
                                               around=lambda args, kwargs: self._as_intermediates(True)))
            self._transient[-1].__enter__()

    def _checkpointed_done(self, module: nn.Module, args: Any, output: Any) -> None:
        """Its outputs are kept: the next block's inputs, which checkpoint keeps for the rebuild."""
        if torch._C._current_graph_task_id() == -1 and self._transient:
            self._transient.pop().__exit__(None, None, None)
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and self._tagged(tensor) == _MemRefType.TEMP:
                    self.tracker._update_and_maybe_create_winfos(tensor, _MemRefType.ACT)
            self._fold([[self.tracker.get_tracker_snapshot()]])

    def _gathered_unit(self, module: nn.Module, args: Any) -> None:
        """After FSDP2 gathered a unit: its all-gather's buffers stay temporaries (MemTracker calls
        them activations, made in a forward), the gathered parameters are parameters."""
        self._gather.__exit__(None, None, None)
        self._parameters(self.model.parameters())

    def __enter__(self) -> "MemoryTracking":
        from torch.distributed.fsdp import FSDPModule

        # Registered before the tracker's own global hooks, so it runs first.
        self._stack.callback(nn.modules.module.register_module_forward_pre_hook(self._afresh).remove)
        for module in self.model.modules():  # around FSDP2's own hook, which gathers the unit's modules at once
            if isinstance(module, FSDPModule):
                self._stack.callback(module.register_forward_pre_hook(self._gathering, prepend=True).remove)
                self._stack.callback(module.register_forward_pre_hook(self._gathered_unit).remove)
        for module in (m for root in (self.model, *self.stage_modules) for m in root.modules()):
            if hasattr(module, "_checkpoint_wrapped_module"):  # recompute's wrapper
                self._stack.callback(module.register_forward_pre_hook(self._checkpointed).remove)
                self._stack.callback(module.register_forward_hook(self._checkpointed_done).remove)
        self._stack.enter_context(self.tracker)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self._fold(snapshots for stats in self.tracker.memory_tracking.values()
                   for snapshots in stats.snapshots.values())
        self._fold([[self.tracker.get_tracker_snapshot("peak"), self.tracker.get_tracker_snapshot()]])

    def peak(self) -> int:
        return sum(per_device["Total"] for per_device in self.tracker.get_tracker_snapshot("peak").values())

    def parts(self) -> Dict[str, int]:
        """Each part's peak over the block (bytes, all devices), and the peak of their sum."""
        return {**self._peaks, "step_peak": self.peak()}


def held_tensors(state: Any, depth: int = 3) -> List[torch.Tensor]:
    """The tensors an object keeps in its attributes, dicts and lists, `depth` levels down (a
    communication hook's state)."""
    if isinstance(state, torch.Tensor):
        return [state]
    if depth == 0 or isinstance(state, (str, bytes, int, float, bool, type(None), dist.ProcessGroup)):
        return []
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) \
        else vars(state).values() if hasattr(state, "__dict__") else ()
    return [t for item in items for t in held_tensors(item, depth - 1)]


def receive_buffers(stage: Any, gradients: bool) -> List[torch.Tensor]:
    """A pipeline stage's buffers for what it receives, one per micro-batch, kept from step to step
    (torch's PipelineStage): the activations its forward takes, or (`gradients`) the gradients of
    its outputs its backward takes."""
    chunks = (stage.grad_recv_info if gradients else stage.args_recv_info).values()
    buffers = [getattr(info, "buffer", None) for chunk in chunks for info in chunk]
    return [buffer for buffer in buffers if isinstance(buffer, torch.Tensor)]


def storage_ids(tree: Any) -> set:
    """The storages behind a tree's tensors, by their C++ address (a storage's Python object may be
    made afresh at each call, and its id reused)."""
    return {t.untyped_storage()._cdata for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


def gathered_parameters(model: nn.Module) -> List[torch.Tensor]:
    """FSDP2's gathered (unsharded) parameters, whether registered on their modules or not: in a
    unit's pre-forward and pre-backward FSDP2 fills them before it registers them, and a tracker
    reading only the modules' parameters would take them for what autograd saved of the last
    forward (bench/auto_memory.py's PeakMemory)."""
    from torch.distributed.fsdp import FSDPModule

    groups = {id(group): group for module in model.modules() if isinstance(module, FSDPModule)
              for group in [module._get_fsdp_state()._fsdp_param_group] if group is not None}
    return [fsdp_param._unsharded_param for group in groups.values() for fsdp_param in group.fsdp_params
            if hasattr(fsdp_param, "_unsharded_param")]


class AfterEachOp(TorchDispatchMode):
    """Calls `then(args, kwargs, out)` after every op while on (inside the memory tracker: it has
    counted the op), the op run inside `around(args, kwargs)` (a context manager) if given; a
    DTensor's op as the local ops it turns into, as the tracker sees them."""

    def __init__(self, then: Any, around: Any = None) -> None:
        super().__init__()
        self.then = then
        self.around = around or (lambda args, kwargs: contextlib.nullcontext())  # around each op

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            return NotImplemented
        with self.around(args, kwargs):
            out = func(*args, **kwargs)
        self.then(args, kwargs, out)
        return out


def zero_shares(optimizer: Any) -> List[int]:
    """The parameter bytes of each rank's share of a ZeroRedundancyOptimizer's partition (whole
    tensors; every rank knows the whole partition), in the order of its group's ranks."""
    return [sum(p.numel() * p.element_size() for group in groups for p in group["params"])
            for groups in optimizer._partition_parameters()]


def host_shard_bytes(model: nn.Module) -> int:
    """Bytes of the parameter shards FSDP2 keeps in host memory (its CPU offload; 0 without):
    read off FSDP2's parameter groups, which say where their shards live."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    groups = {id(group): group for module in model.modules() if isinstance(module, FSDPModule)
              for group in [module._get_fsdp_state()._fsdp_param_group]}  # a unit's modules share one
    return sum(fsdp_param.sharded_param._local_tensor.nbytes for group in groups.values()
               if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)
               for fsdp_param in group.fsdp_params)


# --------------------------------------------------------------------------- what a step does


class StepCounter(TorchDispatchMode):
    """Counts, while on, every op of this rank: the payload bytes of each collective by (op, group),
    FLOPs by dtype (torch's FLOP formulas), and the bytes ops read and write (views move none).
    It sees every collective of the fake world: the c10d ops under torch.distributed's calls
    (DDP, ZeroRedundancyOptimizer, FSDP2, pipeline send/recv) and the functional collectives
    (DTensor, tensor parallel), whichever strategy makes them."""

    def __init__(self, ranks_per_node: int) -> None:
        super().__init__()
        self.ranks_per_node = ranks_per_node
        self.collectives: Dict[Tuple[str, int, int], List[int]] = defaultdict(lambda: [0, 0])  # -> [calls, bytes]
        self.flops: Dict[str, int] = defaultdict(int)
        self.memory_traffic = 0
        self.kernels = 0  # ops that compute (views do not): one kernel launch each, eager
        self.weight = 1  # how many times what runs now counts: micro-batches alike, run once (runner/rank/rehearse.py)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            return NotImplemented  # a DTensor's op: counted as the local ops and collectives it turns into
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("c10d", "_c10d_functional") and name in COLLECTIVES:
            self._collective(func, COLLECTIVES[name], args, kwargs)
        elif func.namespace == "aten" and not func.is_view:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.memory_traffic += self.weight * sum(t.numel() * t.element_size() for t in tensors)
            self.kernels += self.weight
            if func.overloadpacket in flop_registry:
                dtype = next((t.dtype for t in tensors if t.is_floating_point()), None)
                self.flops[str(dtype).replace("torch.", "")] += self.weight * flop_registry[func.overloadpacket](
                    *args, **kwargs, out_val=out)
        return out

    def _collective(self, func: Any, op: str, args: tuple, kwargs: dict) -> None:
        named = named_arguments(func, args, kwargs)
        group = named.get("process_group", named.get("group_name"))
        group = _resolve_process_group(group) if isinstance(group, str) else dist.ProcessGroup.unbox(group)
        ranks = dist.get_process_group_ranks(group)
        counted = self.collectives[(op, len(ranks), len({rank // self.ranks_per_node for rank in ranks}))]
        counted[0] += self.weight
        counted[1] += self.weight * sum(t.numel() * t.element_size() for t in payload(named))

    def collective_rows(self) -> List[Dict[str, Any]]:
        return [{"op": op, "group_size": size, "nodes": nodes, "calls": calls, "bytes": size_bytes}
                for (op, size, nodes), (calls, size_bytes) in sorted(self.collectives.items())]


def named_arguments(func: Any, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """An op's arguments by their schema names."""
    return {**{argument.name: value for argument, value in zip(func._schema.arguments, args)}, **kwargs}


def payload(named: Dict[str, Any]) -> List[torch.Tensor]:
    """The tensors a collective's rank contributes (PAYLOAD_ARGUMENTS), of its named arguments."""
    found = next(named[key] for key in PAYLOAD_ARGUMENTS if key in named)
    return [t for t in tree_leaves(found) if isinstance(t, torch.Tensor)]


class GlooCopies(TorchDispatchMode):
    """A CPU run's collectives as gloo holds memory for them (torch 2.14): gloo has no
    reduce-scatter of its own; it reduces a copy of the whole input and keeps this rank's chunk,
    the copy alive while the op runs. The fake group copies nothing: while on, this mode makes that
    copy for each reduce-scatter, inside the memory tracker, so that it is counted (a temporary:
    under ZeRO stages 2 and 3, a unit's whole gradients in the reduce dtype). NCCL reduces in place:
    a rehearsal for a GPU leaves it off."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        copies = None
        if func.namespace in ("c10d", "_c10d_functional") \
                and COLLECTIVES.get(func._schema.name.split("::")[-1]) == "reduce_scatter":
            copies = [t.clone() for t in payload(named_arguments(func, args, kwargs))]
        out = func(*args, **kwargs)
        del copies
        return out


# --------------------------------------------------------------------------- a CUDA device's rules


# CUDA autocast's float32 list, where the CPU's differs (torch's autocast_mode.cpp: CUDA's fp32
# ops; the CPU keeps these in bfloat16): a model planned for a GPU on a CPU must follow CUDA's.
CUDA_FLOAT32 = {F.softmax, F.log_softmax, F.layer_norm, F.group_norm, torch.softmax, torch.log_softmax,
                torch.pow, torch.Tensor.pow, torch.exp, torch.log, torch.rsqrt, torch.Tensor.softmax,
                torch.Tensor.log_softmax}


class CudaRulesOnCpu(TorchFunctionMode):
    """CPU fake tensors computing as a GPU would (fake CUDA tensors cannot carry a whole build on a
    machine without one: FSDP2 asks CUDA for its current device, autograd for its streams):
    scaled-dot-product attention as the fused kernel a GPU runs, keeping no sequence x sequence
    matrix (plugins/auto.py's `fused_attention`), and under autocast CUDA's float32 ops in float32."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        from plugins.auto import fused_attention

        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            return self.backward(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return fused_attention(*args, **kwargs)
        if func in CUDA_FLOAT32 and torch.is_autocast_enabled("cpu"):
            as_float = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            with torch.autocast("cpu", enabled=False):
                return func(*as_float, **kwargs)
        return func(*args, **kwargs)

    def backward(self, tensor: torch.Tensor, gradient: Optional[torch.Tensor] = None, retain_graph: Optional[bool] = None,
                 create_graph: bool = False, inputs: Any = None) -> None:
        """`tensor.backward()` under these rules: recompute's forward runs inside the backward and
        must save what the forward saved. (This mode is off while it handles a call, and
        torch.autograd.backward would hand the call to it again: the engine is called directly.)"""
        gradient = torch.ones_like(tensor) if gradient is None else gradient
        with self:
            torch.autograd.Variable._execution_engine.run_backward(
                (tensor,), (gradient,), create_graph if retain_graph is None else retain_graph, create_graph,
                tuple(inputs or ()), allow_unreachable=True, accumulate_grad=True)
