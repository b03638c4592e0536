"""Backend discovery and selection over real distributions on sys.path.

The rules: docs/architecture.md §3.1, §4.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds_core.errors import BackendSelectionError
from ds_core.plugins import BackendEntry, choose, discover
from tests.distfactory import make_backend


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    monkeypatch.undo()
    discover(refresh=True)


def only(entries: dict[str, BackendEntry], *names: str) -> dict[str, BackendEntry]:
    return {n: entries[n] for n in names}


def test_discovers_installed_backends_with_distribution_and_version(site: Path) -> None:
    make_backend(site, "alpha", dist="ds-core-alpha", version="1.2.3")
    entries = discover(refresh=True)
    alpha = entries["alpha"]
    assert (alpha.distribution, alpha.version, alpha.loaded) == ("ds-core-alpha", "1.2.3", True)
    assert alpha.probe().available


def test_explicit_choice_wins_even_over_higher_priority(site: Path) -> None:
    make_backend(site, "low", priority=0)
    make_backend(site, "high", priority=100, device_type="meta")
    entries = only(discover(refresh=True), "low", "high")
    assert choose("low", entries).name == "low"


def test_highest_priority_available_backend_wins(site: Path) -> None:
    make_backend(site, "host", priority=0)
    make_backend(site, "fast", priority=100, device_type="meta")
    make_backend(site, "gone", priority=200, device_type="meta", available=False)
    entries = only(discover(refresh=True), "host", "fast", "gone")
    assert choose("fast", entries).name == "fast"
    # 'gone' is unavailable, so among the available ones 'fast' (100) beats 'host' (0)
    assert choose(None, only(entries, "host", "fast")).name == "fast"


def test_tie_between_available_backends_names_both(site: Path) -> None:
    make_backend(site, "one", priority=100, device_type="meta")
    make_backend(site, "two", priority=100, device_type="meta")
    entries = only(discover(refresh=True), "one", "two")
    with pytest.raises(BackendSelectionError, match=r"one .* and two .* priority 100"):
        choose(None, entries)


def test_unknown_name_lists_installed_and_the_extra(site: Path) -> None:
    make_backend(site, "host")
    entries = only(discover(refresh=True), "host")
    with pytest.raises(BackendSelectionError) as info:
        choose("npu", entries)
    msg = str(info.value)
    assert "installed backends: host" in msg
    assert 'pip install "ds-core[npu]"' in msg
    with pytest.raises(BackendSelectionError, match="Did you mean 'host'"):
        choose("hots", entries)


def test_a_name_in_the_wrong_case_suggests_the_right_one(site: Path) -> None:
    make_backend(site, "host")
    entries = only(discover(refresh=True), "host")
    with pytest.raises(BackendSelectionError, match="lower-case: did you mean 'host'") as info:
        choose("HOST", entries)
    assert "Install it" not in str(info.value)  # it is installed, only spelled differently
    # a known backend that is not installed: the right name and the extra that installs it
    with pytest.raises(BackendSelectionError) as info:
        choose("NPU", entries)
    assert "did you mean 'npu'" in str(info.value)
    assert 'pip install "ds-core[npu]"' in str(info.value)


def test_no_silent_fallback_to_cpu_when_an_accelerator_is_unavailable(site: Path) -> None:
    make_backend(site, "host", priority=0)
    make_backend(
        site, "gpu", priority=100, device_type="meta", available=False, reason="driver missing"
    )
    entries = only(discover(refresh=True), "host", "gpu")
    with pytest.raises(BackendSelectionError) as info:
        choose(None, entries)
    msg = str(info.value)
    assert "gpu (ds-core-test-gpu 0.0.1): driver missing" in msg
    assert "DS_ACCELERATOR=cpu" in msg
    # asking for the host explicitly is the way out
    assert choose("host", entries).name == "host"


def test_explicit_choice_of_an_unavailable_backend_fails_with_its_reason(site: Path) -> None:
    make_backend(site, "gpu", priority=100, available=False, reason="no devices visible")
    entries = only(discover(refresh=True), "gpu")
    with pytest.raises(BackendSelectionError, match="not available here: no devices visible"):
        choose("gpu", entries)


def test_broken_entry_point_is_named_and_does_not_break_others(site: Path) -> None:
    make_backend(site, "host")
    make_backend(
        site,
        "broken",
        dist="ds-core-broken",
        version="9.9",
        body="raise ImportError('libfoo.so missing')\n",
    )
    entries = discover(refresh=True)
    broken = entries["broken"]
    assert not broken.loaded
    assert broken.load_error == "ImportError: libfoo.so missing"
    assert entries["host"].loaded
    with pytest.raises(
        BackendSelectionError,
        match=r"broken \(ds-core-broken 9.9\) failed to import: ImportError: libfoo.so missing",
    ):
        choose("broken", entries)
    assert choose("host", entries).name == "host"


def test_two_distributions_claiming_one_name_is_an_error_naming_both(site: Path) -> None:
    make_backend(site, "twin", dist="ds-core-twin-a", module=f"twin_a_{site.name}")
    make_backend(site, "twin", dist="ds-core-twin-b", module=f"twin_b_{site.name}")
    with pytest.raises(BackendSelectionError) as info:
        discover(refresh=True)
    assert "ds-core-twin-a" in str(info.value) and "ds-core-twin-b" in str(info.value)
    assert "Uninstall one" in str(info.value)


def test_a_raising_probe_is_an_unavailable_result(site: Path) -> None:
    make_backend(
        site,
        "flaky",
        extra="""
@hookimpl
def ds_backend_probe():
    raise OSError("management library crashed")
""",
    )
    entries = only(discover(refresh=True), "flaky")
    assert entries["flaky"].probe().available is False
    assert "OSError: management library crashed" in entries["flaky"].probe().reason


def test_ds_accelerator_env_selects_in_a_fresh_process(tmp_path: Path) -> None:
    make_backend(tmp_path, "envpick", priority=5)
    code = "import ds_core; a = ds_core.get_accelerator(); print(a.name, a.info.priority)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "DS_ACCELERATOR": "envpick"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["envpick", "5"]
    env["DS_ACCELERATOR"] = "nosuch"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "backend 'nosuch' is not installed" in out.stderr


def test_set_accelerator_after_selection_must_name_the_same_backend() -> None:
    import ds_core

    ds_core.reset_accelerator()
    ds_core.set_accelerator("cpu")
    assert ds_core.get_accelerator().name == "cpu"
    ds_core.set_accelerator("cpu")  # same name: fine
    with pytest.raises(ds_core.DSCoreError, match="already in use"):
        ds_core.set_accelerator("other")
    ds_core.reset_accelerator()
