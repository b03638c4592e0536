"""bf16 master states (``bf16.bf16_master_weights_and_grads`` + ``bf16_optimizer_states``) at
stages 1-3 on 2 gloo ranks, against a single-process reference that keeps the same dtypes
(tests/zero/_bf16master.py), and against the engine's own fp32 masters (the drift).

Tolerances come from the dtype. bf16 keeps 8 significant bits: one rounding is at most half
an ulp, 2^-9 ≈ 0.2% relative, and the parameters here are below 1 in magnitude, so one ulp is
at most 2^-8 ≈ 0.0039 (2^-9 below 0.5). The engine and the reference round in different
places (the engine sums the ranks' bf16 gradients in fp32 and rounds once into its bf16 range;
the reference's one backward over the global batch rounds its own way), so exact equality is
not expected; over 10 AdamW steps (lr 1e-2: one update is ~0.01, 2-5 ulps) those one-ulp
gradient differences move a parameter by a few ulps at most. Each bound below is a few times
the maximum measured over the 6 scenarios on cpu, sim-threads and sim-lazy.
"""

from __future__ import annotations

import pytest
import torch

from tests.zero._bf16master import SCENARIOS, reference
from tests.zero.conftest import SuiteGetter

pytestmark = pytest.mark.slow

#: max |engine - reference| over every parameter after 10 steps. Measured max 0.0044 (s1;
#: 0.0029-0.0044 over the scenarios, ranks and backends): about one ulp at [0.5, 1).
PARAM_TOL = 0.015
#: max relative difference of a logged loss (measured max 8.1e-4) and of a step's gradient
#: norm (measured max 5.3e-3: a norm of bf16 gradients that differ by an ulp here and there).
LOSS_RTOL = 0.003
NORM_RTOL = 0.02
#: max |bf16 masters - fp32 masters| (the engine's default bf16 training, same data) after 10
#: steps. Measured: 0.0039 (one ulp) in every scenario but s1_gas1, 0.0161 there. Not an
#: engine error: updates under half an ulp of a bf16 master are lost (docs/from-deepspeed.md,
#: "Low-precision master states"), and the loss grows with the number of steps.
DRIFT_TOL = 0.05

_REFS: dict[str, dict[str, object]] = {}


def _ref(name: str) -> dict:
    if name not in _REFS:
        _REFS[name] = reference(SCENARIOS[name])
    return _REFS[name]


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bf16_masters_match_a_same_dtype_reference(
    suite: SuiteGetter, backend: str, name: str
) -> None:
    ref = _ref(name)
    assert ref["state_dtypes"] == ["torch.bfloat16"]  # the reference keeps AdamW's state bf16
    for rank, res in enumerate(suite("bf16master", 2, backend).ranks(f"m_{name}")):
        assert res["master_dtypes"] == ["torch.bfloat16"], rank
        assert res["state_dtypes"] == ["torch.bfloat16"], rank
        assert res["grad_dtypes"] == ["torch.bfloat16"], rank
        diff = max(
            (res["state"][k].double() - v.double()).abs().max().item()
            for k, v in ref["params"].items()
        )
        assert all(res["state"][k].dtype == torch.bfloat16 for k in ref["params"])
        assert diff <= PARAM_TOL, (rank, diff)
        if rank == 0:  # the reference logs rank 0's samples
            loss = _max_rel(res["losses"], ref["losses"])
            assert loss <= LOSS_RTOL, loss
        norm = _max_rel(res["norms"], ref["norms"])
        assert norm <= NORM_RTOL, (rank, norm)
        out = (res["eval_out"].double() - ref["eval_out"].double()).abs().max().item()
        assert out <= 4 * PARAM_TOL, (rank, out)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bf16_masters_are_the_parameters_and_halve_grads_and_state(
    suite: SuiteGetter, backend: str, name: str
) -> None:
    res = suite("bf16master", 2, backend)
    for rank, (m, f) in enumerate(zip(res.ranks(f"m_{name}"), res.ranks(f"f_{name}"), strict=True)):
        assert f["master_dtypes"] == f["state_dtypes"] == f["grad_dtypes"] == ["torch.float32"]
        # a bf16 parameter's owned piece is its own master: no copy at all
        assert m["bytes"]["master"] == 0 and f["bytes"]["master"] > 0, rank
        assert m["bytes"]["params"] == f["bytes"]["params"], rank
        assert 2 * m["bytes"]["grads"] == f["bytes"]["grads"], rank
        assert 2 * m["bytes"]["optimizer"] == f["bytes"]["optimizer"], rank


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bf16_masters_drift_from_fp32_masters_within_bound(
    suite: SuiteGetter, backend: str, name: str
) -> None:
    res = suite("bf16master", 2, backend)
    for rank, (m, f) in enumerate(zip(res.ranks(f"m_{name}"), res.ranks(f"f_{name}"), strict=True)):
        drift = max(
            (m["state"][k].double() - f["state"][k].double()).abs().max().item() for k in f["state"]
        )
        assert 0 < drift <= DRIFT_TOL, (rank, drift)
