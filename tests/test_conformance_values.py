"""The conformance suite's data discriminates: wrong answers cannot equal the right ones.

These tests check the data of :mod:`ds_conformance.values` itself (not a backend): every
reduction gives a different result from every other and from a no-op; ranks differ at every
position; values and sums are exact in the claimed dtype; and carrying them through each
plausible narrower type changes a value or a reduction.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ds_backend_cpu.shm_groups import DEFAULT_SLOT_BYTES
from ds_conformance.comm_cases import (
    COLLECTIVES,
    GUARD,
    LARGE_NUMEL,
    LAYOUTS,
    Case,
    Context,
    Placement,
    cases,
)
from ds_conformance.values import (
    REDUCE_OPS,
    op_applies,
    product_values,
    rank_values,
    reduce,
    substitutes,
)

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
WORLDS = (2, 4)
NUMEL = 13


def _ranks(dtype: torch.dtype, world: int, op: str = "sum") -> list[torch.Tensor]:
    if op == "product":
        return [product_values(r, NUMEL, dtype) for r in range(world)]
    return [rank_values(r, NUMEL, dtype, world) for r in range(world)]


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64 if t.dtype.is_floating_point else torch.int64)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_reduction_differs_from_every_other_and_from_a_no_op(
    dtype: torch.dtype, world: int
) -> None:
    results = {
        op: reduce(_ranks(dtype, world, op), op) for op in REDUCE_OPS if op_applies(op, dtype)
    }
    names = sorted(results)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not torch.equal(results[a], results[b]), f"{dtype} w{world}: {a} == {b}"
    for op, result in results.items():
        for r, mine in enumerate(_ranks(dtype, world, op)):
            assert not torch.equal(result, mine), f"{dtype} w{world}: {op} equals rank {r}'s input"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ranks_differ_at_every_position_and_chunks_differ(dtype: torch.dtype, world: int) -> None:
    data = _ranks(dtype, world)
    if dtype != torch.bool:
        stacked = torch.stack([_wide(t) for t in data])
        for i in range(NUMEL):
            assert len(set(stacked[:, i].tolist())) == world, f"{dtype}: ranks equal at {i}"
    if dtype == torch.bool:
        return  # reduce-scatter is not defined on bool
    full = reduce([rank_values(r, 5 * world, dtype, world) for r in range(world)], "max")
    chunks = full.view(world, 5)
    for a in range(world):
        for b in range(a + 1, world):
            assert not torch.equal(chunks[a], chunks[b]), f"{dtype}: chunks {a} and {b} equal"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.bool], ids=str)
def test_values_and_reductions_are_exact_in_the_dtype(dtype: torch.dtype, world: int) -> None:
    for op in REDUCE_OPS:
        if not op_applies(op, dtype):
            continue
        data = _ranks(dtype, world, op)
        stacked = torch.stack([_wide(t) for t in data])
        exact = {
            "sum": stacked.sum(0),
            "avg": stacked.sum(0) / world,
            "max": stacked.amax(0),
            "min": stacked.amin(0),
            "product": stacked.prod(0),
        }[op]
        assert torch.equal(_wide(reduce(data, op)), exact), f"{dtype} w{world} {op} is not exact"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if substitutes(d)], ids=str)
def test_carrying_through_a_narrower_type_changes_a_result(dtype: torch.dtype, world: int) -> None:
    data = _ranks(dtype, world)
    for sub in substitutes(dtype):
        through = [t.to(sub) for t in data]
        changed = [not torch.equal(a.to(dtype), b) for a, b in zip(through, data, strict=True)]
        for op in ("sum", "max", "min"):
            changed.append(not torch.equal(reduce(through, op).to(dtype), reduce(data, op)))
        assert any(changed), f"{dtype} through {sub} (w{world}) changes nothing"


def test_every_reduce_op_and_collective_is_covered_on_every_dtype() -> None:
    all_cases = cases(DTYPES)
    for world in WORLDS:
        for dtype in DTYPES:
            name = str(dtype).removeprefix("torch.")
            ops = {
                c.op
                for c in all_cases
                if c.collective == "all_reduce"
                and c.dtype == name
                and c.world == world
                and not c.variant
            }
            assert ops == {op for op in REDUCE_OPS if op_applies(op, dtype)}, (dtype, world, ops)
    variants = {(c.collective, c.variant) for c in all_cases}
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        assert (collective, "group") in variants and (collective, "late-async") in variants
    assert ("barrier", "late-sync") in variants and ("all_to_all", "equal-splits") in variants
    # the non-contiguous axis: every op of every collective, sync and async, on both worlds
    for layout in LAYOUTS:
        for world in WORLDS:
            got = {
                (c.collective, c.op, c.async_op)
                for c in all_cases
                if c.variant == layout and c.world == world and c.collective != "p2p"
            }
            want = {
                (collective, op, async_op)
                for collective in COLLECTIVES[:-1]  # all but the barrier
                for op in (REDUCE_OPS if collective in ("all_reduce", "reduce_scatter") else ("",))
                for async_op in (False, True)
            }
            assert got == want, (layout, world, want - got)


@pytest.mark.parametrize("numel", [0, 1, 34, 35, 36, 71, 1000])
@pytest.mark.parametrize("salt", [0, 5])
def test_tiled_positions_equal_the_formula_evaluated_everywhere(numel: int, salt: int) -> None:
    # rank_values tiles one period of its integers; a wrong period would shift them.
    i = torch.arange(numel, dtype=torch.int64)
    for rank in range(4):
        formula = (3 * i + 2 * rank + (i * i) % 5 + salt) % 7 + 1
        got = rank_values(rank, numel, torch.int64, 4, salt) - int(2.0**60)
        assert torch.equal(got, formula), (numel, rank, salt)


def test_large_cases_span_several_cpu_slots_and_their_oracle_is_exact() -> None:
    large = {(c.collective, c.op, c.world) for c in cases(DTYPES) if c.variant == "large"}
    assert large == {
        ("all_reduce", "sum", 2), ("all_reduce", "avg", 2), ("all_reduce", "sum", 4),
        ("reduce_scatter", "sum", 2), ("all_gather", "", 2), ("broadcast", "", 2),
        ("p2p", "", 2),
    }  # fmt: skip
    # Past the CPU backend's default slot (float32 elements) at least three times, and odd so
    # the last piece of any power-of-two chunking is partial.
    assert LARGE_NUMEL >= 3 * DEFAULT_SLOT_BYTES // 4 and LARGE_NUMEL % 2 == 1
    for world in WORLDS:
        data = [rank_values(r, LARGE_NUMEL, torch.float32, world) for r in range(world)]
        for op in ("sum", "avg"):
            in_float32 = torch.stack(data).sum(0)
            if op == "avg":
                in_float32 = in_float32 / world
            assert torch.equal(in_float32, reduce(data, op)), (world, op)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(13,), (6, 3)])
def test_layout_placement_is_non_contiguous_and_its_guards_catch_a_stray_write(
    layout: str, shape: tuple[int, ...], tmp_path: Path
) -> None:
    case = Case("all_reduce", 2, "float32", "sum", variant=layout)
    ctx = Context(acc=None, rank=0, scratch=tmp_path, groups={})
    place = Placement(case, "cpu")
    data = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    view = place.put(data)
    assert not view.is_contiguous() and torch.equal(view, data)
    out = place.empty(shape, torch.float32)
    assert not out.is_contiguous() and out.shape == shape
    out.copy_(data)  # writes through views stay inside them
    place.check_guards(ctx, case)
    base = view._base
    assert base is not None and int((base == GUARD).sum()) == base.numel() - view.numel()
    base.view(-1)[-1 if layout == "transposed" and len(shape) == 2 else 0] = 0.0
    with pytest.raises(AssertionError, match=f"buffer 0 outside its {layout} view"):
        place.check_guards(ctx, case)


def test_point_to_point_cases_cover_every_dtype_both_worlds_and_each_variant() -> None:
    p2p = [c for c in cases(DTYPES) if c.collective == "p2p"]
    assert all(c.capability == "p2p" for c in p2p)
    for world in WORLDS:
        ring = {c.dtype for c in p2p if c.world == world and c.variant == "ring"}
        assert ring == {str(d).removeprefix("torch.") for d in DTYPES if "float8" not in str(d)}
        assert {(c.variant, c.async_op) for c in p2p if c.world == world} >= {
            ("pair", False),
            ("pair", True),
            *((layout, True) for layout in LAYOUTS),
        }
    assert {(c.variant, c.world) for c in p2p} >= {("group", 4), ("large", 2), ("late-async", 2)}
