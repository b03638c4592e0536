"""ds_core.interop.lightning: Lightning 2.6's accelerator interfaces on ds_core backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

fabric_accelerators = pytest.importorskip("lightning.fabric.accelerators")
trainer_accelerators = pytest.importorskip("lightning.pytorch.accelerators")

import ds_core  # noqa: E402
from ds_core.interop import lightning as li  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASES = {
    "fabric": (fabric_accelerators.Accelerator, li.fabric_accelerator_class),
    "trainer": (trainer_accelerators.Accelerator, li.trainer_accelerator_class),
}
#: Methods the bases define with a default that does nothing or raises (the Trainer's
#: ``get_device_stats`` raises NotImplementedError): the adapter answers them too.
OVERRIDDEN = {
    "fabric": ["register_accelerators"],
    "trainer": ["register_accelerators", "get_device_stats", "setup"],
}
METHODS = [
    (kind, name)
    for kind, (base, _) in BASES.items()
    for name in sorted(base.__abstractmethods__) + OVERRIDDEN[kind]
]


def test_lightning_still_has_the_abstract_methods_this_file_knows() -> None:
    for kind, (base, make) in BASES.items():
        assert len(base.__abstractmethods__) >= 7, kind  # Lightning 2.6 has 7
        assert not make().__abstractmethods__


@pytest.mark.parametrize(("kind", "name"), METHODS)
def test_every_abstract_method_is_implemented(kind: str, name: str) -> None:
    cls = BASES[kind][1]()
    owner = next(c for c in cls.__mro__ if name in vars(c))
    assert owner is li.LightningMethods, f"{name} is answered by {owner.__qualname__}"


@pytest.mark.parametrize(
    ("registry_module", "make", "method"),
    [
        ("lightning.fabric.strategies", li.fabric_ddp_strategy_class, "setup_module"),
        ("lightning.pytorch.strategies", li.trainer_ddp_strategy_class, "_setup_model"),
    ],
)
def test_ds_core_ddp_is_lightnings_ddp_strategy_with_one_method_replaced(
    registry_module: str, make: Any, method: str
) -> None:
    import importlib

    module = importlib.import_module(registry_module)
    registry = getattr(module, "STRATEGY_REGISTRY", None) or module.StrategyRegistry
    entry = registry[li.DDP_STRATEGY]
    cls = make()
    assert entry["strategy"] is cls and entry["init_params"] == {"start_method": "popen"}
    assert cls.__bases__ == (module.DDPStrategy,)
    # only the method that enters a CUDA stream, and the registration, are ours
    assert sorted(k for k in vars(cls) if not k.startswith(("__", "_abc_"))) == sorted(
        [method, "register_strategies"]
    )
    li.register()  # idempotent
    assert registry[li.DDP_STRATEGY]["strategy"] is cls


def test_ds_core_is_registered_with_both_registries() -> None:
    fabric_entry = fabric_accelerators.ACCELERATOR_REGISTRY[li.NAME]
    trainer_entry = trainer_accelerators.AcceleratorRegistry[li.NAME]
    assert fabric_entry["accelerator"] is li.fabric_accelerator_class()
    assert trainer_entry["accelerator"] is li.trainer_accelerator_class()
    li.register()  # idempotent
    assert isinstance(
        trainer_accelerators.AcceleratorRegistry.get(li.NAME), trainer_accelerators.Accelerator
    )


def test_each_method_behaves_on_cpu() -> None:
    cls = li.trainer_accelerator_class()
    acc = cls()
    assert cls.name() == "ds_core" and cls.is_available() is True
    assert cls.auto_device_count() == 1
    assert cls.parse_devices(2) == 2 and cls.parse_devices("3") == 3
    assert cls.get_parallel_devices(2) == [torch.device("cpu")] * 2
    for bad in (0, -2, "x", [0], True):
        with pytest.raises(ValueError, match="backend 'cpu'"):
            cls.parse_devices(bad)
    acc.setup_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="SingleDeviceStrategy"):
        acc.setup_device(torch.device("meta"))
    stats = acc.get_device_stats(torch.device("cpu"))
    assert stats["allocated_bytes.all.current"] > 0 and stats["total_memory"] > 0
    acc.setup(SimpleNamespace(precision="32-true"))
    acc.teardown()


def test_ddp_on_cpu_defaults_to_the_backends_comm_backend() -> None:
    from lightning.fabric.utilities.distributed import (
        _get_default_process_group_backend_for_device,
    )

    li.fabric_accelerator_class()().setup_device(torch.device("cpu"))
    chosen = _get_default_process_group_backend_for_device(torch.device("cpu"))
    assert chosen == li.process_group_backend() == "gloo"


def test_a_precision_without_its_dtype_names_capability_and_backend() -> None:
    real = ds_core.get_accelerator()
    stub: Any = SimpleNamespace(name="nobf16", has=lambda cap: cap != "bf16")
    acc = li.trainer_accelerator_class()(stub)
    acc.setup(SimpleNamespace(precision="16-mixed"))
    with pytest.raises(ds_core.NotSupportedError) as info:
        acc.setup(SimpleNamespace(precision="bf16-mixed"))
    assert info.value.capability == "bf16" and info.value.backend == "nobf16"
    assert real.has("fp16")  # the stub, not the cpu backend, lacks bf16


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_unavailable_backend_is_one_clear_error() -> None:
    code = (
        "import ds_core.interop.lightning as li; assert li.LightningMethods.is_available() is "
        "False; from lightning.fabric import Fabric; Fabric(accelerator='ds_core')"
    )
    out = _python(code, DS_ACCELERATOR="no_such_backend")
    assert out.returncode != 0
    assert "BackendSelectionError" in out.stderr and "no_such_backend" in out.stderr


def test_importing_ds_core_does_not_import_lightning() -> None:
    code = (
        "import sys, ds_core, ds_core.interop, ds_core.interop.deepspeed; ds_core.get_accelerator();"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', "
        "'pytorch_lightning', 'lightning_fabric')))"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- training


def _train(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    """One worker command; Lightning's launcher starts the second rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_SIM_", "PL_"))}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(key, None)
    env.update(DS_ACCELERATOR=kind, OMP_NUM_THREADS="1")
    if kind == "sim":
        env["DS_SIM_DEVICES"] = "2"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.interop._lightning_worker", kind, str(tmp_path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as timeout:
        err = timeout.stderr.decode() if isinstance(timeout.stderr, bytes) else timeout.stderr
        raise AssertionError(f"{kind} worker timed out:\n{(err or '')[-6000:]}") from None
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Fabric and Trainer, each on accelerator="cpu" and on "ds_core" (backend cpu)."""
    return _train(tmp_path_factory.mktemp("lightning-cpu"), "cpu")


def _close(ours: list[float], theirs: list[float], atol: float) -> None:
    assert len(ours) == len(theirs) > 0
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["fabric", "trainer"])
def test_ddp_on_ds_core_matches_lightnings_cpu_accelerator(
    cpu_runs: list[dict[str, Any]], api: str
) -> None:
    for rank in cpu_runs:
        theirs, ours = rank[f"{api}_cpu"], rank[f"{api}_ds_core"]
        assert theirs["accelerator"] == "CPUAccelerator"
        assert ours["accelerator"] in ("DSCoreFabricAccelerator", "DSCoreAccelerator")
        assert ours["process_group"] == theirs["process_group"] == "gloo"
        assert ours["device"] == "cpu"
        _close(ours["losses"], theirs["losses"], atol=1e-6)


@pytest.mark.slow
def test_sim_ddp_and_single_device_match_the_cpu_runs(
    tmp_path: Path, cpu_runs: list[dict[str, Any]]
) -> None:
    pytest.importorskip("ds_backend_sim")
    sim = _train(tmp_path, "sim")
    # the mean of the two cpu ranks' half-batch losses is the whole batch's loss
    whole = [
        (a + b) / 2
        for a, b in zip(
            cpu_runs[0]["fabric_ds_core"]["losses"],
            cpu_runs[1]["fabric_ds_core"]["losses"],
            strict=True,
        )
    ]
    for rank, result in enumerate(sim):
        # DDP with strategy="ds_core_ddp": each rank's losses are Lightning's own CPU run's
        for api in ("fabric", "trainer"):
            ours, theirs = result[api], cpu_runs[rank][f"{api}_cpu"]
            assert ours["accelerator"] in ("DSCoreFabricAccelerator", "DSCoreAccelerator")
            assert ours["device"] == f"sim:{rank}" and ours["process_group"] == "simccl"
            _close(ours["losses"], theirs["losses"], atol=1e-6)
        assert result["single"]["device"] == f"sim:{rank}"
        _close(result["single"]["losses"], whole, atol=1e-5)
