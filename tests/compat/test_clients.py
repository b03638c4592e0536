"""A corpus of real DeepSpeed programs (tests/compat/clients) on 2 ranks under the
``deepspeed`` -> ds_core shim, each against its plain-PyTorch twin: every rank's losses within
1e-5 relative at fp32, and the final weights alike (docs/from-deepspeed.md, "A corpus of real
clients").

``results`` is parametrised by :data:`tests.compat.conftest.COMPAT_BACKENDS`: the programs put
their models and batches on the accelerator's device (``get_accelerator()``, as they put them
on ``cuda``), so on ``sim`` they train on a device that is not the host, against the same
host twins."""

from __future__ import annotations

import importlib
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compat import clients
from tests.compat.clients import _twin
from tests.compat.conftest import COMPAT_BACKENDS, WORLD
from tests.rankpool import RankPools
from tests.zero._common import backend_env

LOSS_RTOL = 1e-5
CLIENT_DIR = Path(clients.__file__).parent
DOC = Path(__file__).resolve().parents[2] / "docs" / "from-deepspeed.md"


@pytest.fixture(scope="module", params=COMPAT_BACKENDS)
def results(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    rank_pools: RankPools,
) -> dict[str, Any]:
    """Client name -> each rank's results (one rank-pool job runs them all, results on the
    host), and ``"backend"``: the matrix entry."""
    backend = str(request.param)
    tmp = tmp_path_factory.mktemp(f"compat_clients-{backend}")
    pool = rank_pools.get(WORLD, backend_env(backend, WORLD))
    per_rank = pool.run("tests.compat.clients:run_all", str(tmp))
    out: dict[str, Any] = {name: [r[name] for r in per_rank] for name in clients.CLIENTS}
    out["backend"] = backend
    return out


#: (backend, client) -> the twin's results; the batches a client draws differ per backend
#: (the device's generator draws them on sim), so each backend's run has its own twin run.
_REFS: dict[tuple[str, str], dict[str, Any]] = {}


def reference(results: dict[str, Any], name: str) -> dict[str, Any]:
    key = (results["backend"], name)
    if key not in _REFS:
        _REFS[key] = clients.load(name).reference(WORLD, results[name])
    return _REFS[key]


def ok(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    got = results[name]
    for rank, r in enumerate(got):
        assert "error" not in r, f"{name} raised on rank {rank}:\n{r['error']}"
    return got


def assert_losses(got: list[float], want: list[float], what: str) -> None:
    assert all(math.isfinite(v) for v in got), what
    assert _twin.max_rel(got, want) <= LOSS_RTOL, f"{what}: {got} vs {want}"


def assert_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for key, value in want.items():
        if not value.is_floating_point() or "running_" in key:
            continue  # BatchNorm's statistics are per rank (DeepSpeed does not average buffers)
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=f"{what}: {key}")


LOSS_CURVES = [
    "cifar10",
    "hello_bert",
    "dschat_sft",
    "unit_lr_schedule",
    "unit_lr_checkpoint",
    "unit_unused_params",
]


@pytest.mark.parametrize("name", LOSS_CURVES)
def test_client_matches_its_twin(results: dict[str, Any], name: str) -> None:
    got = ok(results, name)
    ref = reference(results, name)
    for rank in range(WORLD):
        assert_losses(got[rank]["losses"], ref["losses"][rank], f"{name} rank {rank}")
        assert_state(got[rank]["state"], ref["state"], f"{name} rank {rank}")


def test_cifar10_moe_matches_a_plain_top1_mixture(results: dict[str, Any]) -> None:
    """Expert parallelism over the 2 ranks: rank r holds expert r (``experts.0``)."""
    got = ok(results, "cifar10_moe")
    ref = reference(results, "cifar10_moe")
    for rank in range(WORLD):
        assert_losses(got[rank]["losses"], ref["losses"][rank], f"cifar10_moe rank {rank}")
        want = {}
        for key, value in ref["state"].items():
            expert = re.fullmatch(r"(.*\.experts\.)(\d+)(\..*)", key)
            if expert is None:
                want[key] = value
            elif int(expert[2]) == rank:
                want[expert[1] + "0" + expert[3]] = value
        assert_state(got[rank]["state"], want, f"cifar10_moe rank {rank}")


def test_gan_two_engines_match_their_twin(results: dict[str, Any]) -> None:
    got = ok(results, "gan")
    ref = reference(results, "gan")
    for rank in range(WORLD):
        assert_losses(got[rank]["d_losses"], ref["d_losses"], f"gan D rank {rank}")
        assert_losses(got[rank]["g_losses"], ref["g_losses"], f"gan G rank {rank}")
        assert_state(got[rank]["G"], ref["G"], "gan G")
        assert_state(got[rank]["D"], ref["D"], "gan D")


def test_program_specifics(results: dict[str, Any]) -> None:
    """What each program does besides training: DeepSpeed's data loader shards the cifar set
    (64 samples, 8 per rank and step, 3 epochs); HelloDeepSpeed saves a checkpoint;
    DeepSpeed-Chat evaluates before and after each epoch; the checkpoint test's second engine
    loads the first's weights (its schedule's state is compared inside the program)."""
    cifar = ok(results, "cifar10")
    assert [len(r["losses"]) for r in cifar] == [12, 12]
    assert all(len(b[0]) == 8 for r in cifar for b in r["batches"])
    bert = ok(results, "hello_bert")
    assert any(path.endswith(".pt") or "latest" in path for path in bert[0]["saved"]), bert[0][
        "saved"
    ]
    chat = ok(results, "dschat_sft")
    assert [len(r["eval_losses"]) for r in chat] == [3, 3]
    assert chat[0]["eval_losses"] == chat[1]["eval_losses"]  # all-reduced means
    assert chat[0]["eval_losses"][-1] < chat[0]["eval_losses"][0]
    for r in ok(results, "unit_lr_checkpoint"):
        for key, value in r["state"].items():
            assert torch.equal(r["loaded_state"][key], value), key


def test_unused_parameters_without_ignore_raise_at_the_first_step(
    results: dict[str, Any],
) -> None:
    """DeepSpeed's test expects ``ignore_unused_parameters: false`` to raise (an
    ``AssertionError`` from its offload norm) at stage 2 with CPU offload; ds_core raises a
    ``RuntimeError`` naming the key at the same step: the first micro-batch's step is not a
    boundary (accumulation 2), the second's is."""
    for r in ok(results, "unit_unused_params"):
        refused = r["refused"]
        assert refused["raised"] == "RuntimeError", refused
        assert "ignore_unused_parameters" in refused["message"], refused
        assert refused["micro_batches"] == 1, refused


def test_shim_resolves_deepspeed_to_ds_core_and_restores() -> None:
    before = sys.modules.get("deepspeed")
    with clients.deepspeed_shim() as ds:
        import ds_core
        import ds_core.runtime.lr_schedules

        assert ds is ds_core
        assert (
            importlib.import_module("deepspeed.runtime.lr_schedules")
            is ds_core.runtime.lr_schedules
        )
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("deepspeed.inference")  # nothing invented
    assert sys.modules.get("deepspeed") is before


def test_every_client_names_its_source_and_marks_its_changes() -> None:
    """Each client's header names the repository, path and commit it transcribes; the doc's
    table has a row per client module."""
    doc = DOC.read_text()
    section = doc[doc.index("## A corpus of real clients") :]
    for name in clients.CLIENTS:
        text = (CLIENT_DIR / f"{name}.py").read_text()
        head = text[: text.index('"""', 3)]
        assert re.search(r"github\.com/deepspeedai/\S+", head), name
        assert re.search(r"\b[0-9a-f]{40}\b", head), name
        assert f"tests/compat/clients/{name}.py" in section, name
