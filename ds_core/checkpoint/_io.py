"""Atomic, verified checkpoint files: temporary folders, fsync, rename, manifest, safe loads.

[Note: atomic publication]
A checkpoint is written into ``<save_dir>/.<tag>.partial/``; every file is fsynced as it is
closed, then the manifest (each file's size and SHA-256) is written and fsynced, then the
folder is fsynced and renamed to ``<save_dir>/<tag>/``, and the parent folder fsynced. Only
after that does ``latest`` move, itself written to ``latest.tmp``, fsynced and renamed. A
process killed at any point leaves either the old ``<tag>`` (or none) and the old ``latest``,
never a half-written folder under a real tag: a ``.partial`` folder is ignored by loads and
removed by the next save. Replacing an existing tag renames the old folder to
``.<tag>.replaced`` first; a load that finds no ``<tag>`` but that folder uses it.

[Note: a failed write]
A write refused by the file system (full, over quota, read-only, not permitted, over the file
size limit: :data:`ds_core.faults.DISK_ERRNOS`) raises :class:`DiskWriteError` naming the file,
the errno's meaning, the bytes that file needed (its tensors' bytes) and the free space there;
the half-written file is removed at once, and the save that called the writer removes its
``.partial`` folder (``latest`` was never touched: it moves only after the rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from ds_core.errors import DSCoreError
from ds_core.faults import DISK_ERRNOS

MANIFEST = "manifest.json"
META = "meta.pt"
LATEST = "latest"
FORMAT_VERSION = 1
_CHUNK = 1 << 20
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")


class CheckpointError(DSCoreError):
    """A checkpoint cannot be written or read; the message names the file and the problem."""


class DiskWriteError(CheckpointError, OSError):
    """A checkpoint or export file could not be written for lack of space, quota or permission
    (see [Note: a failed write]).

    :ivar path: the file that failed.
    :ivar needed: bytes of tensor data the failed write (or, once a save adds it, that rank's
        whole part of the save) had to store.
    :ivar errno: the file system's error number (``ENOSPC``, ``EDQUOT``, ``EROFS``, ...).
    """

    def __init__(self, path: Path, code: int, needed: int, message: str) -> None:
        self.path = path
        self.needed = needed
        super().__init__(message)
        self.errno = code


def mib(n: int) -> str:
    """``n`` bytes, also in MiB, for messages."""
    return f"{n} bytes ({n / (1 << 20):.2f} MiB)"


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data in ``obj`` (tensors inside dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def disk_error(path: Path, exc: OSError, needed: int) -> DiskWriteError:
    """The :class:`DiskWriteError` for writer failure ``exc`` on ``path``."""
    code = exc.errno or 0
    free = ""
    with suppress(OSError):
        free = f"; {mib(shutil.disk_usage(path.parent).free)} free there"
    return DiskWriteError(
        path,
        code,
        needed,
        f"cannot write {path}: {exc.strerror or exc} ({DISK_ERRNOS[code]}); it needs "
        f"{mib(needed)}{free}. Free space (or raise the quota or limit), or save elsewhere",
    )


def is_disk_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a write refused by the file system (:data:`DISK_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


_OS_ERROR = re.compile(r"os error (\d+)")


def disk_fault_of(exc: BaseException) -> OSError | None:
    """The file system's refusal behind ``exc``, or ``None``: ``exc`` itself, its cause or
    context (``torch.save`` raises a ``RuntimeError`` over the stream's ``OSError``), or the
    ``os error N`` that safetensors' writer puts in its message."""
    for e in (exc, exc.__cause__, exc.__context__):
        if e is not None and is_disk_fault(e):
            assert isinstance(e, OSError)
            return e
    found = _OS_ERROR.search(str(exc))
    if found and int(found.group(1)) in DISK_ERRNOS:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    return None


def remove_quietly(path: Path) -> None:
    """Remove a half-written file or folder; the original fault is what gets reported."""
    with suppress(OSError):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def rank_file(rank: int) -> str:
    """Relative path of global rank ``rank``'s file (its shards, RNG states, data position)."""
    return f"rank_{rank:05d}.pt"


def param_file(key: str) -> str:
    """Relative path of one parameter's file in the universal format."""
    return f"params/{key}.pt"


def validate_tag(tag: str) -> str:
    """Check a tag names a single folder: non-empty, no path separators, not hidden.

    :raises CheckpointError: naming the tag and the rule it breaks.
    """
    if not isinstance(tag, str) or not tag:
        raise CheckpointError(f"checkpoint tag {tag!r} is empty; pass a name like 'global_step10'")
    if not _TAG_RE.match(tag) or tag in (".", ".."):
        raise CheckpointError(
            f"checkpoint tag {tag!r} must be one folder name (letters, digits, '_', '-', '.', "
            "'+', '='; no path separators, not starting with '.')"
        )
    return tag


def check_save_dir(save_dir: str | os.PathLike[str]) -> Path:
    """The checkpoint root as a path; refuses a path that exists and is not a folder."""
    root = Path(save_dir)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"save_dir {str(root)!r} exists and is not a folder")
    return root


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A binary file that hashes and counts what passes through it."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        written: int = self.f.write(view)
        return written

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.digest.hexdigest()}


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path`` in 1 MiB chunks, fsync, and return its manifest entry.

    :raises DiskWriteError: the file system refused the write (the file is removed).
    """
    try:
        with open(path, "wb") as f:
            w = _HashingWriter(f)
            for start in range(0, len(data), _CHUNK):
                w.write(data[start : start + _CHUNK])
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if not is_disk_fault(exc):
            raise
        remove_quietly(path)
        raise disk_error(path, exc, len(data)) from exc
    return w.entry()


def save_object(path: Path, obj: Any) -> dict[str, Any]:
    """``torch.save`` ``obj`` to ``path`` (fsynced) and return its manifest entry.

    The bytes are hashed as they stream to the file (no second copy in memory), so the entry
    describes exactly what was written.

    :raises DiskWriteError: the file system refused the write (the file is removed).
    """
    try:
        with open(path, "wb") as f:
            w = _HashingWriter(f)
            torch.save(obj, w)  # type: ignore[arg-type]  # any object with write() works
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:
        cause = disk_fault_of(exc)
        if cause is None:
            raise
        remove_quietly(path)
        raise disk_error(path, cause, tensor_bytes(obj)) from exc
    return w.entry()


def hash_file(path: Path) -> tuple[int, str]:
    """Size in bytes and SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def check_entry(path: Path, rel: str, entry: dict[str, Any]) -> None:
    """Compare a file on disk with its manifest entry.

    :raises CheckpointError: the file is missing, has another size (truncated or replaced) or
        another SHA-256 (corrupted).
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: listed in the manifest as {rel!r} but missing")
    size = path.stat().st_size
    if size != entry["size"]:
        raise CheckpointError(
            f"{path}: {size} bytes, the manifest says {entry['size']} (truncated or replaced, "
            "or the manifest belongs to another save)"
        )
    _, sha = hash_file(path)
    if sha != entry["sha256"]:
        raise CheckpointError(
            f"{path}: content does not match the manifest's SHA-256 (corrupted, or the "
            f"manifest belongs to another save: {sha[:12]}... != {entry['sha256'][:12]}...)"
        )


def safe_load(path: Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only, no code runs.

    :raises CheckpointError: the file holds anything else (a pickled callable, a class), or is
        not a readable torch file.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        # torch's message opens with generic advice; the line naming the global is the point
        first = next((ln for ln in lines if "global" in ln.lower()), lines[0] if lines else "")
        raise CheckpointError(
            f"{path}: refused: the file holds objects other than tensors and plain containers "
            f"(loaded with weights_only=True, nothing from it was run): {first}"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable torch file: {exc}") from exc


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], header: dict[str, Any]) -> None:
    """Write ``manifest.json`` (the header plus every file's entry), fsynced."""
    body = {**header, "files": dict(sorted(files.items()))}
    write_bytes(folder / MANIFEST, json.dumps(body, indent=1).encode())


def read_manifest(folder: Path) -> dict[str, Any]:
    """Read and shape-check ``manifest.json``.

    :raises CheckpointError: missing (an incomplete or foreign folder) or malformed.
    """
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; {folder} is not a complete ds_core checkpoint (a save that did "
            "not finish never gets a manifest)"
        )
    try:
        body = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
        raise CheckpointError(f"{path}: no 'files' table; not a ds_core manifest")
    for rel, entry in body["files"].items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            raise CheckpointError(f"{path}: entry {rel!r} lacks an int size and a sha256")
    if body.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {body.get('format_version')!r}; this ds_core reads "
            f"{FORMAT_VERSION}"
        )
    return body


def partial_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.partial"


def start_folder(root: Path, tag: str) -> Path:
    """Create a fresh temporary folder for ``tag`` (removing a stale one left by a kill)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = partial_dir(root, tag)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / "params").mkdir()
    return tmp


def publish(root: Path, tag: str, save_latest: bool) -> Path:
    """Rename the finished temporary folder into place, then move ``latest`` (see the Note)."""
    tmp = partial_dir(root, tag)
    fsync_dir(tmp)
    fsync_dir(tmp / "params")
    final = root / tag
    replaced = root / f".{tag}.replaced"
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.rename(final, replaced)
    os.rename(tmp, final)
    fsync_dir(root)
    if save_latest:
        write_latest(root, tag)
    if replaced.exists():
        shutil.rmtree(replaced)
    return final


def write_latest(root: Path, tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically (write, fsync, rename, fsync the folder)."""
    tmp = root / f"{LATEST}.tmp"
    write_bytes(tmp, tag.encode())  # removes its file when refused
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def read_latest(root: Path) -> str | None:
    """The tag ``latest`` names, or ``None`` when there is no ``latest`` file."""
    path = root / LATEST
    if not path.is_file():
        return None
    return validate_tag(path.read_text().strip())


def resolve(root: Path, tag: str | None) -> Path | None:
    """The folder of ``tag`` (``latest`` when ``None``), or ``None`` when nothing is there."""
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            return None
    validate_tag(tag)
    folder = root / tag
    if folder.is_dir():
        return folder
    replaced = root / f".{tag}.replaced"  # killed between the two renames of a replacement
    return replaced if (replaced / MANIFEST).is_file() else None


def host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, flat, over a storage holding exactly its elements.

    ``torch.save`` of a view writes the view's whole underlying storage (a master piece is a
    view of its unit's buffer). A contiguous host view is re-based on a slice of that storage,
    which shares the memory, so nothing is copied; anything else is cloned.
    """
    flat = t.detach().reshape(-1).to("cpu")
    size = flat.element_size()
    if flat.untyped_storage().nbytes() == flat.numel() * size and not flat.storage_offset():
        return flat
    if not flat.is_contiguous():
        return flat.clone()
    start = flat.storage_offset() * size
    storage: torch.UntypedStorage = flat.untyped_storage()[start : start + flat.numel() * size]
    return torch.empty(0, dtype=flat.dtype).set_(storage, 0, (flat.numel(),), (1,))
