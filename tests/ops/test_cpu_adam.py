"""cpu_adam: the compiled kernel equals the pure-PyTorch path bit for bit, and both match
torch.optim.Adam / AdamW in fp32 (assert_close rtol 1e-6, atol 1e-6, over 100 steps)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds_core import ops
from ds_core.ops import cpu_adam
from ds_core.ops.cpu_adam import DeepSpeedCPUAdam, PythonAdamKernel, load_kernel

HAVE_CC = ops.compiler_path("c") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: only the Python path exists")
# Over several 16 Ki-element chunks with a ragged tail, and above the size that goes parallel.
N = 70_001
STEPS = 100
TOL = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    saved = os.environ.get(ops.ENV_CACHE)
    os.environ[ops.ENV_CACHE] = str(tmp_path_factory.mktemp("ops_cache"))
    cpu_adam._KERNELS.clear()
    yield
    cpu_adam._KERNELS.clear()
    if saved is None:
        os.environ.pop(ops.ENV_CACHE, None)
    else:
        os.environ[ops.ENV_CACHE] = saved


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel's OpenMP team follows torch's thread count
    yield
    torch.set_num_threads(before)


def _run(
    kernel: cpu_adam.AdamKernel,
    *,
    adamw: bool,
    wd: float,
    bc: bool,
    grad_scale: float = 1.0,
    steps: int = STEPS,
    lr: float = 1e-2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(N, generator=gen)
    m, v = torch.zeros(N), torch.zeros(N)
    for step in range(1, steps + 1):
        g = torch.randn(N, generator=gen)
        kernel.step(
            p, g, m, v, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, step=step,
            bias_correction=bc, adamw_mode=adamw, grad_scale=grad_scale,
        )  # fmt: skip
    return p, m, v


COMBOS = [
    pytest.param(adamw, wd, bc, id=f"{'adamw' if adamw else 'adam'}-wd{wd}-bc{int(bc)}")
    for adamw in (True, False)
    for wd in (0.0, 0.01)
    for bc in (True, False)
]


@needs_cc
@pytest.mark.parametrize(("adamw", "wd", "bc"), COMBOS)
def test_compiled_equals_python_path_bit_for_bit(
    adamw: bool, wd: float, bc: bool, two_threads: None
) -> None:
    compiled = load_kernel("compiled")
    assert compiled.path == "compiled"
    got = _run(compiled, adamw=adamw, wd=wd, bc=bc, grad_scale=0.37)
    want = _run(PythonAdamKernel(), adamw=adamw, wd=wd, bc=bc, grad_scale=0.37)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want, strict=True):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} elements differ"


def _torch_reference(adamw: bool, wd: float, steps: int = STEPS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(N, generator=gen))
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, foreach=False)
    for _ in range(steps):
        p.grad = torch.randn(N, generator=gen)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("implementation", ["compiled", "python"])
@pytest.mark.parametrize(("adamw", "wd"), [(True, 0.0), (True, 0.01), (False, 0.0), (False, 0.01)])
def test_matches_torch_adam_and_adamw(implementation: str, adamw: bool, wd: float) -> None:
    if implementation == "compiled" and not HAVE_CC:
        pytest.skip("no C compiler")
    kernel = load_kernel(implementation)  # type: ignore[arg-type]
    p, _, _ = _run(kernel, adamw=adamw, wd=wd, bc=True)
    torch.testing.assert_close(p, _torch_reference(adamw, wd), **TOL)


def test_without_bias_correction_matches_float64_formula() -> None:
    # torch.optim has no bias_correction=False; the reference is the formula in float64.
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(N, generator=gen).double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.01
    for _ in range(STEPS):
        g = torch.randn(N, generator=gen).double()
        p.mul_(1 - lr * wd)
        m.mul_(b1).add_((1 - b1) * g)
        v.mul_(b2).add_((1 - b2) * g * g)
        p.sub_(lr * m / (v.sqrt() + eps))
    got, _, _ = _run(load_kernel(), adamw=True, wd=wd, bc=False)
    # fp32 against fp64 over 100 steps: the fp32 rounding itself, not a kernel difference.
    torch.testing.assert_close(got.double(), p, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["compiled", "python"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_copy_out_rounds_like_torch(implementation: str, dtype: torch.dtype) -> None:
    if implementation == "compiled" and not HAVE_CC:
        pytest.skip("no C compiler")
    kernel = load_kernel(implementation)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(N, generator=gen) * 100
    # Values at the edges of rounding: ties, overflow, subnormals, signed zeros, inf, NaN.
    special = torch.tensor(
        [0.0, -0.0, 1.00390625, 1.01171875, 65520.0, 1e-8, -1e-40, 3.4e38,
         float("inf"), float("-inf"), float("nan")]
    )  # fmt: skip
    p[: special.numel()] = special
    g, m, v = torch.zeros(N), torch.zeros(N), torch.zeros(N)
    out = torch.empty(N, dtype=dtype)
    # lr 0 and zero gradients leave p as is, so the copy-out is checked on chosen values.
    kernel.step(p, g, m, v, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1,
                out16=out)  # fmt: skip
    want = p.to(dtype)
    assert torch.equal(out.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(out[ok], want[ok]), f"{(out[ok] != want[ok]).sum().item()} differ"
    assert torch.equal(out[ok].view(torch.int16), want[ok].view(torch.int16))  # signed zeros


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streamed_16bit_copy_out_equals_python_path(dtype: torch.dtype, two_threads: None) -> None:
    # Above stream_min the copy-out goes through a staging block and non-temporal stores, after
    # a plain-store head up to the copy's first 64-byte boundary; a ragged tail ends it.
    compiled = load_kernel("compiled")
    assert isinstance(compiled, cpu_adam.CompiledAdamKernel)
    n = compiled.stream_min + 4099
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen) * 100
    special = torch.tensor([1.00390625, 65520.0, -1e-40, 3.4e38, float("inf"), float("nan")])
    p0[3 : 3 + special.numel()] = special  # in the plain-store head
    p0[-special.numel() :] = special  # in the tail
    p0[n // 2 : n // 2 + special.numel()] = special  # in a streamed block
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    got = []
    for kernel in (compiled, PythonAdamKernel()):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        buf = torch.zeros(n + 40, dtype=dtype)
        out = buf[5 : 5 + n]
        for step, g in enumerate(grads, start=1):
            kernel.step(p, g, m, v, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                        step=step, grad_scale=0.37, out16=out)  # fmt: skip
        got.append((p, m, v, buf))
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "out16"), *got, strict=True):
        same = (a == b) | (a.isnan() & b.isnan())
        assert bool(same.all()), f"{name}: {(~same).sum().item()} elements differ"
    p, _, _, buf = got[0]
    want = p.to(dtype)
    ok = ~want.isnan()
    assert torch.equal(buf[5 : 5 + n][ok].view(torch.int16), want[ok].view(torch.int16))
    assert not bool(buf[:5].view(torch.int16).any()) and not bool(
        buf[5 + n :].view(torch.int16).any()
    )


def test_unscale_and_clip_in_the_same_pass_equals_scaling_first() -> None:
    kernel = load_kernel()
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(N, generator=gen), torch.randn(N, generator=gen) * 1024
    a, b = p0.clone(), p0.clone()
    ma, va, mb, vb = (torch.zeros(N) for _ in range(4))
    kw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "step": 1}
    kernel.step(a, g, ma, va, grad_scale=0.25 / 1024, **kw)  # type: ignore[arg-type]
    kernel.step(b, g * (0.25 / 1024), mb, vb, **kw)  # type: ignore[arg-type]
    assert torch.equal(a, b) and torch.equal(ma, mb) and torch.equal(va, vb)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


@pytest.mark.parametrize("implementation", ["auto", "python"])
def test_optimizer_matches_torch_adamw_on_a_model(implementation: str) -> None:
    ours, ref = _model(), _model()
    unused = torch.nn.Parameter(torch.ones(3))  # never gets a gradient: must stay untouched
    groups = [
        {"params": [*ours[0].parameters(), unused], "weight_decay": 0.1},
        {"params": list(ours[2].parameters()), "lr": 3e-3},
    ]
    opt = DeepSpeedCPUAdam(groups, lr=1e-2, weight_decay=0.0, implementation=implementation)  # type: ignore[arg-type]
    ref_opt = torch.optim.AdamW(
        [
            {"params": list(ref[0].parameters()), "weight_decay": 0.1},
            {"params": list(ref[2].parameters()), "lr": 3e-3},
        ],
        lr=1e-2,
        weight_decay=0.0,
        foreach=False,
    )
    gen = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=gen)
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert torch.equal(unused, torch.ones(3)) and unused not in opt.state


def test_non_contiguous_parameter_takes_the_python_path_with_equal_results() -> None:
    base = torch.randn(64, 48)
    t = torch.nn.Parameter(base.t())  # a transposed (non-contiguous) view
    c = torch.nn.Parameter(base.t().contiguous())
    opt_t, opt_c = DeepSpeedCPUAdam([t], lr=1e-2), DeepSpeedCPUAdam([c], lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        g = torch.randn(48, 64, generator=gen)
        t.grad, c.grad = g.t().contiguous().t(), g.clone()
        opt_t.step()
        opt_c.step()
    assert not t.is_contiguous() and torch.equal(t, c)


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], amsgrad=True)
    with pytest.raises(ValueError, match="fp32_optimizer_states"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], fp32_optimizer_states=False)
    half = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    half.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 host tensors"):
        DeepSpeedCPUAdam([half]).step()
    with pytest.raises(ValueError, match="DS_CORE_CPU_ADAM"):
        load_kernel("fast")  # type: ignore[arg-type]


def test_no_compiler_falls_back_to_python_and_says_so(tmp_path: Path) -> None:
    code = (
        "import ds_core.ops.cpu_adam as c\n"
        "p = c.cpu_adam_provider()\n"
        "print(p.is_compatible()[1])\n"
        "k = c.load_kernel()\n"
        "print(k.path)\n"
        "print(c.kernel_status())\n"
        "try:\n"
        "    c.load_kernel('compiled')\n"
        "except c.OpBuildError as e:\n"
        "    print('compiled:', str(e).splitlines()[0])\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), **{ops.ENV_CACHE: str(tmp_path)})
    env.pop(cpu_adam.ENV_IMPL, None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    lines = done.stdout.splitlines()
    assert lines[0].startswith("pure-PyTorch path: no C compiler")
    assert lines[1] == "python"
    assert lines[2].startswith("active: pure-PyTorch path")
    assert lines[3].startswith("compiled: op 'cpu_adam' needs a C compiler")
    assert "using the pure-PyTorch path" in done.stderr  # one warning, not silence


def test_compatibility_check_starts_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("is_compatible started a process")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    ok, reason = cpu_adam.cpu_adam_provider().is_compatible()
    assert ok and reason


@needs_cc
def test_report_says_which_path_is_active() -> None:
    load_kernel()
    status = cpu_adam.cpu_adam_provider().status()
    assert status.startswith("active: compiled kernel"), status


@needs_cc
def test_bandwidth_probe_moves_the_bytes_it_claims() -> None:
    kernel = load_kernel("compiled")
    assert isinstance(kernel, cpu_adam.CompiledAdamKernel)
    p, g, m, v = (torch.full((N,), float(i)) for i in range(4))
    kernel.touch(p, g, m, v)
    assert torch.equal(p, torch.full((N,), 1.0)) and torch.equal(v, torch.full((N,), 4.0))
    assert torch.equal(m, torch.full((N,), 3.0)) and torch.equal(g, torch.full((N,), 1.0))


@needs_cc
@pytest.mark.parametrize("size", ["cached", "streamed"])
def test_bandwidth_probe_writes_the_16bit_copy_like_the_step(size: str, two_threads: None) -> None:
    kernel = load_kernel("compiled")
    assert isinstance(kernel, cpu_adam.CompiledAdamKernel)
    n = N if size == "cached" else kernel.stream_min + 4099
    gen = torch.Generator().manual_seed(6)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    want = p + g
    buf = torch.full((n + 40,), 7.0, dtype=torch.bfloat16)
    out = buf[7 : 7 + n]  # not 64-byte aligned: a plain-store head before the streamed part
    kernel.touch(p, g, m, v, out)
    assert torch.equal(p, want) and torch.equal(m, g) and torch.equal(v, g)
    # The upper half of each new fp32 value (truncation: the probe moves bytes, not rounding).
    assert torch.equal(out.view(torch.int16), (want.view(torch.int32) >> 16).to(torch.int16))
    assert torch.equal(buf[:7], torch.full((7,), 7.0, dtype=torch.bfloat16))
    assert torch.equal(buf[7 + n :], torch.full((33,), 7.0, dtype=torch.bfloat16))


def test_ds_core_report_lists_cpu_adam_with_its_active_path() -> None:
    from ds_core.cli import collect_report, format_report

    report, _problems = collect_report()
    ops_listed = {op["name"]: op for op in report["selected"]["op_providers"]}
    assert ops_listed["cpu_adam"]["compatible"] is True
    assert ops_listed["cpu_adam"]["status"] == cpu_adam.kernel_status()
    assert "status" in format_report(report)
