"""Device memory per ZeRO stage at the default configuration, from the device's own allocator
(the simulated accelerator: its memory is not the host's, so RSS cannot stand in for it).

Two bounds, both derived from the engine's own buffers and the config, never from a timing:

- **held** between steps ≤ the model states (``engine.model_state_bytes()``): no gathered
  stage-3 parameter, gradient or staging buffer survives a step; during backward the reducer
  stages at most one unit (two with ``overlap_comm``, where one is reduced while the next
  fills);
- **peak** during a step ≤ held plus the larger of backward's and the optimizer's transients.
  Backward: the staging buffers above, the full gradient autograd makes of the largest
  parameter before the engine takes it and, at stage 3, the gathered unit being computed and
  what the prefetch keeps ahead: ``stage3_prefetch_bucket_size`` elements, or one unit when it
  alone is bigger, never more than the other units (ds_core/zero/stage3.py, [Note: stage-3
  hooks]). Unset, the bucket is a quarter of a rank's partitioned elements (at most 5e6): on
  this 1.6 M-parameter model less than one layer, so ``s3`` keeps one unit ahead, not the
  whole model as a fixed 5e6 did; ``s3bucket2`` sets two layers and gets exactly that
  (activations are a few KiB here). The optimizer: torch's foreach Adam makes one temporary
  the size of the parameters it steps; no staging buffer is held then.

The gathered elements themselves (the stage-3 coordinator's count of units held or in flight)
are checked on every backend: they are the same on ``cpu`` and ``sim``.

Run on 2 ranks (tests/zero/_peaks.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.zero.conftest import BACKENDS, SuiteGetter

pytestmark = pytest.mark.slow

SIM = [b for b in BACKENDS if b.startswith("sim")]
#: scalars (norms, flags, the loss), the batch and the allocator's 512-byte rounding
SLACK = 512 << 10


def gathered_bound(got: dict[str, Any]) -> int:
    """Stage 3: the unit computed plus the prefetch's look-ahead (bytes)."""
    units = sorted(got["partitioned_units"])
    computed = units[-1]
    ahead = min(max(got["prefetch_bucket"], computed), sum(units) - computed)
    return computed + ahead


def transient_bound(got: dict[str, Any], stage: int) -> int:
    if got["local"]:
        # No staging: stage 0 all-reduces its accumulator in place; stage 1 with accumulation
        # reduce-scatters it at the window's last backward into outputs of ``part`` elements
        # per unit (every unit's may be in flight), each copied into the accumulator's own
        # range of this rank as it lands, so none is held through the optimizer step.
        outputs = got["parts"] if stage == 1 else 0
        return max(got["largest_param"] + outputs, got["stepped"]) + SLACK
    staging = (2 if got["overlap"] else 1) * got["largest_unit"]
    gathered = gathered_bound(got) if stage == 3 else 0
    backward = staging + got["largest_param"] + gathered
    return max(backward, got["stepped"]) + SLACK


@pytest.mark.skipif(not SIM, reason="device memory is measured by the sim backend's allocator")
@pytest.mark.parametrize("job", ["s0", "s1", "s1gas4", "s2", "s3", "s3bucket2"])
def test_device_memory_stays_within_the_design(suite: SuiteGetter, job: str) -> None:
    """``s1gas4``: stage 1 with 4 accumulation steps; the window's reduce-scatter lands in
    this rank's range of the accumulator (part of the held model states), so the optimizer
    step adds only its own temporary."""
    stage = int(job[1])
    for rank, got in enumerate(suite("peaks", 2, SIM[0]).ranks(job)):
        pool = 0 if got["local"] else (2 if got["overlap"] else 1) * got["largest_unit"]
        assert got["staging"] <= pool, (
            f"rank {rank}: {got['staging']} bytes of gradient staging after backward, at most "
            f"{pool} ({'two units' if got['overlap'] else 'one unit'} of {got['largest_unit']} bytes)"
        )
        assert got["staging_between_steps"] == 0, got
        allowed = got["states"] + SLACK
        assert got["held"] <= allowed, (
            f"rank {rank}, stage {stage}: {got['held']} bytes held between steps, but the model "
            f"states are {got['states']} (allowed {allowed})"
        )
        bound = got["held"] + transient_bound(got, stage)
        assert got["peak"] <= bound, (
            f"rank {rank}, stage {stage}: peak {got['peak']} bytes during a step, above "
            f"held {got['held']} + transients {bound - got['held']}: {got}"
        )


@pytest.mark.skipif(not SIM, reason="device memory is measured by the sim backend's allocator")
def test_stage3_frees_activations_without_the_cycle_collector(suite: SuiteGetter) -> None:
    """Stage 3's hooks walk every module's inputs and outputs; nothing they keep may outlive
    the step by a reference cycle. With Python's cycle collector off, what is held between
    steps is still only the model states and the job's own batches (it held each layer's
    512 KiB input per step while the walk was a recursive closure)."""
    for rank, got in enumerate(suite("peaks", 2, SIM[0]).ranks("s3nocollector")):
        allowed = got["states"] + got["batches"] + SLACK
        assert got["held"] <= allowed, (
            f"rank {rank}: {got['held']} bytes held between steps with the cycle collector "
            f"off; model states {got['states']}, batches {got['batches']} (allowed {allowed})"
        )


#: the coordinator's counts do not depend on sim's async mode: one mode is enough
GATHER_BACKENDS = [b for b in BACKENDS if b == "cpu" or b == SIM[0]]


@pytest.mark.parametrize("job", ["s3", "s3bucket2"])
@pytest.mark.parametrize("backend", GATHER_BACKENDS)
def test_stage3_prefetch_bucket_default_rule_and_explicit_setting(
    suite: SuiteGetter, backend: str, job: str
) -> None:
    """Unset, ``stage3_prefetch_bucket_size`` is a quarter of the rank's partitioned elements
    (at most 5e6); set, it is used as given. The gathered bytes during the step reach exactly
    the unit computed plus that look-ahead."""
    for rank, got in enumerate(suite("peaks", 2, backend).ranks(job)):
        if job == "s3":
            assert got["configured_bucket"] is None, got["configured_bucket"]
            expected = min(5_000_000, got["partitioned_part"] // 4) * 4
        else:
            expected = got["configured_bucket"] * 4
            assert got["configured_bucket"] == 2 * max(got["partitioned_units"]) // 4
        assert got["prefetch_bucket"] == expected, (
            f"rank {rank}, {job}: bucket {got['prefetch_bucket']} bytes, expected {expected}"
        )
        units = sorted(got["partitioned_units"])
        assert got["peak_gathered"] == gathered_bound(got) < sum(units), (
            f"rank {rank}, {job}: {got['peak_gathered']} bytes gathered at most, expected the "
            f"unit computed plus the look-ahead, {gathered_bound(got)} of {sum(units)}"
        )
