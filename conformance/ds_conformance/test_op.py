"""Op providers: compatibility checks without side effects; loaded ops match a reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ds_conformance.helpers import SNAPSHOT, check, run_python, undocumented_modules
from ds_conformance.marks import hooks, promise, tier

pytestmark = tier("ops")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "op_name" in metafunc.fixturenames:
        from ds_conformance.plugin import suite_of

        names = sorted({p.name for p in suite_of(metafunc.config).acc.op_providers()})
        if not names:
            names = ["no-op-providers"]
        metafunc.parametrize("op_name", names)


def _provider(acc: Any, name: str) -> Any:
    if name == "no-op-providers":
        pytest.skip(f"backend '{acc.name}' lists no op providers")
    return acc.get_op(name)


@pytest.fixture(scope="session")
def compat_effects(acc: Any) -> dict[str, Any]:
    """Run every provider's ``is_compatible`` in a fresh process and measure what it changed."""
    return run_python(  # type: ignore[no-any-return]
        SNAPSHOT
        + f"""
from ds_core import get_accelerator
acc = get_accelerator()
out = {{}}
for p in acc.op_providers():
    before = snapshot()
    ok, reason = p.is_compatible()
    again = p.is_compatible()
    out[p.name] = dict(diff(before, {acc.device_type!r}), ok=ok, reason=reason, again=list(again))
import importlib.metadata as md
out["__backends__"] = sorted(set(e.value.split(":")[0].split(".")[0]
                                 for e in md.entry_points(group="ds_core.backends")))
print(json.dumps(out))
"""
    )


@hooks("ds_op_providers")
@promise(
    "ds_op_providers",
    "Calling this hook and ``is_compatible`` must not build, load, or touch a device",
)
def test_compatibility_check_has_no_side_effects(
    acc: Any, compat_effects: dict[str, Any], op_name: str
) -> None:
    _provider(acc, op_name)
    effect = compat_effects[op_name]
    call = f"get_op({op_name!r}).is_compatible()"
    check(
        isinstance(effect["ok"], bool) and isinstance(effect["reason"], str),
        "(compatible, reason)",
        (effect["ok"], effect["reason"]),
        "(bool, str)",
        call,
    )
    check(
        [effect["ok"], effect["reason"]] == effect["again"],
        "second answer",
        effect["again"],
        f"the first {[effect['ok'], effect['reason']]}",
        call,
    )
    check(not effect["contexts"], "device contexts created", effect["contexts"], "none", call)
    check(effect["new_threads"] <= 0, "threads started", effect["new_threads"], "0", call)
    # ds_core backend packages follow the same import rules; importing one is not a side effect.
    modules = undocumented_modules(effect, set(compat_effects["__backends__"]))
    check(not modules, "modules imported", modules, "none beyond the standard library", call)


def _adamw_reference(cls: Callable[..., torch.optim.Optimizer], device: torch.device) -> None:
    # The reference is AdamW's arithmetic written out in float64, not another torch.optim
    # class: comparing torch's fused AdamW with torch's unfused one would test torch, not the
    # backend's op.
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(37, 5, generator=gen), torch.randn(11, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(5)]
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.99), 1e-8, 0.01
    params = [p.clone().to(device).requires_grad_() for p in start]
    opt = cls(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    want = [p.double() for p in start]
    m = [torch.zeros_like(p) for p in want]
    v = [torch.zeros_like(p) for p in want]
    for t, step in enumerate(grads, start=1):
        for p, g in zip(params, step, strict=True):
            p.grad = g.to(device)
        opt.step()
        for w, mi, vi, g in zip(want, m, v, step, strict=True):
            g64 = g.double()
            w.mul_(1 - lr * wd)
            mi.mul_(b1).add_((1 - b1) * g64)
            vi.mul_(b2).add_((1 - b2) * g64 * g64)
            denom = (vi / (1 - b2**t)).sqrt() + eps
            w.sub_(lr / (1 - b1**t) * mi / denom)
    for i, (got, ref) in enumerate(zip(params, want, strict=True)):
        got64 = got.detach().cpu().double()
        err = float((got64 - ref).abs().max())
        check(
            torch.allclose(got64, ref, rtol=1e-5, atol=1e-6),
            f"parameter {i} after {len(grads)} steps (max abs error {err:.2e})",
            "different",
            "AdamW computed in float64 (rtol 1e-5, atol 1e-6)",
            "the loaded optimizer",
        )


def _quantizer_reference(op: Any, device: torch.device) -> None:
    # Block quantization and the 1-bit compression written out in float64 from their
    # definitions (hookspecs/op.py), on the device when the op runs there, else the host.
    where = device if op.accepts(torch.zeros(1, device=device)) else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 70, generator=gen) * 3
    x[0, :4] = 0
    for bits in (8, 4):
        codes, scales = op.quantize(x.to(where), bits, 16)
        back = op.dequantize(codes, scales, bits, 70, 16).cpu().double()
        qmax = 2 ** (bits - 1) - 1
        want = torch.zeros_like(back)
        for lo in range(0, 70, 14):  # 70 values in blocks of at most 16: 5 blocks of 14
            blk = x[:, lo : lo + 14].double()
            absmax = blk.abs().amax(dim=1, keepdim=True)
            scale = absmax / qmax
            q = torch.where(absmax > 0, (blk / scale).round().clamp(-qmax, qmax), 0 * blk)
            want[:, lo : lo + 14] = q * scale
        err = float((back - want).abs().max())
        check(
            torch.allclose(back, want, rtol=1e-5, atol=1e-6),
            f"{bits}-bit block quantization round trip (max abs error {err:.2e})",
            "different",
            "the symmetric block quantization computed in float64 (rtol 1e-5, atol 1e-6)",
            "the loaded quantizer",
        )
    y = torch.randn(64, generator=gen)
    packed, scale, error = op.onebit_compress(y.to(where))
    y64 = y.double()
    signs = torch.where(y64 < 0, -1.0, 1.0).double()
    want_scale = y64.norm() / 8.0
    expanded = op.onebit_expand(packed.reshape(1, 8), scale.reshape(1)).cpu().double()
    ok = (
        abs(float(scale) - float(want_scale)) <= 1e-5 * float(want_scale)
        and torch.allclose(expanded, want_scale * signs, rtol=1e-5)
        and torch.allclose(error.cpu().double(), y64 - want_scale * signs, rtol=1e-4, atol=1e-5)
    )
    check(
        ok,
        "1-bit compression of 64 values (scale, signs, error)",
        "different",
        "||x|| / sqrt(n), the signs of x, x - scale * sign, computed in float64",
        "the loaded quantizer",
    )


# Well-known op names and how to check one (hookspecs/op.py names them); other names skip.
REFERENCES: dict[str, Callable[[Any, torch.device], None]] = {
    "fused_adam": lambda op, device: _adamw_reference(op, device),
    "cpu_adam": lambda op, device: _adamw_reference(op, torch.device("cpu")),
    "quantizer": _quantizer_reference,
}


@hooks("ds_op_providers")
@promise("ds_op_providers", "Return the op providers this plugin offers")
@promise("ds_op_providers", "Well-known names:")
def test_compatible_op_loads_and_matches_its_reference(acc: Any, op_name: str) -> None:
    provider = _provider(acc, op_name)
    ok, reason = provider.is_compatible()
    if not ok:
        pytest.skip(f"op {op_name} reports itself incompatible here: {reason}")
    loaded = provider.load()
    check(loaded is not None, f"get_op({op_name!r}).load()", None, "the op", "OpProvider.load")
    reference = REFERENCES.get(op_name)
    if reference is None:
        pytest.skip(f"this suite version has no reference computation for op {op_name!r}")
    reference(loaded, acc.device())
