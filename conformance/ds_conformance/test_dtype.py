"""Every claimed dtype round-trips between host and device and does arithmetic."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_conformance.helpers import check
from ds_conformance.marks import hooks, promise, tier
from ds_conformance.values import rank_values, reduce

pytestmark = tier("basic")

_FLOAT8 = {getattr(torch, n) for n in dir(torch) if n.startswith("float8_")}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        from ds_conformance.plugin import suite_of

        dtypes = sorted(suite_of(metafunc.config).acc.supported_dtypes(), key=str)
        metafunc.parametrize("dtype", dtypes, ids=[str(d).removeprefix("torch.") for d in dtypes])


def _values(dtype: torch.dtype, reverse: bool = False) -> torch.Tensor:
    # Built in float64 and converted last: CPU kernels such as flip are missing for float8.
    base = torch.tensor([0, 1, 2, 3, 5, 7, 11, 13], dtype=torch.float64)
    if reverse:
        base = base.flip(0)
    if dtype == torch.bool:
        return base.remainder(2).to(torch.bool)
    return base.to(dtype)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality; float8 has no CPU comparison kernels, so its bytes are compared."""
    if a.dtype == b.dtype and a.dtype in _FLOAT8:
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@hooks("ds_dtype_supported")
@promise("ds_dtype_supported", "Return the dtypes the device stores and does arithmetic in.")
def test_round_trips(acc: Any, dtype: torch.dtype) -> None:
    host = _values(dtype)
    back = host.to(acc.device()).cpu()
    check(
        back.dtype == dtype, "dtype after round trip", back.dtype, str(dtype), "t.to(device).cpu()"
    )
    check(
        _equal(back, host),
        "values after round trip",
        back.tolist(),
        str(host.tolist()),
        "t.to(device).cpu()",
    )


@hooks("ds_dtype_supported")
@promise("ds_dtype_supported", "the conformance suite round-trips and computes in each one.")
def test_does_arithmetic(acc: Any, dtype: torch.dtype) -> None:
    a, b = _values(dtype), _values(dtype, reverse=True)
    da, db = a.to(acc.device()), b.to(acc.device())
    if dtype == torch.bool:
        got, want = (da & db) | ~da, (a & b) | ~a
    elif dtype in _FLOAT8:
        # float8 stores and converts; arithmetic runs in a wider type, as in scaled matmuls.
        got = (da.float() * db.float() + da.float()).to(dtype)
        want = (a.float() * b.float() + a.float()).to(dtype)
    else:
        got, want = da * db + da, a * b + a
    check(got.dtype == dtype, "result dtype", got.dtype, str(dtype), "a * b + a on the device")
    check(
        _equal(got.cpu(), want),
        "a * b + a",
        got.cpu().tolist(),
        str(want.tolist()),
        "on the device vs on the host",
    )


@hooks("ds_dtype_supported")
def test_keeps_every_bit_of_the_dtype(acc: Any, dtype: torch.dtype) -> None:
    """Values exact in ``dtype`` but not in a narrower type (float64 below float32's resolution,
    int64 beyond 2**53, bf16 beyond fp16's range, ...): a device that stores or adds ``dtype``
    in a narrower type returns different values."""
    if dtype in _FLOAT8:
        pytest.skip(f"{dtype} is stored and converted only (test_does_arithmetic covers it)")
    a, b = rank_values(0, 13, dtype, 2), rank_values(1, 13, dtype, 2)
    da, db = a.to(acc.device()), b.to(acc.device())
    got = {
        "round trip": da.cpu(),
        "a + b": (da + db).cpu(),
        "max(a, b)": torch.maximum(da, db).cpu(),
    }
    want = {"round trip": a, "a + b": reduce([a, b], "sum"), "max(a, b)": reduce([a, b], "max")}
    for what, value in got.items():
        check(
            value.dtype == dtype and torch.equal(value, want[what]),
            what,
            value.tolist(),
            f"{want[what].tolist()} ({dtype}, exact)",
            f"{what} on the device",
        )


@hooks("ds_dtype_supported", "ds_backend_capabilities")
@promise(
    "ds_dtype_supported",
    "The ``fp16``/``bf16``/``fp64``/``fp8`` capabilities are derived from this set.",
)
def test_dtype_capabilities_follow_the_supported_set(acc: Any) -> None:
    supported = acc.supported_dtypes()
    want = {
        "fp16": torch.float16 in supported,
        "bf16": torch.bfloat16 in supported,
        "fp64": torch.float64 in supported,
        "fp8": any(d in _FLOAT8 for d in supported),
    }
    got = {cap: cap in acc.capabilities for cap in want}
    check(
        got == want,
        "dtype capabilities declared",
        got,
        str(want),
        "capabilities vs ds_dtype_supported()",
    )
