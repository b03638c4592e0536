"""ds_core.ops: build, cache, key, lock, verification and failure behaviour of compiled ops."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ds_core import ops
from ds_core.ops import _build

pytestmark = pytest.mark.skipif(
    ops.compiler_path("c") is None, reason="no C compiler on this machine"
)

SYNC_C = textwrap.dedent(
    """
    #include <stdatomic.h>
    #include <stdint.h>
    /* A flag set / wait pair like the shm helper needs: release store, acquire load. */
    void ds_flag_set(_Atomic int32_t *flag, int32_t v) {
        atomic_store_explicit(flag, v, memory_order_release);
    }
    int32_t ds_flag_get(_Atomic int32_t *flag) {
        return atomic_load_explicit(flag, memory_order_acquire);
    }
    int32_t ds_add(int32_t a, int32_t b) { return a + b + OFFSET; }
    """
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "cache"
    monkeypatch.setenv(ops.ENV_CACHE, str(root))
    saved = dict(_build._LOADED)
    _build._LOADED.clear()
    yield root
    _build._LOADED.clear()
    _build._LOADED.update(saved)


def _source(tmp_path: Path, text: str = SYNC_C, name: str = "sync.c") -> Path:
    src = tmp_path / name
    src.write_text(text)
    return src


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir())


def test_toolchain_probe_names_the_compiler() -> None:
    tc = ops.toolchain()
    assert tc.cc == ops.compiler_path("c")
    assert tc.cc_version, "cc --version printed nothing"
    assert tc.cc is not None and tc.cc in tc.describe()


def test_shared_library_builds_loads_and_runs(
    cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    lib = ops.build_shared_library("t_sync", [_source(tmp_path)], cflags=["-DOFFSET=3"])
    lib.ds_add.restype = ctypes.c_int32
    assert lib.ds_add(2, 4) == 9
    flag = ctypes.c_int32(0)
    lib.ds_flag_set(ctypes.byref(flag), 7)
    lib.ds_flag_get.restype = ctypes.c_int32
    assert lib.ds_flag_get(ctypes.byref(flag)) == 7
    assert "building op 't_sync'" in capfd.readouterr().err
    # Per-user cache, private: the root and the build folder are 0700.
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (folder,) = _folders(cache)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["artefact"] == "libt_sync.so"
    assert "-DOFFSET=3" in manifest["inputs"]["flags"]
    # Same call again in this process: the same library object, no rebuild.
    assert ops.build_shared_library("t_sync", [tmp_path / "sync.c"], cflags=["-DOFFSET=3"]) is lib
    assert "building" not in capfd.readouterr().err


def _fresh_process_build(tmp_path: Path, cache: Path, cflags: str = "-DOFFSET=1") -> str:
    code = (
        "import ctypes, ds_core.ops as o; "
        f"lib = o.build_shared_library('t_sync', [{str(tmp_path / 'sync.c')!r}], "
        f"cflags=[{cflags!r}]); lib.ds_add.restype = ctypes.c_int32; print(lib.ds_add(1, 1))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, **{ops.ENV_CACHE: str(cache)}),
        check=True,
    )
    return done.stdout.strip() + "|" + done.stderr


def test_warm_cache_is_loaded_without_building(cache: Path, tmp_path: Path) -> None:
    _source(tmp_path)
    cold = _fresh_process_build(tmp_path, cache)
    warm = _fresh_process_build(tmp_path, cache)
    assert cold.startswith("3|") and "building op 't_sync'" in cold
    assert warm.startswith("3|") and "building" not in warm


def test_key_covers_sources_and_flags(cache: Path, tmp_path: Path) -> None:
    src = _source(tmp_path)
    ops.build_shared_library("t_sync", [src], cflags=["-DOFFSET=1"], quiet=True)
    ops.build_shared_library("t_sync", [src], cflags=["-DOFFSET=2"], quiet=True)
    assert len(_folders(cache)) == 2
    src.write_text(SYNC_C + "\nint ds_extra(void) { return 5; }\n")
    lib = ops.build_shared_library("t_sync", [src], cflags=["-DOFFSET=2"], quiet=True)
    assert len(_folders(cache)) == 3
    assert lib.ds_extra() == 5


def test_tampered_artefact_is_rebuilt_not_loaded(cache: Path, tmp_path: Path) -> None:
    _source(tmp_path)
    _fresh_process_build(tmp_path, cache)
    (folder,) = _folders(cache)
    so = folder / "libt_sync.so"
    good = so.read_bytes()
    so.write_bytes(good[: len(good) // 2])  # truncated: would crash or misbehave if loaded
    again = _fresh_process_build(tmp_path, cache)
    assert again.startswith("3|") and "building op 't_sync'" in again
    assert so.read_bytes() == good  # deterministic rebuild of the same inputs


def test_manifest_for_another_key_is_rebuilt(cache: Path, tmp_path: Path) -> None:
    _source(tmp_path)
    _fresh_process_build(tmp_path, cache)
    (folder,) = _folders(cache)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["key"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert "building op 't_sync'" in _fresh_process_build(tmp_path, cache)


def test_concurrent_builders_build_once(cache: Path, tmp_path: Path) -> None:
    _source(tmp_path)
    code = (
        "import ctypes, ds_core.ops as o; "
        f"lib = o.build_shared_library('t_sync', [{str(tmp_path / 'sync.c')!r}], "
        "cflags=['-DOFFSET=1']); lib.ds_add.restype = ctypes.c_int32; print(lib.ds_add(1, 1))"
    )
    env = dict(os.environ, **{ops.ENV_CACHE: str(cache)})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert [o.strip() for o, _ in outs] == ["3", "3", "3"]
    assert sum("built op 't_sync' in" in e for _, e in outs) == 1, [e for _, e in outs]


def test_failed_build_reports_command_and_compiler_output(cache: Path, tmp_path: Path) -> None:
    src = _source(tmp_path, "int broken( { return 0; }\n", "broken.c")
    with pytest.raises(ops.OpBuildError) as info:
        ops.build_shared_library("t_broken", [src], quiet=True)
    msg = str(info.value)
    assert "op 't_broken' failed to build" in msg
    assert "command:" in msg and str(src) in msg
    assert "error" in msg.lower()  # the compiler's own diagnostic, from its output tail
    (folder,) = _folders(cache)
    assert not (folder / "manifest.json").exists()
    assert not list(folder.glob(".*.tmp"))


def test_missing_sources_and_missing_compiler_are_clear(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ops.OpBuildError, match="not found"):
        ops.build_shared_library("t_none", [tmp_path / "absent.c"])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    ops.toolchain.cache_clear()
    try:
        assert ops.compiler_path("c") is None
        with pytest.raises(ops.OpBuildError, match="needs a C compiler"):
            ops.build_shared_library("t_sync", [_source(tmp_path)])
    finally:
        monkeypatch.undo()
        ops.toolchain.cache_clear()


def test_interrupt_during_build_propagates_and_cleans_up(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    ops.toolchain()  # probe first: only the compile itself is interrupted here
    monkeypatch.setattr(_build.subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ops.build_shared_library("t_sync", [_source(tmp_path)], cflags=["-DOFFSET=1"])
    (folder,) = _folders(cache)
    assert not list(folder.iterdir())  # no temp file, no manifest
    monkeypatch.undo()
    # The lock was released: the next build in this process proceeds.
    lib = ops.build_shared_library("t_sync", [tmp_path / "sync.c"], cflags=["-DOFFSET=1"])
    lib.ds_add.restype = ctypes.c_int32
    assert lib.ds_add(0, 0) == 1


def test_loose_cache_permissions_are_tightened(cache: Path) -> None:
    cache.mkdir(mode=0o755)
    cache.chmod(0o755)
    assert ops.cache_root() == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@pytest.mark.slow
@pytest.mark.skipif(ops.toolchain().cxx is None, reason="torch extensions need a C++ compiler")
def test_torch_extension_builds_and_runs(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    calls: list[tuple[Any, dict[str, Any]]] = []
    real_run = subprocess.run

    def recording_run(cmd: Any, **kwargs: Any) -> Any:
        calls.append((cmd, kwargs))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr("ds_core.ops._build.subprocess.run", recording_run)

    src = _source(
        tmp_path,
        textwrap.dedent(
            """
            #include <torch/extension.h>
            torch::Tensor twice(torch::Tensor x) { return x * 2; }
            PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
            """
        ),
        "twice.cpp",
    )
    mod = ops.build_extension("t_twice", [src], quiet=True)
    assert torch.equal(mod.twice(torch.arange(4.0)), torch.arange(4.0) * 2)
    assert ops.build_extension("t_twice", [src], quiet=True) is mod
    # one compiler command, an argument list run without a shell (no ninja, no /bin/sh)
    builds = [(cmd, kw) for cmd, kw in calls if str(src) in cmd]
    assert len(builds) == 1
    cmd, kwargs = builds[0]
    assert isinstance(cmd, list) and cmd[0] == ops.toolchain().cxx
    assert not kwargs.get("shell", False)


def test_a_plugin_ships_a_compiled_op_through_its_provider_hook(
    cache: Path, tmp_path: Path
) -> None:
    import ds_core
    from ds_core.types import SimpleOpProvider

    src = _source(tmp_path, "int ds_triple(int x) { return 3 * x; }\n", "triple.c")

    def load() -> ctypes.CDLL:
        return ops.build_shared_library("t_triple", [src], quiet=True)

    def check() -> tuple[bool, str]:
        cc = ops.compiler_path("c")
        return (cc is not None, f"built with {cc}" if cc else "no C compiler")

    class AddOn:
        @ds_core.hookimpl
        def ds_op_providers(self) -> list[SimpleOpProvider]:
            return [SimpleOpProvider("triple", check, load)]

    addon = AddOn()
    ds_core.register_plugin(addon)
    try:
        provider = ds_core.get_accelerator().get_op("triple")
        assert provider.is_compatible()[0]
        assert not cache.exists()  # listing and checking the op built nothing
        assert provider.load().ds_triple(14) == 42
    finally:
        ds_core.unregister_plugin(addon)


# -- declared signatures (ds_core/ops/_signatures.py) ------------------------------------------

PLAIN = {"ds_add": ("int32_t", ("int32_t", "int32_t"))}


def test_declared_signatures_type_the_loaded_functions(cache: Path, tmp_path: Path) -> None:
    lib = ops.build_shared_library(
        "signed", [_source(tmp_path)], cflags=["-DOFFSET=0"], signatures=PLAIN, quiet=True
    )
    assert lib.ds_add.restype is ctypes.c_int32
    assert lib.ds_add.argtypes == [ctypes.c_int32, ctypes.c_int32]
    assert lib.ds_add(2, 3) == 5


def test_a_declared_symbol_the_source_lacks_fails_the_build_naming_it(
    cache: Path, tmp_path: Path
) -> None:
    signatures = {**PLAIN, "ds_flag_clear": ("void", ("int32_t *",))}
    with pytest.raises(ops.OpBuildError, match="ds_flag_clear"):
        ops.build_shared_library(
            "signed", [_source(tmp_path)], cflags=["-DOFFSET=0"], signatures=signatures,
            quiet=True,
        )  # fmt: skip


def test_a_declared_type_unlike_the_definition_fails_the_build_naming_it(
    cache: Path, tmp_path: Path
) -> None:
    # int64_t where C has int32_t: a call would pass silently with a plain prototype or cffi.
    with pytest.raises(ops.OpBuildError, match=r"ds_add is declared in Python as int64_t ds_add"):
        ops.build_shared_library(
            "signed", [_source(tmp_path)], cflags=["-DOFFSET=0"],
            signatures={"ds_add": ("int64_t", ("int32_t", "int32_t"))}, quiet=True,
        )  # fmt: skip


def test_a_library_missing_a_declared_symbol_is_refused_naming_it(
    cache: Path, tmp_path: Path
) -> None:
    from ds_core.ops._signatures import bind

    lib = ops.build_shared_library("plain", [_source(tmp_path)], cflags=["-DOFFSET=0"], quiet=True)
    with pytest.raises(ops.OpBuildError, match=r"does not export the declared symbol\(s\) ds_gone"):
        bind(lib, {**PLAIN, "ds_gone": ("int", ())}, "op 'plain'")
