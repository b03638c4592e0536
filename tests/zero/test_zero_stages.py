"""Stages 0-3 on 2 and 4 ranks equal single-process PyTorch on the global batch, on every
backend of the matrix (``backend`` fixture: cpu, and the simulated accelerator in both async
modes, whose memory is not the host's and whose streams run asynchronously).

Each scenario trains the tiny model (tied weight, frozen and unused parameters, one MoE layer)
for N steps with gradient accumulation and active clipping; the reference takes one backward
over the whole global batch per step, so a match proves accumulation equivalence (k
micro-batches = one batch k times larger) as well. Tolerance: fp32, 1e-5 relative per element,
with an absolute floor of 1e-5 × the tensor's largest magnitude for parameters (AdamW divides by
sqrt(v), so elements whose gradients are near zero carry amplified rounding; measured worst case
~1e-6 absolute on tensors of magnitude ~0.1) and 1e-6 for losses and norms. Norms are the pre-clipping global norm, checked against
``torch.nn.utils.clip_grad_norm_`` on the reference model; expert-split scenarios (``_ep2``)
must give the same norm as replicated experts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.zero._common import IN, Scenario, TinyNet, run_reference
from tests.zero._worker import stage_scenarios
from tests.zero.conftest import SuiteGetter

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-6
SCENARIOS = [(2, name) for name in stage_scenarios(2)] + [(4, name) for name in stage_scenarios(4)]


def _merged_state(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every parameter by layer-wide name; experts come from whichever rank holds them, and
    replicated parameters must be equal on every rank."""
    merged: dict[str, torch.Tensor] = {}
    for res in ranks:
        for name, value in res["state"].items():
            if name in merged:
                torch.testing.assert_close(
                    value,
                    merged[name],
                    rtol=RTOL,
                    atol=ATOL,
                    msg=lambda m, n=name: f"ranks differ: {n}: {m}",
                )
            merged[name] = value
    return merged


@pytest.mark.parametrize(("world", "name"), SCENARIOS, ids=[f"w{w}-{n}" for w, n in SCENARIOS])
def test_stage_matches_single_process_reference(
    suite: SuiteGetter, backend: str, world: int, name: str
) -> None:
    results = suite("stages", world, backend)
    check_against_reference(stage_scenarios(world)[name], results.ranks(name))


def check_against_reference(
    sc: Scenario, ranks: list[dict[str, Any]], rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Losses, norms, final parameters and an eval forward of a run equal the reference's
    (within ``rtol``/``atol``; parameters also within ``rtol`` × their largest magnitude)."""
    world = sc.world
    ref = run_reference(sc)

    # losses: each rank's micro-batch mean, averaged over ranks and micro-batches of a step
    per_rank = torch.tensor([r["losses"] for r in ranks])  # (world, steps * gas)
    engine_losses = per_rank.view(world, sc.steps, sc.gas).mean(dim=(0, 2))
    torch.testing.assert_close(engine_losses, torch.tensor(ref["losses"]), rtol=rtol, atol=atol)

    # One global norm, the same on every rank; without clipping it is still computed, because
    # the default ``nonfinite_gradients.skip`` needs it to detect a non-finite step.
    for r in ranks:
        torch.testing.assert_close(
            torch.tensor(r["norms"], dtype=torch.float64),
            torch.tensor(ref["norms"], dtype=torch.float64),
            rtol=rtol,
            atol=atol,
        )

    state = _merged_state(ranks)
    assert set(state) == set(ref["params"]), "every parameter is accounted for"
    for pname, value in ref["params"].items():
        want = value.detach()
        floor = max(atol, rtol * float(want.abs().max()))
        torch.testing.assert_close(
            state[pname], want, rtol=rtol, atol=floor, msg=lambda m, n=pname: f"{n}: {m}"
        )

    # eval + no_grad forward works at every stage and sees the trained parameters
    if sc.ep_size == 1:
        model = TinyNet(1)
        model.load_state_dict({k: v.detach() for k, v in ref["params"].items()}, strict=False)
        probe = torch.randn(6, IN, generator=torch.Generator().manual_seed(7))
        _copy_buffers_and_frozen(model, ref["params"])
        with torch.no_grad():
            expected = model.eval()(probe)
        torch.testing.assert_close(
            ranks[0]["eval_out"], expected, rtol=max(rtol, 1e-4), atol=max(atol, 1e-5)
        )


def _copy_buffers_and_frozen(model: TinyNet, params: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])


def test_expert_split_and_replicated_give_the_same_norm(suite: SuiteGetter, backend: str) -> None:
    results = suite("stages", 2, backend)
    for stage in (0, 2, 3):
        split = results.ranks(f"s{stage}_ep2")[0]["norms"]
        replicated = results.ranks(f"s{stage}")[0]["norms"]
        torch.testing.assert_close(
            torch.tensor(split, dtype=torch.float64),
            torch.tensor(replicated, dtype=torch.float64),
            rtol=RTOL,
            atol=ATOL,
        )


def test_leaf_modules_are_gathered_as_one_unit(suite: SuiteGetter, backend: str) -> None:
    """``leaf_module`` scenarios (which also match the reference, above): the MoE leaf holds
    its gate and experts in one unit, the whole-model leaf everything in two (the trainable
    parameters, the frozen ``frozen`` layer: frozen parameters never share a unit)."""
    results = suite("stages", 2, backend)
    net, seen, outside = TinyNet(1), set(), 0
    for name, sub in net.named_modules():
        own = [p for p in sub.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        outside += bool(own) and not name.startswith("moe")
    assert [r["partitioned_units"] for r in results.ranks("s3_leaf")] == [outside + 1] * 2
    assert [r["partitioned_units"] for r in results.ranks("s3_leaf_root")] == [2, 2]
    per_module = results.ranks("s3_persist")[0]["partitioned_units"]
    assert per_module > outside + 1, per_module  # without leaves the MoE is several units
