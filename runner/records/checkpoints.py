"""Checkpoints written whole or not at all, and verified before they are used.

A checkpoint file is written to a temporary name in its own directory and fsynced, its manifest,
`<name>.manifest.json` beside it (the file's size and sha256, the step), to another; both are
renamed into place in that order (`os.replace`: atomic within one directory on a local POSIX
filesystem and NFS) and the directory fsynced once for both (`save`): the manifest is the commit
point. Two fsyncs: the manifest's bytes are not fsynced, so a machine crash may lose them, and an
unreadable manifest reads as none (the checkpoint, on the disk, loads unverified), never as a wrong
one. Journaling filesystems and NFS keep the two renames in order; where a crash kept the
manifest's and lost the file's, `verify` finds the old bytes and the checkpoint is refused, never
trusted. A file with the very bytes of the one this process wrote just before (Lightning's top-k
checkpoint and last.ckpt at one validation) is made a hard link of it: nothing written twice, and
removing either name leaves the other whole. A checkpoint directory (torch's distributed
checkpoint: sharding stages 2/3, the pipeline) is written whole into a temporary directory beside
it, then renamed into place (`commit_directory`; plugins/directory_checkpoint.py), then its
manifest. A reader verifies the bytes against the manifest (`verify`); a checkpoint without one
was not written by lightfleet and is only read as it is. runner/rank/checkpoint_io.py writes files
through here; the command's preflight verifies.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

from runner.core.world import alive
from runner.records.files import LAST_CHECKPOINT

MANIFEST_SUFFIX = ".manifest.json"
_TMP_SUFFIX = ".lightfleet-tmp"  # removed at the next start (remove_leftovers)
_OLD_SUFFIX = ".lightfleet-old"  # a directory replaced, until its successor is in place
_CHUNK = 1 << 20
_HASHED_ALONGSIDE_FROM = 16 << 20  # bytes: below, hashing (~0.5 ms a MB) costs a thread's start or little more


class CheckpointNotWritten(Exception):
    """A checkpoint that could not be written (a full disk): its message is the run's one line,
    with no traceback (the log may be on the same full disk)."""


@dataclass(frozen=True)
class Written:
    """A checkpoint file `save` wrote: the next save of the same bytes links to it."""

    path: Path
    step: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Verdict:
    """What `verify` found: `problem` None when the bytes are the manifest's (or there is no manifest)."""

    manifest: Optional[dict]
    problem: Optional[str] = None


def manifest_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + MANIFEST_SUFFIX)


def temporary(path: Path, suffix: str = _TMP_SUFFIX) -> Path:
    """Where `path` is written before it is renamed into place, named by its writer (remove_leftovers)."""
    return path.with_name(f".{path.name}~{socket.gethostname()}~{os.getpid()}{suffix}")


def write_atomically(path: Path, data: bytes) -> None:
    """`data` into `path`, whole or not at all: nothing under `path`'s name changes unless all of
    it reached the disk; a failed write removes its temporary file."""
    tmp = temporary(path)
    try:
        write_durably(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # the rename itself survives a crash of the machine


def write_durably(path: Path, data: bytes) -> None:
    """`data` into a new file `path`, on the disk when this returns (flushed and fsynced)."""
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save(path: Path, data: bytes, step: int, previous: Optional[Written] = None) -> Written:
    """A checkpoint's bytes at `path`, then its manifest, the commit point; a hard link of
    `previous` (the file this process wrote last) where the bytes are the same. The previous
    manifest goes first: a crash before the new one is in place leaves a file without one, read as
    unverified, never a manifest that does not match its file. Two fsyncs: the file's bytes (none
    for a link: they are on the disk already) and the directory, for both renames."""
    manifest_path(path).unlink(missing_ok=True)
    tmp, manifest_tmp = temporary(path), temporary(manifest_path(path))
    try:
        if previous is not None and (previous.step, previous.bytes) == (step, len(data)) and previous.path != path:
            digest = hashlib.sha256(data).hexdigest()  # first: when it matches, nothing is written
            if digest != previous.sha256 or not hard_linked(previous.path, tmp):
                write_durably(tmp, data)
        else:
            digest = written_and_hashed(tmp, data)
        manifest = {"file": path.name, "bytes": len(data), "sha256": digest, "step": step}
        manifest_tmp.write_text(json.dumps(manifest, indent=1))  # lost in a crash, it reads as none
        os.replace(tmp, path)
        os.replace(manifest_tmp, manifest_path(path))
    except BaseException:
        tmp.unlink(missing_ok=True)
        manifest_tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # both renames survive a crash of the machine
    return Written(path, step, len(data), digest)


def written_and_hashed(path: Path, data: bytes) -> str:
    """`data` written durably into the new file `path`; its sha256, taken while the bytes are
    written (both free the GIL) where there are enough of them to pay for a thread (~0.1 ms)."""
    if len(data) < _HASHED_ALONGSIDE_FROM:
        write_durably(path, data)
        return hashlib.sha256(data).hexdigest()
    with ThreadPoolExecutor(1) as hasher:
        hashing = hasher.submit(lambda: hashlib.sha256(data).hexdigest())
        write_durably(path, data)
    return hashing.result()


def hard_linked(source: Path, link: Path) -> bool:
    """Whether `link` could be made a hard link of `source`: not where the file is gone or the
    filesystem has no hard links (the caller then writes the bytes). A full disk is raised."""
    try:
        os.link(source, link)
    except OSError as error:
        if is_full_disk(error):
            raise
        return False
    return True


def commit_directory(written: Path, path: Path, step: int) -> None:
    """Put the checkpoint directory `written` (whole: every rank wrote its files) in place as
    `path`, then its manifest. A directory cannot replace another in one rename: the old one is
    moved aside first and removed once the new one is in place."""
    files = {str(file.relative_to(written)): {"bytes": file.stat().st_size, "sha256": file_digest(file)}
             for file in sorted(written.rglob("*")) if file.is_file()}
    manifest_path(path).unlink(missing_ok=True)
    aside = temporary(path, _OLD_SUFFIX)
    if path.exists():
        os.replace(path, aside)
    os.replace(written, path)
    fsync_directory(path.parent)
    _remove_path(aside)
    write_atomically(manifest_path(path), json.dumps({"files": files, "step": step}, indent=1).encode())


def remove(path: Path) -> None:
    """A checkpoint and its manifest, the manifest first (see `save`)."""
    manifest_path(path).unlink(missing_ok=True)
    _remove_path(path)


def _remove_path(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def read_manifest(checkpoint: Path) -> Optional[dict]:
    try:
        return json.loads(manifest_path(checkpoint).read_text())
    except (OSError, ValueError):
        return None


def file_digest(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as stored:
        while chunk := stored.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(checkpoint: Path) -> Verdict:
    """Whether a checkpoint (a file, or a directory's files) holds the bytes its manifest says."""
    manifest = read_manifest(checkpoint) if checkpoint.exists() else None
    if manifest is None:
        return Verdict(None)
    expected = manifest["files"] if "files" in manifest else {"": manifest}  # a directory's, or the file's
    for name, wanted in expected.items():
        file = checkpoint / name if name else checkpoint
        if not file.is_file():
            return Verdict(manifest, f"is incomplete: its file {name} is missing")
        size = file.stat().st_size
        if size != wanted["bytes"]:
            return Verdict(manifest, f"is truncated: {f'its file {name} has ' if name else ''}{size:,} bytes of the "
                                     f"{wanted['bytes']:,} its manifest says")
        if file_digest(file) != wanted["sha256"]:
            return Verdict(manifest, f"is damaged: {f'the bytes of its file {name}' if name else 'its bytes'} differ "
                                     f"from those its manifest's sha256 was taken of")
    return Verdict(manifest)


def intact(directory: Path) -> Iterator[Path]:
    """The verified checkpoints in `directory` (those with a manifest), newest step first."""
    made = [(manifest, path) for path in directory.glob("*.ckpt") if (manifest := read_manifest(path)) is not None]
    # last.ckpt first among files of one step and time (hard links of each other): the one resume reads
    last = Path(LAST_CHECKPOINT).name
    for _, path in sorted(made, key=lambda item: (item[0]["step"], item[1].stat().st_mtime, item[1].name == last),
                          reverse=True):
        if verify(path).problem is None:
            yield path


def newest_intact(directory: Path, besides: Optional[Path] = None) -> Optional[Path]:
    """The newest intact checkpoint in `directory` other than `besides`."""
    return next((path for path in intact(directory) if path != besides), None)


def remove_leftovers(directory: Path) -> List[Path]:
    """Remove the temporary files and directories of writes a crash interrupted in `directory`
    (this machine's, of processes no longer alive: another's may be writing now)."""
    host = socket.gethostname()
    removed = []
    for tmp in directory.glob(f".*{_TMP_SUFFIX}"):
        _, writer_host, pid = (tmp.name.removesuffix(_TMP_SUFFIX).rsplit("~", 2) + ["", ""])[:3]
        if writer_host == host and pid.isdigit() and not alive(int(pid)):
            _remove_path(tmp)
            removed.append(tmp)
    return removed


def full_disk_line(path: Path, needed: int) -> str:
    """What a full disk stopped: the checkpoint, the space it needed (this process's part of it,
    for a directory every rank writes into), and the checkpoint that stands."""
    free = shutil.disk_usage(path.parent).free
    standing = newest_intact(path.parent)
    stands = (f"the checkpoint that stands is {standing} (step {read_manifest(standing)['step']})"
              if standing else "no checkpoint of this run stands")
    return f"no space left on device for checkpoint {path}: it needs {needed:,} bytes, {free:,} are free; {stands}"


def is_full_disk(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from (torch's distributed checkpoint wraps each rank's), is a full disk."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) or \
                os.strerror(errno.ENOSPC) in str(error):  # torch's CheckpointException holds the ranks' as text
            return True
        error = error.__cause__ or error.__context__
    return False
