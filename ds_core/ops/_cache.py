"""The per-user artefact cache: where builds go, how they are keyed, locked and verified.

Layout under the cache root (mode 0700, owned by the user)::

    <root>/<name>-<key[:16]>/            one folder per build key
        <artefact>                       the shared library or extension module
        manifest.json                    full key, artefact name and its SHA-256, build inputs
    <root>/<name>-<key[:16]>.lock        flock'ed while a process checks or builds

A folder is trusted only when its manifest's key equals the key computed now and the
artefact's SHA-256 equals the manifest's; anything else is rebuilt, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_core.errors import DSCoreError

__all__ = ["ENV_CACHE", "BuildKey", "Manifest", "cache_root", "file_lock", "make_key"]

#: Overrides the cache root (default: ``$XDG_CACHE_HOME/ds_core/ops`` or ``~/.cache/ds_core/ops``).
ENV_CACHE = "DS_CORE_OPS_CACHE"
# Bumped when the layout or the meaning of a key changes, so old artefacts are never reused.
SCHEME = 1
MANIFEST = "manifest.json"
_WAIT_NOTE_SECONDS = 5.0


class OpBuildError(DSCoreError):
    """An op could not be built or loaded; the message has the command and compiler output."""


def cache_root() -> Path:
    """Return the cache root, creating it with mode 0700 if needed.

    :raises OpBuildError: when the folder exists but belongs to another user, or is not a folder.
    """
    override = os.environ.get(ENV_CACHE)
    if override:
        root = Path(override).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "ds_core" / "ops"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise OpBuildError(f"op cache {root} is not a folder; remove it or set {ENV_CACHE}")
    if st.st_uid != os.getuid():
        raise OpBuildError(
            f"op cache {root} belongs to uid {st.st_uid}, not to this user ({os.getuid()}); "
            f"loading code others can write is unsafe. Set {ENV_CACHE} to a folder of your own."
        )
    if st.st_mode & 0o077:
        # Ours, but readable or writable by others (e.g. made by hand): tighten it, since
        # anything another user can write here would be loaded as code.
        root.chmod(0o700)
    return root


@dataclass(frozen=True, slots=True)
class BuildKey:
    """The hash that names one build, and the inputs it was computed from (for the manifest)."""

    name: str
    digest: str
    inputs: dict[str, Any]

    @property
    def folder_name(self) -> str:
        return f"{self.name}-{self.digest[:16]}"


def make_key(
    name: str,
    kind: str,
    sources: Sequence[Path],
    flags: Sequence[str],
    compiler: str,
    compiler_version: str,
) -> BuildKey:
    """Hash sources (names and bytes), flags, compiler, and torch / Python / platform versions.

    :raises OpBuildError: when a source cannot be read.
    """
    import platform

    import torch

    h = hashlib.sha256()
    described: list[str] = []
    for src in sources:
        try:
            data = src.read_bytes()
        except OSError as exc:
            raise OpBuildError(f"op '{name}': cannot read source {src}: {exc}") from exc
        h.update(src.name.encode() + b"\0" + hashlib.sha256(data).digest())
        described.append(f"{src} sha256={hashlib.sha256(data).hexdigest()}")
    inputs: dict[str, Any] = {
        "scheme": SCHEME,
        "kind": kind,
        "name": name,
        "sources": described,
        "flags": list(flags),
        "compiler": compiler,
        "compiler_version": compiler_version,
        "torch": torch.__version__,
        "python": sys.version,
        "platform": f"{sys.platform}-{platform.machine()}",
    }
    rest = {k: v for k, v in inputs.items() if k != "sources"}
    h.update(json.dumps(rest, sort_keys=True).encode())
    return BuildKey(name, h.hexdigest(), inputs)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Manifest:
    """Reads and writes ``manifest.json`` of one build folder."""

    folder: Path

    def valid_artefact(self, key: BuildKey) -> Path | None:
        """Return the artefact's path if the manifest matches ``key`` and the artefact's hash."""
        try:
            data = json.loads((self.folder / MANIFEST).read_text())
            artefact = self.folder / str(data["artefact"])
            if data.get("key") != key.digest or data.get("scheme") != SCHEME:
                return None
            if sha256_file(artefact) != data.get("sha256"):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return artefact

    def write(self, key: BuildKey, artefact: Path, seconds: float) -> None:
        """Write atomically (temp file + rename), after the artefact is in place."""
        record = {
            "scheme": SCHEME,
            "key": key.digest,
            "artefact": artefact.name,
            "sha256": sha256_file(artefact),
            "build_seconds": round(seconds, 3),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "inputs": key.inputs,
        }
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".manifest-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.folder / MANIFEST)
        except BaseException:
            # Clean up, then let the exception (KeyboardInterrupt included) continue.
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


@contextlib.contextmanager
def file_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``: one process builds, the others wait here.

    The lock goes with the process, so a killed builder never leaves it held. A wait longer
    than a few seconds is reported on stderr once.
    """
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"ds_core.ops: waiting for another process building {what}", file=sys.stderr)
            started = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = time.monotonic() - started
            if waited > _WAIT_NOTE_SECONDS:
                print(f"ds_core.ops: waited {waited:.1f} s for {what}", file=sys.stderr)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
