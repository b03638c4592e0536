"""The diagnostic variants of 1-bit Adam and 0/1 Adam that ``bench/compression.py`` runs beside
them, to tell apart the causes of their loss gaps to uncompressed training. 1-bit Adam's (not
DeepSpeed modes):

- ``onebit_adam_exact``: after the freeze, the exact mean of the ranks' momenta (an fp32
  all-reduce) in place of the compressed all-reduce; each rank still hands over and clips its
  own gradient, and the variance stays frozen. Against ``onebit_adam``: the compression error.
- ``onebit_adam_frozen``: after the freeze the engine keeps averaging the gradients (and
  clipping the average, as in warm-up); the momenta are then equal on every rank and their
  "mean" is a copy; only the variance is frozen. Against ``onebit_adam_exact``: clipping each
  rank's own gradient; against the uncompressed reference: the frozen variance.

0/1 Adam's, each with 0/1 Adam's ``var_freeze_step`` (the freeze step):

- ``zero_one_adam_exact``: the exact mean in place of both compressed all-reduces (of the
  gradients between variance updates, of the accumulated update after the freeze); each rank
  still clips its own gradient on those steps. Against ``zero_one_adam``: the compression error.
- ``zero_one_adam_avg``: the engine averages (and clips the average of) every step's gradients
  and the "mean" is a copy: Adam whose variance updates only on 0/1 Adam's schedule (at
  intervals doubling every ``var_update_scaler`` updates) and freezes after ``var_freeze_step``.
  Against ``zero_one_adam_exact``: clipping each rank's own gradient; against the reference:
  the variance schedule.
- ``zero_one_adam_dense``: a DeepSpeed setting, not a patch: ``var_update_scaler`` beyond the
  run, so the variance updates on every step until ``var_freeze_step`` (no compressed gradient
  steps; the frozen phase is 0/1 Adam's). Against ``zero_one_adam``: the thinned variance
  updates and the compressed gradients between them.
- ``zero_one_adam_nofreeze``: a DeepSpeed setting: ``var_freeze_step`` beyond the run, as
  DeepSpeed's 0/1 Adam tutorial (its documentation site's "0/1 Adam" page) says it may be set;
  the variance keeps its doubling schedule (``var_update_scaler`` 16) and every step between
  its updates is a compressed gradient step. Against ``zero_one_adam``: the frozen phase.

With a learning-rate warm-up (DeepSpeed's ``WarmupLR``, linear from 0 to the optimizer's lr
over the freeze step's count of steps, then constant; the tutorial's setting makes
``var_freeze_step`` the end of the warm-up), against ``onebit_adam_nc_warmup`` (the reference,
never compressing, with the same warm-up): ``onebit_adam_warmup`` (``freeze_step``),
``zero_one_adam_warmup`` (``var_freeze_step``), and 0/1 Adam's three split variants with the
warm-up, ``zero_one_adam_{exact,avg,dense}_warmup`` (each as above, plus the warm-up).

``python bench/compression_variants.py`` prints :func:`overstatement` (how far a 1-bit gradient
overstates the elements whose own gradients are small).

The patched variants replace the optimizer module's reference to the compressed all-reduce in
the rank's process for the one configuration (:func:`apply`), and undo it after (the returned
function).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VARIANTS = (
    "onebit_adam_exact",
    "onebit_adam_frozen",
    "zero_one_adam_exact",
    "zero_one_adam_avg",
    "zero_one_adam_dense",
    "zero_one_adam_nofreeze",
    "onebit_adam_nc_warmup",
    "onebit_adam_warmup",
    "zero_one_adam_warmup",
    "zero_one_adam_exact_warmup",
    "zero_one_adam_avg_warmup",
    "zero_one_adam_dense_warmup",
)
#: the variants whose engine keeps averaging gradients after every step (:func:`adjust`)
_AVERAGED = ("onebit_adam_frozen", "zero_one_adam_avg")
#: the variants that replace the compressed all-reduce (:func:`apply`)
_PATCHED = ("onebit_adam_exact", "onebit_adam_frozen", "zero_one_adam_exact", "zero_one_adam_avg")
_WARMUP = tuple(v for v in VARIANTS if v.endswith("_warmup"))
#: a count no run reaches (a step, a number of updates)
_NEVER = 10**9


def _base(name: str) -> str:
    """The variant ``name`` without its learning-rate warm-up (the warm-up is its only change)."""
    return name.removesuffix("_warmup")


def optimizer(name: str, lr: float, freeze: int) -> dict[str, Any] | None:
    """The DeepSpeed ``optimizer`` config block of variant ``name`` (``None``: not a variant)."""
    if name.startswith("onebit_adam_") and name in VARIANTS:
        never = name == "onebit_adam_nc_warmup"
        return {
            "type": "OneBitAdam",
            "params": {"lr": lr, "freeze_step": _NEVER if never else freeze},
        }
    if name.startswith("zero_one_adam_") and name in VARIANTS:
        params: dict[str, Any] = {"lr": lr, "var_freeze_step": freeze}
        if _base(name) == "zero_one_adam_dense":
            params["var_update_scaler"] = _NEVER
        if name == "zero_one_adam_nofreeze":
            params["var_freeze_step"] = _NEVER
        return {"type": "ZeroOneAdam", "params": params}
    return None


def scheduler(name: str, lr: float, freeze: int) -> dict[str, Any] | None:
    """The ``scheduler`` config block of variant ``name``: the warm-up variants' ``WarmupLR``
    (linear over ``freeze`` steps to ``lr``); ``None`` for every other configuration."""
    if name not in _WARMUP:
        return None
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": freeze}
    return {"type": "WarmupLR", "params": {**params, "warmup_type": "linear"}}


def reference(name: str) -> str:
    """The uncompressed reference of variant ``name`` (the warm-up variants have their own)."""
    return "onebit_adam_nc_warmup" if name in _WARMUP else "onebit_adam_nc"


def exact_mean(
    buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """The exact mean of ``buffer`` over ``group``, in the compressed all-reduce's signature
    (the error buffers are left as they are: zero)."""
    from ds_core import comm

    out = buffer.detach().clone()
    comm.all_reduce(out, "sum", group)
    return out.div_(comm.get_world_size(group))


def copy(
    buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group: Any = None
) -> torch.Tensor:
    """``buffer`` itself, copied: the mean of momenta that are equal on every rank."""
    return buffer.detach().clone()


def apply(name: str) -> Callable[[], None]:
    """Patch the compressed all-reduce of the optimizer of configuration ``name`` (nothing for a
    name that is not a patched variant); returns the function that undoes it."""
    import ds_core.optim.onebit_adam as onebit
    import ds_core.optim.zero_one_adam as zero_one

    module: Any = zero_one if name.startswith("zero_one_adam_") else onebit
    saved = module.compressed_all_reduce
    if _base(name) in _PATCHED:
        module.compressed_all_reduce = exact_mean if _base(name).endswith("_exact") else copy

    def undo() -> None:
        module.compressed_all_reduce = saved

    return undo


def adjust(name: str, optimizer: Any) -> None:
    """For ``onebit_adam_frozen`` and ``zero_one_adam_avg``, keep the engine averaging gradients
    (``optimizer.backward_allreduce`` reset to true after every step); else nothing."""
    if _base(name) not in _AVERAGED:
        return
    step = optimizer.step

    def stepped(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        optimizer.backward_allreduce = True
        return out

    optimizer.step = stepped


def overstatement(checkpoints: tuple[int, ...] = (0, 18, 45, 100, 150)) -> None:
    """Print, at each step in ``checkpoints`` of a one-process Adam run of the small GPT (lr 3e-4,
    clipping 1.0, the benchmark's batches), how far a 1-bit gradient overstates its elements:
    ``a = RMS(g over the tensor) / sqrt(mean of g² over 8 probe batches)`` per element (the
    1-bit gradient gives every element its tensor's RMS; Adam then divides by the element's
    own √v). Reports the share of elements with ``a > 10`` and the fused qkv weights' median
    ``a``; the position rows past the sequence (never given a gradient) are left out."""
    from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus

    torch.manual_seed(1234)
    model, tokens = GPT(PRESETS["small"]), encode(make_corpus())
    seq = 64
    train = Batches(tokens, 8, seq, seed=1234, rank=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    for step in range(max(checkpoints) + 1):
        if step in checkpoints:
            probe = Batches(tokens, 8, seq, seed=99, rank=0)
            named = dict(model.named_parameters())
            sq = {n: torch.zeros_like(p) for n, p in named.items()}
            rms = dict.fromkeys(named, 0.0)
            for _ in range(8):
                model.zero_grad()
                model(*probe.next()).backward()
                for n, p in named.items():
                    assert p.grad is not None
                    sq[n] += p.grad**2 / 8
                    rms[n] += float(p.grad.pow(2).mean().sqrt()) / 8
            total = over = 0
            qkv = []
            for n, s in sq.items():
                a = rms[n] / (s[:seq] if n == "wpe.weight" else s).sqrt().flatten()
                total, over = total + a.numel(), over + int((a > 10).sum())
                if "qkv.weight" in n:
                    qkv.append(float(a.median()))
            print(
                f"step {step:>3}: a > 10 for {over / total:6.1%} of elements; "
                f"qkv weights' median a {min(qkv):.1f}-{max(qkv):.1f}",
                flush=True,
            )
        model.zero_grad()
        model(*train.next()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    torch.set_num_threads(1)
    overstatement()
