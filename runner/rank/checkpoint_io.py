"""lightfleet's CheckpointIO (in every run's plan, `<- lightfleet`): every single-file checkpoint
is written whole or not at all, with its manifest (runner/records/checkpoints.py), and read as
data only. Lightning's own writes through fsspec's transaction, a temporary file in the system
temp directory then a move, which across filesystems is a copy: a full disk leaves a truncated
file under the checkpoint's name. Checkpoint directories (sharding stages 2/3, the pipeline) are
written whole by their strategies (plugins/directory_checkpoint.py).

The disk's part (the write, its fsyncs, the renames, the manifest, the link, retention's removals)
runs in one background thread, in the order it was asked for, off the training step; the bytes are
made on the caller's thread (torch.save into memory), as training changes the tensors in place.
Lightning's AsyncCheckpointIO does not fit: it clones every tensor where it lies (a GPU's memory
twice over, Lightning #21630) to serialise later anyway, removes checkpoints at once while their
writes may still be queued, and goes on queueing writes and removals after one failed. `wait`
(in `teardown`, Lightning's, at fit's end and when an exception leaves fit; before a preemption's
exit; after the last.ckpt saved after fit) waits for every write and raises a failure; so does the
next save, and `raise_failure`, which the preemption callback calls at every step's end: a full
disk stops the run one step after the write that met it.
"""
from __future__ import annotations

import io
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Optional, Set

import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from runner.records import checkpoints

PENDING_AT_MOST = 2  # checkpoints whose bytes wait for the disk: a validation's top-k file and last.ckpt


class AtomicCheckpointIO(TorchCheckpointIO):
    def __init__(self) -> None:
        super().__init__()
        self._cleaned: Set[Path] = set()  # directories whose leftovers are removed already
        self._written: Optional[checkpoints.Written] = None  # the last file saved, which the same bytes link to
        self._writer: Optional[ThreadPoolExecutor] = None  # made at the first save: a forked rank starts without
        self._saves: Deque[Future] = deque()  # saves not known to be done, oldest first
        self._last: Optional[Future] = None  # the last work asked for: one worker, so all before it is done with it
        self._failure: Optional[BaseException] = None  # the first failed work's; nothing after it runs
        self._failure_raised = False

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)  # now: the step after this one changes the tensors
        while self._saves and (self._saves[0].done() or len(self._saves) >= PENDING_AT_MOST):
            self._saves.popleft().result()  # memory for at most PENDING_AT_MOST checkpoints' bytes
        self._saves.append(self._submit(self._save, Path(path), buffer.getbuffer(),
                                        int(checkpoint.get("global_step", -1))))

    @override
    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Data only, whatever the caller asks: a checkpoint's pickle never runs code."""
        self.wait()  # a checkpoint being written is read whole
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """ModelCheckpoint's retention (save_top_k) removes through here, after the writes asked
        before (the newer file is in place first); the manifest goes too."""
        self._submit(checkpoints.remove, Path(path))

    @override
    def teardown(self) -> None:
        """Lightning's, at fit's end and when an exception leaves fit: `wait`, and end the writer."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=False)  # nothing left to wait for
                self._writer = None

    def wait(self) -> None:
        """Wait for every write and removal asked for; raise the failure of one, if not raised yet."""
        if self._last is not None:
            self._last.result()
        self._saves.clear()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise the failure of a write done in the background, once (a full disk: CheckpointNotWritten)."""
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    def _submit(self, work: Callable[..., None], *args: Any) -> Future:
        self.raise_failure()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="lightfleet-checkpoints")
        self._last = self._writer.submit(self._unless_failed, work, *args)
        return self._last

    def _unless_failed(self, work: Callable[..., None], *args: Any) -> None:
        """Run `work` in the writer, unless earlier work failed: after a failed top-k file, neither
        its last.ckpt nor retention's removal of the file before it."""
        if self._failure is not None:
            return
        try:
            work(*args)
        except BaseException as failure:  # noqa: BLE001 (raised on the training thread: raise_failure)
            self._failure = failure

    def _save(self, path: Path, data: memoryview, step: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent not in self._cleaned:  # what a crashed run left there, at this run's first write
            checkpoints.remove_leftovers(path.parent)
            self._cleaned.add(path.parent)
        try:
            self._written = checkpoints.save(path, data, step, self._written)
        except OSError as error:
            if not checkpoints.is_full_disk(error):
                raise
            raise checkpoints.CheckpointNotWritten(checkpoints.full_disk_line(path, data.nbytes)) from error
