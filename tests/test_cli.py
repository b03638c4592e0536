"""`ds-core report`: what it shows, that it respects process limits, and that it fails loudly."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from ds_core.hookspecs import HOOKSPEC_VERSION
from tests.distfactory import make_backend


def report(
    *args: str, env: dict[str, str] | None = None, limit_as: int | None = None
) -> subprocess.CompletedProcess[str]:
    def set_limit() -> None:
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, resource.RLIM_INFINITY))

    return subprocess.run(
        [sys.executable, "-m", "ds_core.cli", "report", *args],
        env={**os.environ, "DS_ACCELERATOR": "cpu", **(env or {})},
        capture_output=True,
        text=True,
        preexec_fn=set_limit,
        timeout=120,
    )


def test_report_names_the_cpu_backend_gloo_and_memory_capped_by_the_limit() -> None:
    limit = 8 * 2**30
    out = report("--json", limit_as=limit)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    sel = data["selected"]
    assert sel["name"] == "cpu" and sel["communication_backend"] == "gloo"
    assert sel["memory"]["limit_source"] == "RLIMIT_AS"
    assert sel["memory"]["total_bytes"] <= limit
    assert sel["memory"]["available_bytes"] <= limit
    assert {b["name"] for b in data["backends"]} >= {
        "cpu",
        "cuda",
        "rocm",
        "xpu",
        "hpu",
        "npu",
        "kunlunxin",
    }
    assert data["versions"]["hookspec"] == HOOKSPEC_VERSION
    assert any(op["name"] == "fused_adam" for op in sel["op_providers"])


def test_report_text_form() -> None:
    out = report()
    assert out.returncode == 0, out.stderr
    assert "selected: cpu (DS_ACCELERATOR=cpu)" in out.stdout
    assert "comm backend     gloo" in out.stdout


def test_report_exits_non_zero_and_says_why_on_a_broken_install(tmp_path: Path) -> None:
    make_backend(
        tmp_path, "wreck", dist="ds-core-wreck", version="0.3", body="import no_such_vendor_lib\n"
    )
    out = report(env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1
    assert "wreck (ds-core-wreck 0.3) failed to import: ModuleNotFoundError" in out.stderr
    assert "selected: cpu" in out.stdout  # the others still work and are shown


def test_report_fails_when_the_asked_for_backend_is_missing() -> None:
    out = report(env={"DS_ACCELERATOR": "tpux"})
    assert out.returncode == 1
    assert "no backend could be selected" in out.stderr
    assert "backend 'tpux' is not installed" in out.stdout
    assert "Known backends: cuda, rocm, xpu, hpu, npu, kunlunxin, cpu" in out.stdout
