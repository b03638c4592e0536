"""Swap folders shared by ranks: one rank leaving (removing the empty shared parent) while
another creates its folder is a race the creator survives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ds_core.errors import ConfigError
from ds_core.io import folders


def test_a_parent_removed_by_a_leaving_rank_is_created_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.makedirs
    calls = []

    def racing(path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        calls.append(path)
        if len(calls) == 1:  # the parent existed, then another rank's release removed it
            raise FileNotFoundError(2, "No such file or directory", path)
        real(path, mode, exist_ok)

    monkeypatch.setattr(folders.os, "makedirs", racing)
    folder = folders.make_swap_folder(str(tmp_path), "rank0.1", "offload_optimizer.nvme_path")
    # tried again after the race (os.makedirs then also recurses into the parent)
    assert os.path.isdir(folder) and calls[:2] == [folder, folder]
    assert folder == str(tmp_path / folders.PARENT / "rank0.1")


def test_the_last_folder_out_removes_the_parent(tmp_path: Path) -> None:
    a = folders.make_swap_folder(str(tmp_path), "rank0.1", "f")
    b = folders.make_swap_folder(str(tmp_path), "rank1.2", "f")
    Path(a, "sg0.swp").write_bytes(b"x")
    folders.remove_swap_folder(a)
    assert not os.path.exists(a) and os.path.isdir(b)
    folders.remove_swap_folder(b)
    assert not (tmp_path / folders.PARENT).exists()


def test_a_missing_nvme_path_is_an_error_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"offload_param\.nvme_path: cannot create"):
        folders.make_swap_folder(str(tmp_path / "file"), "r", "offload_param.nvme_path")
