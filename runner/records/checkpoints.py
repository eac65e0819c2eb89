"""Checkpoint files written whole or not at all, and verified before they are used.

A checkpoint file is written to a temporary name in its own directory, flushed and fsynced, renamed
into place (`os.replace`: atomic within one directory on a local POSIX filesystem and NFS), and
the directory fsynced. Then its manifest, `<name>.manifest.json` beside it (size, sha256, step),
is written the same way: the manifest is the commit point. A reader verifies the bytes against
it (`verify`); a file without one was not written by lightfleet and is only read as it is.
runner/rank/checkpoint_io.py writes through here; the command's preflight verifies.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

MANIFEST_SUFFIX = ".manifest.json"
_TMP_SUFFIX = ".lightfleet-tmp"
_CHUNK = 1 << 20


class CheckpointNotWritten(Exception):
    """A checkpoint that could not be written (a full disk): its message is the run's one line,
    with no traceback (the log may be on the same full disk)."""


@dataclass(frozen=True)
class Verdict:
    """What `verify` found: `problem` None when the bytes are the manifest's (or there is no manifest)."""

    manifest: Optional[dict]
    problem: Optional[str] = None


def manifest_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + MANIFEST_SUFFIX)


def write_atomically(path: Path, data: bytes) -> None:
    """`data` into `path`, whole or not at all: nothing under `path`'s name changes unless all of
    it reached the disk; a failed write removes its temporary file."""
    tmp = path.with_name(f".{path.name}~{socket.gethostname()}~{os.getpid()}{_TMP_SUFFIX}")  # whose: remove_leftovers
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # the rename itself survives a crash of the machine


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save(path: Path, data: bytes, step: int) -> None:
    """A checkpoint's bytes at `path`, then its manifest, the commit point. The previous manifest
    goes first: a crash between the two leaves a file without one, read as unverified, never a
    manifest that does not match its file."""
    manifest_path(path).unlink(missing_ok=True)
    with ThreadPoolExecutor(1) as hasher:  # the digest while the bytes are written and fsynced: both free the GIL
        digest = hasher.submit(lambda: hashlib.sha256(data).hexdigest())
        write_atomically(path, data)
    manifest = {"file": path.name, "bytes": len(data), "sha256": digest.result(), "step": step}
    write_atomically(manifest_path(path), json.dumps(manifest, indent=1).encode())


def remove(path: Path) -> None:
    """A checkpoint and its manifest, the manifest first (see `save`)."""
    manifest_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def read_manifest(checkpoint: Path) -> Optional[dict]:
    try:
        return json.loads(manifest_path(checkpoint).read_text())
    except (OSError, ValueError):
        return None


def verify(checkpoint: Path) -> Verdict:
    """Whether a checkpoint file holds the bytes its manifest says (a directory: not verified yet)."""
    manifest = read_manifest(checkpoint) if checkpoint.is_file() else None
    if manifest is None:
        return Verdict(None)
    size = checkpoint.stat().st_size
    if size != manifest["bytes"]:
        return Verdict(manifest, f"is truncated: {size:,} bytes of the {manifest['bytes']:,} its manifest says")
    digest = hashlib.sha256()
    with open(checkpoint, "rb") as stored:
        while chunk := stored.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != manifest["sha256"]:
        return Verdict(manifest, "is damaged: its bytes differ from those its manifest's sha256 was taken of")
    return Verdict(manifest)


def intact(directory: Path) -> Iterator[Path]:
    """The verified checkpoints in `directory` (those with a manifest), newest step first."""
    made = [(manifest, path) for path in directory.glob("*.ckpt")
            if path.is_file() and (manifest := read_manifest(path)) is not None]
    for _, path in sorted(made, key=lambda item: (item[0]["step"], item[1].stat().st_mtime), reverse=True):
        if verify(path).problem is None:
            yield path


def newest_intact(directory: Path, besides: Optional[Path] = None) -> Optional[Path]:
    """The newest intact checkpoint in `directory` other than `besides`."""
    return next((path for path in intact(directory) if path != besides), None)


def remove_leftovers(directory: Path) -> List[Path]:
    """Remove the temporary files of writes a crash interrupted in `directory` (this machine's, of
    processes no longer alive: another's may be writing now)."""
    host = socket.gethostname()
    removed = []
    for tmp in directory.glob(f".*{_TMP_SUFFIX}"):
        _, writer_host, pid = (tmp.name.removesuffix(_TMP_SUFFIX).rsplit("~", 2) + ["", ""])[:3]
        if writer_host == host and pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True
