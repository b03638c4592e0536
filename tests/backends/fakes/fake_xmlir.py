"""Recorded fakes of Kunlunxin's stack: a ``torch_xmlir`` package, device nodes, the AdamW op.

- :func:`install_xmlir` writes a ``torch_xmlir`` package into a temp folder on ``sys.path`` (so
  ``find_spec`` sees it without importing it, as on a Kunlunxin host), records each import of
  it in :data:`IMPORTS`, and creates ``xpu0 ... xpuN`` files standing in for the driver's
  ``/dev/xpuN`` nodes. Kunlunxin's torch.cuda itself is :class:`tests.backends.fakes.fake_cuda.FakeCuda`.
- :func:`register_adamw_kernel` registers ``torch.ops.custom_ops.optimizer_AdamW`` with the
  semantics DeepSpeed's KLXPU builder relies on (per-parameter AdamW with decoupled weight
  decay; ``beta*_pow = beta**step`` one-element tensors; ``exp_avg``, ``exp_avg_sq``, ``param``
  updated in place) and records every call.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

#: One entry per execution of the fake torch_xmlir's ``__init__`` (an import).
IMPORTS: list[str] = []

_PACKAGE = '''"""Fake torch_xmlir written by tests/backends/fakes/fake_xmlir.py."""
from tests.backends.fakes import fake_xmlir as _recorder

_recorder.IMPORTS.append(__name__)
'''


def install_xmlir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, nodes: int = 2) -> str:
    """Make a fake torch_xmlir findable (not imported) and create ``nodes`` device-node files.

    Use with :func:`forget_xmlir` as a fixture, which drops the imported fake afterwards.

    :returns: the glob matching the device-node stand-ins (``<tmp>/dev/xpu[0-9]*``).
    """
    site = tmp_path / "site"
    (site / "torch_xmlir").mkdir(parents=True)
    (site / "torch_xmlir" / "__init__.py").write_text(_PACKAGE)
    monkeypatch.syspath_prepend(str(site))
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    for i in range(nodes):
        (dev / f"xpu{i}").touch()
    (dev / "xpuctrl").touch()
    return str(dev / "xpu[0-9]*")


def forget_xmlir() -> Iterator[None]:
    """Generator for a fixture: drop the fake from ``sys.modules`` and :data:`IMPORTS` after."""
    IMPORTS.clear()
    yield
    sys.modules.pop("torch_xmlir", None)
    IMPORTS.clear()


# --------------------------------------------------------------------------- AdamW kernel

#: Every call of the fake op: (numel, lr, beta1_pow, beta2_pow, beta1, beta2, eps, weight_decay).
KERNEL_CALLS: list[tuple[Any, ...]] = []
_library: Any = None


def _adamw(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param: torch.Tensor,
    beta1_pow: torch.Tensor,
    beta2_pow: torch.Tensor,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    n: int,
) -> None:
    if n != param.numel():
        raise RuntimeError(f"numel argument {n} != param.numel() {param.numel()}")
    KERNEL_CALLS.append(
        (n, lr.item(), beta1_pow.item(), beta2_pow.item(), beta1, beta2, eps, weight_decay)
    )
    step_lr = lr.item()
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2_pow.item())).add_(eps)
    param.mul_(1.0 - step_lr * weight_decay)
    param.addcdiv_(exp_avg, denom, value=-step_lr / (1.0 - beta1_pow.item()))


def register_adamw_kernel() -> list[tuple[Any, ...]]:
    """Register the fake ``torch.ops.custom_ops.optimizer_AdamW`` (once per process).

    :returns: :data:`KERNEL_CALLS`, cleared.
    """
    global _library
    if _library is None:
        lib = torch.library.Library("custom_ops", "FRAGMENT")
        lib.define(
            "optimizer_AdamW(Tensor grad, Tensor(a!) exp_avg, Tensor(b!) exp_avg_sq, "
            "Tensor(c!) param, Tensor beta1_pow, Tensor beta2_pow, Tensor lr, float beta1, "
            "float beta2, float eps, float weight_decay, int n) -> ()"
        )
        lib.impl("optimizer_AdamW", _adamw, "CompositeExplicitAutograd")
        _library = lib
    KERNEL_CALLS.clear()
    return KERNEL_CALLS
