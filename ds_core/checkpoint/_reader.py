"""Reading a checkpoint of either format, offline (no process group needed).

A :class:`CheckpointReader` checks the manifest and ``meta.pt`` when opened, and every other
file against its manifest entry (size, SHA-256) the first time it is read. Files are loaded
with ``torch.load(weights_only=True, mmap=True)``: tensors map the file and are paged in only
when touched, so assembling one parameter reads one parameter's bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ds_core.checkpoint import _io, _nvme
from ds_core.checkpoint._io import CheckpointError


class CheckpointReader:
    """One checkpoint folder (``<save_dir>/<tag>``), native or universal.

    :param folder: the tag's folder.
    :raises CheckpointError: no or malformed manifest, ``meta.pt`` failing its entry, or a
        manifest written for another checkpoint.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.manifest = _io.read_manifest(self.folder)
        self._verified: set[str] = set()
        self._cache: dict[str, Any] = {}
        self.meta: dict[str, Any] = self.load(_io.META)
        if self.meta.get("checkpoint_id") != self.manifest.get("checkpoint_id"):
            raise CheckpointError(
                f"{self.folder / _io.MANIFEST}: written for checkpoint "
                f"{self.manifest.get('checkpoint_id')!r}, but meta.pt belongs to "
                f"{self.meta.get('checkpoint_id')!r} (files from two different saves)"
            )
        self.format: str = self.meta["format"]
        self.world_size: int = int(self.meta["world_size"])
        self.params: dict[str, dict[str, Any]] = self.meta["params"]
        if self.format == "native":
            for r in range(self.world_size):
                if _io.rank_file(r) not in self.manifest["files"]:
                    raise CheckpointError(
                        f"{self.folder / _io.MANIFEST}: lists no {_io.rank_file(r)}, but the "
                        f"checkpoint was saved on {self.world_size} ranks (mismatched manifest)"
                    )

    # -- files -----------------------------------------------------------------------------

    def verify(self, rel: str) -> Path:
        """Check one file against its manifest entry (once); returns its path."""
        entry = self.manifest["files"].get(rel)
        path = self.folder / rel
        if entry is None:
            raise CheckpointError(f"{path}: not listed in {self.folder / _io.MANIFEST}")
        if rel not in self._verified:
            _io.check_entry(path, rel, entry)
            self._verified.add(rel)
        return path

    def load(self, rel: str) -> Any:
        """A verified file's content (cached; tensors memory-mapped)."""
        if rel not in self._cache:
            self._cache[rel] = _io.safe_load(self.verify(rel), mmap=rel != _io.META)
        return self._cache[rel]

    def release(self, rel: str) -> None:
        """Forget a cached file (its mapping goes when the last tensor from it does)."""
        self._cache.pop(rel, None)

    def verify_all(self) -> int:
        """Check every file in the manifest and that each loads safely; returns total bytes."""
        total = 0
        for rel, entry in self.manifest["files"].items():
            self.verify(rel)
            if rel != _io.META:
                self.load(rel)
                self.release(rel)
            total += int(entry["size"])
        return total

    def rank_payload(self, rank: int) -> dict[str, Any]:
        payload: dict[str, Any] = self.load(_io.rank_file(rank))
        return payload

    # -- parameters ------------------------------------------------------------------------

    def keys(self) -> Iterator[str]:
        """Stored parameter keys in module order (frozen ones left out when not saved)."""
        return (k for k, info in self.params.items() if info["saved"])

    def files_for(self, key: str) -> list[str]:
        """The files holding ``key``'s values."""
        if self.format == "universal":
            return [_io.param_file(key)]
        return [_io.rank_file(r) for r in range(self.world_size)] + self.swapped_files()

    def swapped_files(self, rank: int | None = None) -> list[str]:
        """Native only: the files of NVMe-resident state (see [Note: NVMe state in
        checkpoints] in :mod:`ds_core.checkpoint._nvme`), of one rank or of all."""
        head = f"{_nvme.FOLDER}/" if rank is None else f"{_nvme.FOLDER}/rank_{rank:05d}."
        return sorted(rel for rel in self.manifest["files"] if rel.startswith(head))

    def fragment(self, key: str, rank: int) -> dict[str, Any] | None:
        """Native only: what rank ``rank`` saved of ``key``: its piece ``[lo, hi)`` of the
        flattened parameter (``None`` when it saved none), NVMe-resident state joined in."""
        frag: dict[str, Any] | None = self.rank_payload(rank)["params"].get(key)
        if frag is not None and "swapped" in frag:
            return _nvme.join(self.load, key, frag)
        return frag

    def entry(self, key: str) -> dict[str, Any]:
        """``key``'s full unpadded values: ``fp32`` and ``state`` (dict) and ``scalars`` for a
        trainable parameter, ``frozen`` (model dtype) for a frozen one.

        :raises CheckpointError: missing fragments, or scalars that differ between fragments.
        """
        info = self.params.get(key)
        if info is None or not info["saved"]:
            raise CheckpointError(f"{self.folder}: holds no parameter {key!r}")
        shape = torch.Size(info["shape"])
        if self.format == "universal":
            entry: dict[str, Any] = self.load(_io.param_file(key))
            return entry
        numel = int(info["numel"])
        if numel == 0:  # nothing to join; an empty parameter has no optimizer state to keep
            empty = torch.zeros(shape, dtype=getattr(torch, info["dtype"]))
            if info["trainable"]:
                return {"fp32": empty.float(), "state": {}, "scalars": {}}
            return {"frozen": empty}
        found = [self.fragment(key, r) for r in range(self.world_size)]
        # empty pieces hold no elements (and maybe no optimizer state): leave them out
        ordered = sorted(
            (f for f in found if f is not None and int(f["hi"]) > int(f["lo"])),
            key=lambda f: int(f["lo"]),
        )
        edge = 0
        for f in ordered:
            if int(f["lo"]) != edge:
                break
            edge = int(f["hi"])
        if edge != numel or not ordered:
            spans = [(int(f["lo"]), int(f["hi"])) for f in ordered]
            raise CheckpointError(
                f"{self.folder}: the fragments of {key!r} cover {spans}, not [0, {numel}) "
                "exactly (a rank file from another save?)"
            )

        def join(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([p.reshape(-1) for p in parts]).view(shape)

        first = ordered[0]
        if "frozen" in first:
            return {"frozen": join([f["frozen"] for f in ordered])}
        for f in ordered[1:]:
            for k, v in f["scalars"].items():
                if not _same(v, first["scalars"].get(k)):
                    raise CheckpointError(
                        f"{self.folder}: optimizer scalar {k!r} of {key!r} differs between "
                        f"fragments ({first['scalars'].get(k)!r} vs {v!r})"
                    )
        return {
            "fp32": join([f["fp32"] for f in ordered]),
            "state": {k: join([f["state"][k] for f in ordered]) for k in first["state"]},
            "scalars": dict(first["scalars"]),
        }

    def summary(self) -> dict[str, Any]:
        """Tag, format, stage, world size, step, parameter count and bytes."""
        return {
            "tag": self.meta["tag"],
            "format": self.format,
            "stage": self.meta["stage"],
            "world_size": self.world_size,
            "dtype": self.meta["dtype"],
            "global_steps": self.meta["counters"]["global_steps"],
            "global_samples": self.meta["counters"]["global_samples"],
            "skipped_steps": self.meta["counters"]["skipped_steps"],
            "parameters": sum(int(i["numel"]) for i in self.params.values()),
            "tensors": len(self.params),
            "bytes": sum(int(e["size"]) for e in self.manifest["files"].values()),
            "versions": self.meta["versions"],
        }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(torch.equal(a, b))
    return bool(a == b)
