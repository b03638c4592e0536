"""cpu_adam: Adam / AdamW on the host, a compiled SIMD + OpenMP kernel with a pure-PyTorch twin.

Both paths compute every element through the same sequence of correctly rounded fp32
operations (the list is in ``csrc/cpu_adam.c``), so they give bit-for-bit identical results
and the Python path is a true fallback, not an approximation. Against ``torch.optim.AdamW``
(and ``Adam``) they differ only by rounding order: within 1e-6 relative over 100 steps
(``tests/ops/test_cpu_adam.py``).

The compiled kernel is a plain C shared library built through :mod:`ds_core.ops` and called
with ``ctypes`` on ``data_ptr()`` (no pybind11, no torch C++ ABI, about a second to build); its
functions are declared once, in :data:`SIGNATURES`, which the build checks against the C.

Which path runs: ``DS_CORE_CPU_ADAM`` = ``auto`` (default: compiled when a C compiler builds
it, else Python with one warning), ``compiled`` (fail if it cannot build) or ``python``.
``ds-core report`` shows the active path.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from ds_core.ops._cache import OpBuildError  # noqa: F401  (callers catch it from here)
from ds_core.ops._native import NativeLib
from ds_core.ops._signatures import Signatures
from ds_core.ops._toolchain import compiler_path, toolchain

__all__ = [
    "ENV_IMPL",
    "AdamKernel",
    "CPUAdamProvider",
    "CompiledAdamKernel",
    "DeepSpeedCPUAdam",
    "PythonAdamKernel",
    "cpu_adam_provider",
    "load_kernel",
]

log = logging.getLogger("ds_core.ops")

#: Chooses the implementation: ``auto`` | ``compiled`` | ``python``.
ENV_IMPL = "DS_CORE_CPU_ADAM"
Implementation = Literal["auto", "compiled", "python"]
_SOURCE = Path(__file__).with_name("csrc") / "cpu_adam.c"
# -ffp-contract=off keeps a*b+c as two roundings (no FMA), which the bit-for-bit contract with
# the Python path needs; -fno-math-errno lets sqrtf vectorise and changes no result.
_CFLAGS = ("-std=c11", "-ffp-contract=off", "-fno-math-errno", "-Wall")
_OUT_KIND = {None: 0, torch.bfloat16: 1, torch.float16: 2}
_FP32_BUFFERS = ("float *", "const float *", "float *", "float *")
#: The kernel's functions, checked against ``csrc/cpu_adam.c`` when it is built.
SIGNATURES: Signatures = {
    "ds_cpu_adam_step": (
        "int",
        (*_FP32_BUFFERS, "int64_t", *("float",) * 10, "int", "void *", "int", "int"),
    ),
    "ds_cpu_adam_touch": ("void", (*_FP32_BUFFERS, "int64_t", "void *", "int")),
    "ds_cpu_adam_isa": ("const char *", ()),
    "ds_cpu_adam_openmp": ("int", ()),
    "ds_cpu_adam_has_fp16": ("int", ()),
    "ds_cpu_adam_stream_min": ("int64_t", ()),
}


@dataclass(frozen=True, slots=True)
class _Scalars:
    """The per-step constants, computed in double and handed to both paths as fp32."""

    grad_scale: float
    l2: float  # Adam mode: weight decay folded into the gradient (0 in AdamW mode)
    decay: float  # AdamW mode: 1 - lr * weight_decay (1 in Adam mode)
    beta1: float
    omb1: float
    beta2: float
    omb2: float
    inv_bc2_sqrt: float
    eps: float
    step_size: float
    adam_l2: bool


def _scalars(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool,
    adamw_mode: bool,
    grad_scale: float,
) -> _Scalars:
    beta1, beta2 = float(betas[0]), float(betas[1])
    lr, wd = float(lr), float(weight_decay)
    if bias_correction:
        bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    else:
        bc1 = bc2 = 1.0
    return _Scalars(
        grad_scale=float(grad_scale),
        l2=0.0 if adamw_mode else wd,
        decay=1.0 - lr * wd if adamw_mode else 1.0,
        beta1=beta1,
        omb1=1.0 - beta1,
        beta2=beta2,
        omb2=1.0 - beta2,
        inv_bc2_sqrt=1.0 / bc2**0.5,
        eps=float(eps),
        step_size=lr / bc1,
        adam_l2=(not adamw_mode) and wd != 0.0,
    )


class AdamKernel(Protocol):
    """One Adam step over flat fp32 tensors, in place. Both implementations satisfy it."""

    #: ``"compiled"`` or ``"python"``.
    path: str

    def describe(self) -> str: ...

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        step: int,
        bias_correction: bool = True,
        adamw_mode: bool = True,
        grad_scale: float = 1.0,
        out16: torch.Tensor | None = None,
    ) -> None:
        """Update ``param``, ``exp_avg``, ``exp_avg_sq`` in place (all fp32, host, same size).

        :param step: the step number after this update (1 for the first), for bias correction.
        :param grad_scale: multiplies the gradient first (1 / loss scale × clip coefficient).
        :param out16: optional bf16/fp16 tensor of the same size receiving the new parameters.
        :raises ValueError: on a dtype, device, size or layout the kernel cannot take.
        """
        ...


def _check(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out16: torch.Tensor | None,
    contiguous: bool,
) -> None:
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for what, t in named.items():
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(
                f"cpu_adam: {what} is {t.dtype} on {t.device}; it takes float32 host tensors "
                "(keep an fp32 master copy and use out16 for the 16-bit parameters)"
            )
        if t.numel() != param.numel():
            raise ValueError(f"cpu_adam: {what} has {t.numel()} elements, param {param.numel()}")
        if contiguous and not t.is_contiguous():
            raise ValueError(f"cpu_adam: {what} is not contiguous")
    if out16 is not None:
        if out16.dtype not in (torch.bfloat16, torch.float16) or out16.device.type != "cpu":
            raise ValueError(
                f"cpu_adam: out16 is {out16.dtype} on {out16.device}; expected "
                "bfloat16 or float16 on the host"
            )
        if out16.numel() != param.numel() or (contiguous and not out16.is_contiguous()):
            raise ValueError("cpu_adam: out16 must be contiguous with param's number of elements")


_SQRT_CHUNK = 1 << 20


def _sqrt_correctly_rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root rounded like IEEE ``sqrtf`` (the kernel's), which ``torch.sqrt`` is not.

    torch's CPU sqrt goes through a vector math library that may be off by one ulp. The square
    root of a float computed in double and rounded to float is the correctly rounded result
    (53 >= 2 * 24 + 2 bits), so it is taken in double, a chunk at a time to bound memory.
    """
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.float32)
    for lo in range(0, flat.numel(), _SQRT_CHUNK):
        out[lo : lo + _SQRT_CHUNK] = flat[lo : lo + _SQRT_CHUNK].double().sqrt_()
    return out.view(x.shape)


class PythonAdamKernel:
    """The pure-PyTorch path: one torch op per line of the kernel's arithmetic."""

    path = "python"

    def describe(self) -> str:
        return "pure-PyTorch path"

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        step: int,
        bias_correction: bool = True,
        adamw_mode: bool = True,
        grad_scale: float = 1.0,
        out16: torch.Tensor | None = None,
    ) -> None:
        _check(param, grad, exp_avg, exp_avg_sq, out16, contiguous=False)
        s = _scalars(lr, betas, eps, weight_decay, step, bias_correction, adamw_mode, grad_scale)
        with torch.no_grad():
            # Only single-rounding ops: add/sub/mul by a tensor or a scalar (torch rounds the
            # scalar to fp32, as the kernel's arguments are), sqrt, and tensor / tensor. No
            # alpha= or addcmul, whose vector forms may fuse a multiply-add.
            g = grad * s.grad_scale
            if s.adam_l2:
                g = g + param * s.l2
            param.mul_(s.decay)
            exp_avg.mul_(s.beta1).add_(g * s.omb1)
            exp_avg_sq.mul_(s.beta2).add_((g * g).mul_(s.omb2))
            denom = _sqrt_correctly_rounded(exp_avg_sq).mul_(s.inv_bc2_sqrt).add_(s.eps)
            param.sub_((exp_avg / denom).mul_(s.step_size))
            if out16 is not None:
                out16.copy_(param)


class CompiledAdamKernel:
    """The compiled SIMD + OpenMP kernel. Threads: ``torch.get_num_threads()`` at each call.

    The library links ``libgomp.so.1``; torch's wheel has already loaded its own copy under
    that name, so the loader binds ours to it and the process keeps one OpenMP thread pool
    (two pools would oversubscribe the cores).
    """

    path = "compiled"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._step = lib.ds_cpu_adam_step  # typed from SIGNATURES by build_shared_library
        self._touch = lib.ds_cpu_adam_touch
        self.isa: str = lib.ds_cpu_adam_isa().decode()
        self.openmp = bool(lib.ds_cpu_adam_openmp())
        self.has_fp16 = bool(lib.ds_cpu_adam_has_fp16())
        #: Elements from which the 16-bit copy-out bypasses the caches (non-temporal stores).
        self.stream_min: int = lib.ds_cpu_adam_stream_min()

    def touch(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        out16: torch.Tensor | None = None,
    ) -> None:
        """Move an Adam step's bytes with no Adam arithmetic (``p, m, v += g``; with ``out16``,
        also write the new ``p``'s upper 16 bits there, stored as the step stores its copy),
        for measuring the update's memory-bandwidth bound. Contiguous fp32 host tensors of one
        size; ``out16`` bf16 or fp16 of that size.

        :raises ValueError: on a dtype, device, size or layout the kernel cannot take.
        """
        _check(p, g, m, v, out16, contiguous=True)
        self._touch(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(),
                    None if out16 is None else out16.data_ptr(), torch.get_num_threads())  # fmt: skip

    def describe(self) -> str:
        threads = "OpenMP" if self.openmp else "single-threaded (no OpenMP)"
        return f"compiled kernel: {self.isa}, {threads}"

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        step: int,
        bias_correction: bool = True,
        adamw_mode: bool = True,
        grad_scale: float = 1.0,
        out16: torch.Tensor | None = None,
    ) -> None:
        _check(param, grad, exp_avg, exp_avg_sq, out16, contiguous=True)
        if out16 is not None and out16.dtype == torch.float16 and not self.has_fp16:
            raise ValueError("cpu_adam: this compiler has no _Float16; use bfloat16 for out16")
        s = _scalars(lr, betas, eps, weight_decay, step, bias_correction, adamw_mode, grad_scale)
        rc = self._step(
            param.data_ptr(),
            grad.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            param.numel(),
            s.grad_scale,
            s.l2,
            s.decay,
            s.beta1,
            s.omb1,
            s.beta2,
            s.omb2,
            s.inv_bc2_sqrt,
            s.eps,
            s.step_size,
            int(s.adam_l2),
            None if out16 is None else out16.data_ptr(),
            _OUT_KIND[None if out16 is None else out16.dtype],
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(
                f"cpu_adam: the kernel rejected out16 of dtype {out16 and out16.dtype}"
            )


def _build_args() -> dict[str, Any]:
    return {"cflags": _CFLAGS, "openmp": toolchain().openmp}


_NATIVE: NativeLib[AdamKernel] = NativeLib(
    "cpu_adam",
    [_SOURCE],
    SIGNATURES,
    env=ENV_IMPL,
    compiled="compiled kernel",
    python="pure-PyTorch path",
    build_args=_build_args,
    log=log,
)
_KERNELS = _NATIVE.loaded  # choice -> kernel (tests clear it)


def load_kernel(implementation: Implementation | None = None) -> AdamKernel:
    """Return the Adam kernel: compiled (built on first use) or the pure-PyTorch path.

    :param implementation: ``auto`` (compiled if it builds, else Python with one warning),
        ``compiled`` or ``python``; ``None`` reads ``DS_CORE_CPU_ADAM`` (default ``auto``).
    :raises OpBuildError: with ``compiled`` when the kernel cannot be built.
    :raises ValueError: for an unknown implementation name.
    """
    return _NATIVE.load(implementation, CompiledAdamKernel, PythonAdamKernel)


def kernel_status() -> str:
    """Which path is (or would be) active, for ``ds-core report``. Builds nothing."""
    return _NATIVE.status()


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for fp32 parameters on the host, with DeepSpeed's constructor arguments.

    :param model_params: parameters or parameter groups (fp32, on the host).
    :param lr: learning rate. ``betas``, ``eps``: as :class:`torch.optim.Adam`.
    :param bias_correction: apply Adam's bias correction (Default: True).
    :param weight_decay: decoupled (``adamw_mode``) or L2 weight decay (Default: 0).
    :param amsgrad: not supported (raises ``ValueError``), as in DeepSpeed.
    :param adamw_mode: AdamW's decoupled weight decay when True, Adam's L2 when False
        (Default: True).
    :param fp32_optimizer_states: only True is supported (16-bit moments are not yet).
    :param implementation: ``auto``, ``compiled`` or ``python`` (see :func:`load_kernel`).

    ``step(closure=None, grad_scale=1.0)``: ``grad_scale`` multiplies every gradient first
    (unscale and clip in the same pass). Tensors the kernel cannot take in place
    (non-contiguous) go through the Python path, which gives the same result.
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        implementation: Implementation | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdam: amsgrad=True is not supported; use amsgrad=False")
        if not fp32_optimizer_states:
            raise ValueError(
                "DeepSpeedCPUAdam: fp32_optimizer_states=False (16-bit moments) is not supported "
                "yet; use fp32_optimizer_states=True"
            )
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"DeepSpeedCPUAdam: invalid lr={lr}, eps={eps} or betas={betas}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=False,
        )
        super().__init__(model_params, defaults)
        self.adamw_mode = adamw_mode
        self.kernel: AdamKernel = load_kernel(implementation)
        self._python = PythonAdamKernel()

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0
    ) -> float | None:
        """One update of every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("DeepSpeedCPUAdam does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
                kernel = self.kernel
                if not all(t.is_contiguous() for t in tensors):
                    kernel = self._python
                kernel.step(
                    *tensors,
                    lr=group["lr"],
                    betas=group["betas"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=state["step"],
                    bias_correction=group["bias_correction"],
                    adamw_mode=self.adamw_mode,
                    grad_scale=grad_scale,
                )
        return loss


@dataclass(frozen=True, slots=True)
class CPUAdamProvider:
    """The ``cpu_adam`` op provider: ``load()`` returns :class:`DeepSpeedCPUAdam`."""

    name: str = "cpu_adam"

    def is_compatible(self) -> tuple[bool, str]:
        """Always compatible (the Python path runs anywhere); says which path is expected.

        Starts no process and builds nothing: only ``PATH`` is searched.
        """
        if os.environ.get(ENV_IMPL) == "python":
            return True, f"pure-PyTorch path ({ENV_IMPL}=python)"
        cc = compiler_path("c")
        if cc is None:
            return True, "pure-PyTorch path: no C compiler found (same results, slower)"
        return True, f"compiled SIMD + OpenMP kernel, built with {cc} on first use"

    def load(self) -> type[DeepSpeedCPUAdam]:
        load_kernel()  # build now, so a failure shows at load, not in the first step
        return DeepSpeedCPUAdam

    def status(self) -> str:
        """Which path is active or would be, and whether the kernel is built (for reports)."""
        return kernel_status()


def cpu_adam_provider() -> CPUAdamProvider:
    """The provider a backend returns from ``ds_op_providers`` to offer ``cpu_adam``."""
    return CPUAdamProvider()
