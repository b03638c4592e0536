"""Corruption and security: every damaged checkpoint gives its own clear error, offline.

The files are those of the exact-resume suite (world 2, stage 1), copied and damaged. The
engine's load goes through the same reader (``test_resume`` shows an engine naming a
corrupted shard on every rank).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_core.checkpoint import (
    CheckpointError,
    CheckpointReader,
    consolidated_state_dict,
    inspect_checkpoint,
)
from ds_core.checkpoint._io import hash_file, validate_tag

pytestmark = pytest.mark.slow

TAG = "global_step3"


@pytest.fixture
def copies(suite: Any, tmp_path: Path) -> dict[str, Path]:
    root = suite("resume_save").ckroot / "s1"
    out = {}
    for fmt in ("native", "universal"):
        shutil.copytree(root / fmt, tmp_path / fmt)
        out[fmt] = tmp_path / fmt / TAG
    return out


def read_all(folder: Path) -> None:
    CheckpointReader(folder).verify_all()


def test_intact_copies_verify(copies: dict[str, Path]) -> None:
    for folder in copies.values():
        read_all(folder)
    a, b = (consolidated_state_dict(f) for f in copies.values())
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_flipped_byte(copies: dict[str, Path]) -> None:
    shard = copies["native"] / "rank_00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"rank_00001\.pt: content does not match the manifest's SHA-256"
    ):
        read_all(copies["native"])


def test_truncated_file(copies: dict[str, Path]) -> None:
    shard = copies["native"] / "rank_00000.pt"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(
        CheckpointError,
        match=rf"rank_00000\.pt: {size // 2} bytes, the manifest says {size} \(truncated",
    ):
        consolidated_state_dict(copies["native"])


def test_deleted_shard(copies: dict[str, Path]) -> None:
    victim = copies["universal"] / "params" / "head.weight.pt"
    victim.unlink()
    with pytest.raises(
        CheckpointError,
        match=r"head\.weight\.pt: listed in the manifest as 'params/head\.weight\.pt' but missing",
    ):
        consolidated_state_dict(copies["universal"])


def test_manifest_from_another_save(copies: dict[str, Path]) -> None:
    shutil.copy(copies["universal"] / "manifest.json", copies["native"] / "manifest.json")
    with pytest.raises(
        CheckpointError,
        match=r"meta\.pt: .*the manifest belongs to another save",
    ):
        CheckpointReader(copies["native"])


def test_manifest_of_another_checkpoint_id(copies: dict[str, Path]) -> None:
    path = copies["native"] / "manifest.json"
    body = json.loads(path.read_text())
    body["checkpoint_id"] = "0" * 32
    path.write_text(json.dumps(body))
    with pytest.raises(
        CheckpointError,
        match=r"written for checkpoint '0+', but meta\.pt belongs to .* \(files from two different saves\)",
    ):
        CheckpointReader(copies["native"])


def test_manifest_missing_a_rank(copies: dict[str, Path]) -> None:
    path = copies["native"] / "manifest.json"
    body = json.loads(path.read_text())
    del body["files"]["rank_00001.pt"]
    path.write_text(json.dumps(body))
    with pytest.raises(
        CheckpointError, match=r"lists no rank_00001\.pt, but the checkpoint was saved on 2 ranks"
    ):
        CheckpointReader(copies["native"])


def test_manifest_missing_or_garbled(copies: dict[str, Path]) -> None:
    path = copies["native"] / "manifest.json"
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json: not valid JSON"):
        CheckpointReader(copies["native"])
    path.unlink()
    with pytest.raises(
        CheckpointError, match=r"manifest\.json: missing; .* is not a complete ds_core checkpoint"
    ):
        CheckpointReader(copies["native"])


def test_pickled_callable_is_refused(copies: dict[str, Path]) -> None:
    """A file carrying a callable, with a manifest forged to match, is still refused."""
    folder = copies["native"]
    shard = folder / "rank_00001.pt"
    torch.save({"params": {}, "rng": os.system}, shard)
    path = folder / "manifest.json"
    body = json.loads(path.read_text())
    size, sha = hash_file(shard)
    body["files"]["rank_00001.pt"] = {"size": size, "sha256": sha}
    path.write_text(json.dumps(body))
    with pytest.raises(
        CheckpointError, match=r"rank_00001\.pt: refused: .*weights_only=True.*GLOBAL posix\.system"
    ):
        read_all(folder)
    assert "refused" in inspect_checkpoint(folder)["verified"]


@pytest.mark.parametrize("tag", ["", "a/b", "../up", ".hidden", "x\\y"])
def test_bad_tags(tag: str) -> None:
    with pytest.raises(CheckpointError, match="tag"):
        validate_tag(tag)
