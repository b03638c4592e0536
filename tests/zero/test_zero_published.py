"""Stages 1-2 with ``overlap_comm``: the after-step all-gathers stay in flight until the next
forward needs them, and every entry point that reads parameters outside a forward waits for
them first (ds_core/zero/published.py, [Note: deferred after-step gathers]; the jobs are in
tests/zero/_published.py). On sim the link model makes each gather last 0.2 s, so a read that
did not wait sees the parameters before the step.
"""

from __future__ import annotations

import pytest
import torch

from tests.zero.conftest import BACKENDS, SuiteGetter

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("job", ["s1", "s2"])
def test_after_step_gathers_are_waited_for(suite: SuiteGetter, backend: str, job: str) -> None:
    for rank, res in enumerate(suite("published", 2, backend).ranks(job)):
        on, off = res["on"], res["off"]
        # the gathers are really left in flight (one per unit), and only with overlap_comm
        assert on["pending"] == [3] * len(on["pending"]), f"rank {rank}: {on['pending']}"
        assert off["pending"] == [0] * len(off["pending"])
        for k, (now, synced) in enumerate(on["reads"]):
            assert all(torch.equal(a, b) for a, b in zip(now, synced, strict=True)), (
                f"rank {rank}, step {k}: a read right after step() saw parameters mid-gather"
            )
        # the next forwards computed with the gathered parameters: bitwise what the
        # schedule without deferral computes, step after step
        assert all(torch.equal(a, b) for a, b in zip(on["losses"], off["losses"], strict=True))
        for (a, _), (b, _) in zip(on["reads"], off["reads"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        for name in ("on", "off"):
            saved, loaded = res[name]["saved"], res[name]["loaded"]
            assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True)), name
        assert all(torch.equal(a, b) for a, b in zip(on["saved"], off["saved"], strict=True))
