"""Communication volume and model-state memory per stage, against the ZeRO paper's formulas.

Bytes are logical (docs/architecture.md §3.4), counted by the CommCounter wrapper plugin on
the collective hooks, on an all-trainable MLP whose sizes divide by the world size (no padding),
stage3_param_persistence_threshold 0, clipping off and fp32 (no scalar collectives at all).
Ψ = bytes of one full fp32 gradient. Memory is fp32 AdamW: params 4, grads 4, moments 8 bytes
per parameter, partitioned over N = 2 ranks as each stage prescribes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.zero.conftest import SuiteResults

pytestmark = pytest.mark.slow

N = 2
# (stage, gas) -> {collective: multiple of Ψ}
EXPECTED_BYTES = {
    (0, 1): {"all_reduce": 2},
    (0, 2): {"all_reduce": 2},  # stage 0 reduces once per step
    (1, 1): {"reduce_scatter": 1, "all_gather": 1},
    (1, 2): {"reduce_scatter": 1, "all_gather": 1},  # stage 1 reduces at the boundary only
    (2, 1): {"reduce_scatter": 1, "all_gather": 1},
    (2, 2): {"reduce_scatter": 2, "all_gather": 1},  # stage 2 reduce-scatters per micro-batch
    (3, 1): {"all_gather": 2, "reduce_scatter": 1},  # forward + backward gathers: 3Ψ
    (3, 2): {"all_gather": 4, "reduce_scatter": 2},  # 3Ψ per micro-batch
}
# stage -> bytes per parameter of model states on one of N ranks. The memory job runs without
# gradient accumulation, where stage 1 reduce-scatters during backward like stage 2 and keeps
# only its partition of the gradient (a full accumulator would hold nothing between steps).
FORMULA = {0: 4 + 4 + 8, 1: 4 + (4 + 8) / N, 2: 4 + (4 + 8) / N, 3: (4 + 4 + 8) / N}
# bf16: params 2, and partitioned as above an fp32 master 4, fp32 gradients 4
# (docs/architecture.md §3.2 accumulates 16-bit gradients in fp32; the paper's 2 + 2 + 12
# assumes 16-bit ones), moments 8
FORMULA_BF16 = {0: 2 + 4 + 4 + 8, 1: 2 + 16 / N, 2: 2 + 16 / N, 3: 18 / N}


@pytest.mark.parametrize(("stage", "gas"), sorted(EXPECTED_BYTES))
def test_bytes_per_step_match_the_paper(
    suite: Callable[[str, int], SuiteResults], stage: int, gas: int
) -> None:
    for res in suite("accounting", 2).ranks("bytes"):
        got = res[f"s{stage}_gas{gas}"]
        psi = got["psi"]
        expected = {op: k * psi for op, k in EXPECTED_BYTES[(stage, gas)].items()}
        # plus the global norm's scalar all-reduce (the non-finite check, on by default)
        assert set(got["norm_bytes"]) == {"all_reduce"} and got["norm_bytes"]["all_reduce"] <= 16
        for op, n in got["norm_bytes"].items():
            expected[op] = expected.get(op, 0) + n
        assert got["bytes"] == expected, f"{got['bytes']=}, but should be {expected=} (Ψ={psi})"
        if stage == 3:
            # 3 layers: forward prefetches layers 2 and 3, backward layers 2 and 1; overlap_comm
            # (on by default in stage 3) makes the reduce-scatters asynchronous too, one per
            # layer's unit, issued while backward goes on to the layer below
            expected_async = {"all_gather": 4 * gas, "reduce_scatter": 3 * gas}
            assert got["async_calls"] == expected_async, got["calls"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_memory_matches_formula_and_does_not_grow(
    suite: Callable[[str, int], SuiteResults], stage: int
) -> None:
    for res in suite("accounting", 2).ranks("memory"):
        got = res[f"s{stage}"]
        expected = FORMULA[stage] * got["psi"]
        total = got["early"]["total"]
        assert abs(total - expected) <= 0.10 * expected, (
            f"model states={total} bytes, but should be {expected:.0f} ±10% "
            f"(stage {stage}, Ψ={got['psi']} parameters, {got['early']})"
        )
        assert got["late"] == got["early"], "model-state buffers changed between step 2 and 100"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_model_state_memory_matches_formula(
    suite: Callable[[str, int], SuiteResults], stage: int
) -> None:
    for res in suite("accounting", 2).ranks("memory"):
        got = res[f"bf16_s{stage}"]
        expected = FORMULA_BF16[stage] * got["psi"]
        total = got["early"]["total"]
        assert abs(total - expected) <= 0.10 * expected, f"{got['early']}, expected {expected}"
