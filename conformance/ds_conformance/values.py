"""Test data chosen so that a wrong implementation cannot produce the right answer.

A check discriminates only when the plausible wrong answers differ from the right one on its
data. The values here are built for that:

- **per-rank distinct and non-symmetric**: rank ``r``'s element ``i`` depends on both, so a
  result taken from the wrong rank, in the wrong order or from the wrong offset differs;
- **every reduction distinct**: for each element, sum, average, max, min and product over the
  ranks all differ, and differ from every single rank's input (a no-op);
- **exact in the claimed dtype and in no narrower substitute**: each dtype gets an offset and
  a step (:data:`FINE`) so that every value *and every sum over up to four ranks* is exact in
  the dtype, while carrying the data through a plausible narrower type (float64 through
  float32, float32/fp16 through bf16, bf16 through fp16, int64 through int32 or float64,
  int32 through float32, 16-bit through 8-bit, uint8 through int8, int8 through uint8) changes
  some value, sum, max or min.

:func:`substitutes` lists those narrower types; the project's tests prove, dtype by dtype,
that each of them loses information on this data.
"""

from __future__ import annotations

import torch

#: Reductions in the order the suite tests them (every op the comm hook spec names).
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product")

# dtype -> (offset, step, sign): value = sign * (offset + k * step), k in 1..7. Offsets and
# steps are chosen so that 4-rank sums stay exact in the dtype (see the module docstring).
FINE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1.0, 2.0**-40),  # below float32's resolution at 1
    torch.float32: (1.0, 2.0**-20),  # below bf16's and fp16's resolution at 1
    torch.float16: (1.0, 2.0**-8),  # below bf16's resolution at 1 (fp16 has 2**-10)
    torch.bfloat16: (2.0**20, 2.0**15),  # above fp16's range (65504)
    torch.int64: (2.0**60, 1.0),  # beyond int32 and float64's 53-bit mantissa
    torch.int32: (2.0**28, 1.0),  # beyond float32's 24-bit mantissa and int16
    torch.int16: (2.0**12, 1.0),  # beyond 8-bit types and fp16's resolution at 4096
}

_NARROWER: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float64: (torch.float32, torch.bfloat16, torch.float16),
    torch.float32: (torch.bfloat16, torch.float16),
    torch.float16: (torch.bfloat16, torch.int16),
    torch.bfloat16: (torch.float16, torch.int16),
    torch.int64: (torch.int32, torch.float64, torch.float32),
    torch.int32: (torch.int16, torch.float32),
    torch.int16: (torch.int8, torch.uint8, torch.float16, torch.bfloat16),
    torch.uint8: (torch.int8,),
    torch.int8: (torch.uint8,),
}


def substitutes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """Plausible narrower types an implementation might carry ``dtype`` through."""
    return _NARROWER.get(dtype, ())


#: Period of :func:`_k` in the position: lcm(7, 5), of ``3 * i % 7`` and ``i * i % 5``.
_PERIOD = 35


def _k(rank: int, numel: int, salt: int = 0) -> torch.Tensor:
    """Integers in 1..7 that depend on rank and position (never equal across two ranks)."""
    # 2 * rank keeps ranks 0..3 distinct modulo 7 at every position; (i * i) % 5 breaks the
    # period of 7, so no chunk shifted by less than _PERIOD equals another chunk.
    i = torch.arange(min(numel, _PERIOD), dtype=torch.int64)
    k = (3 * i + 2 * rank + (i * i) % 5 + salt) % 7 + 1
    # The formula depends on i only modulo _PERIOD: tiling one period gives the same integers
    # as evaluating it everywhere, several times faster on the suite's multi-MiB cases.
    return k.repeat(-(-numel // _PERIOD))[:numel] if numel > _PERIOD else k


def rank_values(
    rank: int, numel: int, dtype: torch.dtype, world: int, salt: int = 0
) -> torch.Tensor:
    """Rank ``rank``'s fine values (a 1-d tensor of ``numel`` elements in ``dtype``).

    Sums of these over up to ``world`` (≤ 4) ranks are exact in ``dtype``; the values are
    not exact in any of :func:`substitutes` (or their sums are not).
    """
    k = _k(rank, numel, salt)
    if dtype == torch.bool:
        return k % 2 == 1
    if dtype in FINE:
        offset, step = FINE[dtype]
        if dtype.is_floating_point:
            return (offset + k.to(torch.float64) * step).to(dtype)
        return (int(offset) + k).to(dtype)
    i = torch.arange(numel)
    if dtype == torch.uint8:
        # one rank per position above int8's 127 (which one rotates with the position), the
        # others below: max/min through int8 pick the wrong rank; 4-rank sums stay ≤ 255.
        big = i % world == rank
        return torch.where(big, 130 + k, 8 * rank + k).to(dtype)
    if dtype == torch.int8:
        # negative where rank + position is odd: max/min through uint8 pick the wrong rank,
        # and the maximum comes from a different rank at neighbouring positions.
        sign = 1 - 2 * ((i + rank) % 2)
        return (sign * (128 // world - 8 + k)).to(dtype)
    return k.to(dtype)


def product_values(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small values (1..3) whose products over up to 4 ranks fit every dtype exactly."""
    k = (_k(rank, numel) % 3) + 1
    return k.to(dtype)


def reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """The exact reduction ``op`` of equally shaped tensors, in their dtype.

    Computed in float64 for floats (exact for this module's data) and int64 for integers.
    """
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(tensors)
        return stacked.all(0) if op in ("min", "product") else stacked.any(0)
    wide_type = torch.float64 if dtype.is_floating_point else torch.int64
    wide = torch.stack([t.to(wide_type) for t in tensors])
    if op == "sum":
        out = wide.sum(0)
    elif op == "avg":
        out = wide.sum(0) / len(tensors)
    elif op == "max":
        out = wide.amax(0)
    elif op == "min":
        out = wide.amin(0)
    elif op == "product":
        out = wide.prod(0)
    else:
        raise ValueError(f"unknown reduce op {op!r}")
    return out.to(dtype)


def op_applies(op: str, dtype: torch.dtype) -> bool:
    """Whether the suite tests ``op`` on ``dtype``.

    ``avg`` is defined for floating types only (an integer mean is not an integer);
    ``sum``/``product`` of booleans are not reductions torch.distributed defines.
    """
    if dtype == torch.bool:
        return op in ("max", "min")
    if op == "avg":
        return dtype.is_floating_point
    return True
