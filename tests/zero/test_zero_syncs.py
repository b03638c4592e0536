"""Host syncs in a steady-state training step, counted by the simulated accelerator.

A host sync (a blocking device-to-host copy, ``.item()``, a synchronize, a forced query) stalls
the host until the device catches up, so a step with one cannot keep the device busy. The
counts are the device's own (``ds_backend_sim.counters()``), exact, for one step after two
warm-up steps (tests/zero/_syncs.py). In ``lazy`` mode queued work runs only when waited for,
so every wait the step needs is counted; in ``threads`` mode a wait the device has already
satisfied costs nothing, so counts there are at most the lazy ones.

Expected, from the design (ds_core/zero/offload/host.py, [Note: offload data path]):
- no offload, fp32 / bf16 / fp16 (dynamic loss scaling), stages 0-3, clipping on, gradient
  accumulation 1 and 3: **0** (the norm, the clip coefficient, the loss scale and the skip
  verdict stay on the device; the verdict reaches the host a step late without a wait);
- stages 1-2 with ``overlap_comm`` (the after-step all-gathers waited for by the next forward,
  ds_core/zero/published.py): **0**;
- optimizer offload: **1** (the host optimizer reads the gradients, the multiplier and the
  verdict, which land together), **2** with accumulation at stages 2/3 (the norm of the host
  sums), plus one per unit after the first for bf16 (the shared staging buffer's reuse).
"""

from __future__ import annotations

import pytest

from tests.zero._syncs import CONFIGS, OVERLAP
from tests.zero.conftest import BACKENDS, SuiteGetter

pytestmark = pytest.mark.slow

SIM = [b for b in BACKENDS if b.startswith("sim")]


def expected(name: str, units: int) -> int:
    stage, prec, gas, offload = CONFIGS[name] if name in CONFIGS else OVERLAP[name]
    if not offload:
        return 0
    syncs = 1
    if gas > 1 and stage >= 2:
        syncs += 1
    if prec != "fp32":
        syncs += units - 1
    return syncs


@pytest.mark.skipif(not SIM, reason="host syncs are counted by the sim backend")
@pytest.mark.parametrize("backend", SIM)
@pytest.mark.parametrize("name", [*CONFIGS, *OVERLAP])
def test_host_syncs_per_step(suite: SuiteGetter, backend: str, name: str) -> None:
    for rank, counted in enumerate(suite("syncs", 2, backend).ranks(name)):
        want = expected(name, counted["units"])
        got = counted["host_syncs"]
        if backend == "sim-lazy":
            assert got == want, f"rank {rank}: {got} host syncs per step, expected {want}"
        else:
            assert got <= want, f"rank {rank}: {got} host syncs per step, at most {want}"


@pytest.mark.skipif(not SIM, reason="streams are asynchronous on the sim backend")
@pytest.mark.parametrize("backend", SIM)
def test_stage3_prefetch_gathers_run_on_a_side_stream_with_overlap_comm(
    suite: SuiteGetter, backend: str
) -> None:
    """A collective runs on the stream current when it is issued, so a prefetch issued from
    the compute stream would make the module being computed wait behind the next module's
    gather (ds_core/zero/stage3.py). With ``overlap_comm`` (stage 3's default) only each
    pass's first gather, which nothing prefetched, is on the compute stream; without it
    every gather is."""
    results = suite("syncs", 2, backend)
    for counted in results.ranks("streams_s3_default"):
        gathers = counted.get("all_gather_side", 0) + counted.get("all_gather_compute", 0)
        assert gathers >= 2 * counted["units"], counted  # forward and backward, each unit
        assert counted.get("all_gather_compute", 0) <= 2, counted
        assert counted.get("reduce_scatter_compute", 0) == 0, counted
    for counted in results.ranks("streams_s3_no_overlap"):
        assert counted.get("all_gather_side", 0) == 0, counted
        assert counted.get("all_gather_compute", 0) >= 2 * counted["units"], counted
