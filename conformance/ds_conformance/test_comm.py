"""Collectives on 2 and 4 real ranks over the backend's comm library, checked locally.

One group of rank processes per world size runs every case (see :mod:`comm_cases`, shared
with the ZeRO smoke test through :mod:`ds_conformance.ranks`); the tests below report each
case. Ranks are processes on the ``cpu`` device type; elsewhere a world size needs that many
devices, else its cases skip. Cases whose id contains ``late-`` check blocking semantics with
a late peer; ``stream-`` cases check stream ordering (``async_streams`` backends only);
``strided`` and ``transposed`` cases pass non-contiguous views (``comm_cases.LAYOUTS``).
"""

from __future__ import annotations

from typing import Any

import pytest

from ds_conformance.comm_cases import Case, cases
from ds_conformance.marks import capability, hooks, tier
from ds_conformance.ranks import RankGroups

pytestmark = tier("multi-rank")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        from ds_conformance.plugin import suite_of

        collective = metafunc.function.__name__.removeprefix("test_")
        chosen = [
            pytest.param(c, id=c.id, marks=[capability(c.capability)] if c.capability else [])
            for c in cases(suite_of(metafunc.config).acc.supported_dtypes())
            if c.collective == collective
        ]
        metafunc.parametrize("case", chosen)


def _result(acc: Any, groups: RankGroups, case: Case) -> None:
    __tracebackhide__ = True
    groups.result(acc, case.world, case.key)


@hooks("ds_comm_all_reduce", "ds_comm_prepare", "ds_comm_backend_name")
def test_all_reduce(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_all_gather")
def test_all_gather(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_reduce_scatter")
def test_reduce_scatter(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_broadcast")
def test_broadcast(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_all_to_all")
def test_all_to_all(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_send", "ds_comm_recv", "ds_comm_batch_isend_irecv")
def test_p2p(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_barrier")
def test_barrier(acc: Any, rank_groups: RankGroups, case: Case) -> None:
    _result(acc, rank_groups, case)


@hooks("ds_comm_backend_name")
def test_backend_name_is_a_torch_distributed_backend(acc: Any) -> None:
    import torch.distributed as dist

    name = acc.communication_backend_name()
    acc.prepare_communication()
    known = {b.lower() for b in dist.Backend.backend_list} | {
        b.lower() for b in getattr(dist.Backend, "_plugins", {})
    }
    if name.lower() not in known:
        pytest.fail(
            f"communication_backend_name()={name!r}, but should be one of {sorted(known)} after ds_comm_prepare [ds_comm_backend_name]",
            pytrace=False,
        )
