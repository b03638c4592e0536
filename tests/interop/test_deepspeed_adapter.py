"""ds_core.interop.deepspeed: DeepSpeed 0.19.8's accelerator interface on ds_core backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

deepspeed_abc = pytest.importorskip("deepspeed.accelerator.abstract_accelerator")

import ds_core  # noqa: E402
from ds_core.interop import deepspeed as dsi  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ABSTRACT = sorted(deepspeed_abc.DeepSpeedAccelerator.__abstractmethods__)


@pytest.fixture(scope="module")
def adapter() -> Any:
    return dsi.adapter(ds_core.get_accelerator())


def test_deepspeed_still_has_the_abstract_methods_this_file_knows() -> None:
    assert len(ABSTRACT) >= 65  # DeepSpeed 0.19.8 has 65
    assert not dsi.adapter_class().__abstractmethods__


@pytest.mark.parametrize("name", ABSTRACT)
def test_every_abstract_method_is_implemented(name: str) -> None:
    cls = dsi.adapter_class()
    owner = next(c for c in cls.__mro__ if name in vars(c))
    assert owner is dsi.DeepSpeedMethods, f"{name} is answered by {owner.__qualname__}"


def test_the_adapter_is_a_deepspeed_accelerator(adapter: Any) -> None:
    real = pytest.importorskip("deepspeed.accelerator.real_accelerator")
    real._validate_accelerator(adapter)  # raises unless DeepSpeed accepts it
    assert adapter._name == "cpu" and adapter._communication_backend_name == "gloo"


def _expected_on_cpu(adapter: Any) -> dict[str, Any]:
    """name -> (call, check) for every abstract method on the cpu backend."""
    t = torch.zeros(3)
    state = torch.get_rng_state()
    env: dict[str, str] = {}
    return {
        "is_synchronized_device": (lambda: adapter.is_synchronized_device(), True),
        "use_host_timers": (lambda: adapter.use_host_timers(), True),
        "resolves_data_dependency": (lambda: adapter.resolves_data_dependency(), True),
        "handles_memory_backpressure": (lambda: adapter.handles_memory_backpressure(), True),
        "device_name": (lambda: (adapter.device_name(), adapter.device_name(0)), ("cpu", "cpu")),
        "device": (lambda: adapter.device(0), torch.device("cpu")),
        "set_device": (lambda: adapter.set_device(0), None),
        "current_device": (lambda: adapter.current_device(), 0),
        "current_device_name": (lambda: adapter.current_device_name(), "cpu"),
        "device_count": (lambda: adapter.device_count(), 1),
        "synchronize": (lambda: adapter.synchronize(), None),
        "random": (lambda: adapter.random(), torch.random),
        "set_rng_state": (lambda: adapter.set_rng_state(state), None),
        "get_rng_state": (lambda: adapter.get_rng_state().dtype, torch.uint8),
        "manual_seed": (lambda: (adapter.manual_seed(5), torch.initial_seed())[1], 5),
        "manual_seed_all": (lambda: (adapter.manual_seed_all(6), torch.initial_seed())[1], 6),
        "initial_seed": (lambda: (torch.manual_seed(7), adapter.initial_seed())[1], 7),
        "default_generator": (lambda: adapter.default_generator(0), torch.default_generator),
        "Stream": (lambda: callable(adapter.Stream) and adapter.Stream() is not None, True),
        "stream": (lambda: _enters(adapter.stream(adapter.Stream())), True),
        "current_stream": (lambda: adapter.current_stream() is not None, True),
        "default_stream": (lambda: adapter.default_stream() is not None, True),
        "Event": (lambda: _timed(adapter), True),
        "empty_cache": (lambda: adapter.empty_cache(), None),
        "memory_allocated": (lambda: adapter.memory_allocated() > 0, True),
        "max_memory_allocated": (
            lambda: adapter.max_memory_allocated() >= adapter.memory_allocated() > 0,
            True,
        ),
        "reset_max_memory_allocated": (lambda: adapter.reset_max_memory_allocated(), None),
        "memory_cached": (lambda: adapter.memory_cached() > 0, True),
        "max_memory_cached": (lambda: adapter.max_memory_cached() > 0, True),
        "reset_max_memory_cached": (lambda: adapter.reset_max_memory_cached(), None),
        "memory_stats": (lambda: "allocated_bytes.all.current" in adapter.memory_stats(), True),
        "reset_peak_memory_stats": (lambda: adapter.reset_peak_memory_stats(), None),
        "memory_reserved": (lambda: isinstance(adapter.memory_reserved(), int), True),
        "max_memory_reserved": (lambda: adapter.max_memory_reserved() > 0, True),
        "total_memory": (lambda: adapter.total_memory() >= adapter.available_memory() > 0, True),
        "available_memory": (lambda: isinstance(adapter.available_memory(), int), True),
        "is_bf16_supported": (lambda: adapter.is_bf16_supported(), True),
        "is_fp16_supported": (lambda: isinstance(adapter.is_fp16_supported(), bool), True),
        "supported_dtypes": (lambda: torch.float32 in adapter.supported_dtypes(), True),
        "is_available": (lambda: adapter.is_available(), True),
        "range_push": (lambda: (adapter.range_push("x"), adapter.range_pop())[0], None),
        "range_pop": (lambda: (adapter.range_push("y"), adapter.range_pop())[1], None),
        "lazy_call": (lambda: adapter.lazy_call(lambda: 11), 11),
        "communication_backend_name": (lambda: adapter.communication_backend_name(), "gloo"),
        "is_triton_supported": (lambda: adapter.is_triton_supported(), False),
        "create_graph": (lambda: _graph(adapter), 2.0),
        "capture_to_graph": (lambda: _graph(adapter), 2.0),
        "replay_graph": (lambda: _graph(adapter), 2.0),
        "BFloat16Tensor": (lambda: adapter.BFloat16Tensor([1]).dtype, torch.bfloat16),
        "ByteTensor": (lambda: adapter.ByteTensor([1]).dtype, torch.uint8),
        "DoubleTensor": (lambda: adapter.DoubleTensor([1]).dtype, torch.float64),
        "FloatTensor": (lambda: adapter.FloatTensor([1]).dtype, torch.float32),
        "HalfTensor": (lambda: adapter.HalfTensor([1]).dtype, torch.float16),
        "IntTensor": (lambda: adapter.IntTensor([1]).dtype, torch.int32),
        "LongTensor": (lambda: adapter.LongTensor([1]).device, torch.device("cpu")),
        "on_accelerator": (
            lambda: (adapter.on_accelerator(t), adapter.on_accelerator(t)),
            (True, True),
        ),
        "op_builder_dir": (lambda: adapter.op_builder_dir(), "deepspeed.ops.op_builder.cpu"),
        "create_op_builder": (lambda: adapter.create_op_builder("CPUAdamBuilder").NAME, "cpu_adam"),
        "get_op_builder": (
            lambda: adapter.get_op_builder("CPUAdamBuilder").__name__,
            "CPUAdamBuilder",
        ),
        "build_extension": (lambda: adapter.build_extension().__name__, "BuildExtension"),
        "export_envs": (lambda: isinstance(adapter.export_envs(), list), True),
        "visible_devices_envs": (lambda: isinstance(adapter.visible_devices_envs(), list), True),
        "set_visible_devices_envs": (
            lambda: (adapter.set_visible_devices_envs(env, [0, 1]), set(env.values()) <= {"0,1"})[
                1
            ],
            True,
        ),
        "get_compile_backend": (lambda: adapter.get_compile_backend(), "inductor"),
        "set_compile_backend": (lambda: adapter.set_compile_backend("inductor"), None),
    }


def _enters(cm: Any) -> bool:
    with cm:
        return True


def _timed(adapter: Any) -> bool:
    start, end = adapter.Event(enable_timing=True), adapter.Event(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) >= 0.0


def _graph(adapter: Any) -> float:
    ds_core.get_accelerator().configure({"cpu": {"graph_capture": True}})
    try:
        x = torch.ones(2)
        graph = adapter.create_graph()
        with adapter.capture_to_graph(graph):
            y = x * 2
        x.fill_(1.0)
        adapter.replay_graph(graph)
        return float(y[0])
    finally:
        ds_core.get_accelerator().configure({"cpu": {"graph_capture": False}})


def test_each_abstract_method_behaves_on_cpu(adapter: Any) -> None:
    expected = _expected_on_cpu(adapter)
    assert set(ABSTRACT) <= set(expected), f"no check for {set(ABSTRACT) - set(expected)}"
    seed = torch.initial_seed()
    try:
        for name in ABSTRACT:
            call, want = expected[name]
            assert call() == want, name
    finally:
        torch.manual_seed(seed)


def test_a_missing_capability_names_it_and_the_backend(adapter: Any) -> None:
    # The cpu backend does not declare pinned_memory: pinning is refused, never faked.
    with pytest.raises(ds_core.NotSupportedError, match=r"'pinned_memory'.*backend 'cpu'"):
        adapter.pin_memory(torch.zeros(2))
    with pytest.raises(ds_core.NotSupportedError, match=r"'pinned_memory'.*backend 'cpu'"):
        adapter.pin_empty(4, dtype=torch.float32)


def test_graph_capture_off_by_default_and_refused_where_absent(adapter: Any) -> None:
    with pytest.raises(ds_core.DSCoreError, match="graph capture is off on 'cpu'"):
        adapter.create_graph()
    no_graphs = dsi.adapter(_WithoutCapability(ds_core.get_accelerator(), "graph_capture"))
    for call in (no_graphs.create_graph, lambda: no_graphs.capture_to_graph(object())):
        with pytest.raises(ds_core.NotSupportedError, match=r"'graph_capture'.*backend 'cpu'"):
            call()


class _WithoutCapability:
    """The cpu facade with one capability taken away (a backend that lacks it)."""

    def __init__(self, inner: Any, capability: str) -> None:
        self._inner, self._missing = inner, capability

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def has(self, capability: str) -> bool:
        return capability != self._missing and self._inner.has(capability)

    def create_graph(self) -> Any:
        raise ds_core.NotSupportedError(self._missing, self._inner.name, "create_graph()")


def test_an_op_nothing_provides_is_refused_naming_op_and_backend(adapter: Any) -> None:
    builder = adapter.create_op_builder("NoSuchBuilder")
    assert builder.is_compatible() is False
    with pytest.raises(dsi.OpNotAvailableError, match=r"'NoSuchBuilder'.*backend 'cpu'"):
        builder.load()
    # DeepSpeed's own builder for the device type answers what ds_core does not map...
    assert adapter.get_op_builder("CCLCommBuilder").__module__.startswith("deepspeed.ops")
    # ...and where it has none, the builders DeepSpeed's comm layer probes for are None (it
    # checks for None and does without them), as DeepSpeed's own accelerators answer.
    bare = dsi.adapter(ds_core.get_accelerator())
    bare._native_looked_up = True  # as on a device type DeepSpeed has no builders for
    assert bare.get_op_builder("CCLCommBuilder") is None
    assert bare.get_op_builder("FusedAdamBuilder")().is_compatible() is False
    assert bare.op_builder_dir() == "deepspeed.ops.op_builder.cpu"


def test_cpu_adam_builder_runs_ds_core_kernel_with_deepspeeds_module_interface(
    adapter: Any,
) -> None:
    module = adapter.create_op_builder("CPUAdamBuilder").load()
    p, g = torch.ones(8), torch.full((8,), 0.5)
    m, v = torch.zeros(8), torch.zeros(8)
    ref = torch.nn.Parameter(torch.ones(8))
    ref.grad = g.clone()
    opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.01)
    module.create_adam(0, 0.1, 0.9, 0.999, 1e-8, 0.01, True, False)
    module.adam_update(0, 1, 0.1, 0.9, 0.999, 1e-8, 0.01, True, p, g, m, v)
    module.destroy_adam(0)
    opt.step()
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


def test_an_unavailable_backend_is_a_clear_error() -> None:
    code = "import ds_core.interop.deepspeed as d; d.adapter()"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "DS_ACCELERATOR": "no_such_backend"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "BackendSelectionError" in out.stderr and "no_such_backend" in out.stderr


# --------------------------------------------------------------------------- start hook

PTH = ROOT / "ds_core_deepspeed.pth"
PROBE = """
import json, site, sys, time
t = time.perf_counter()
site.addsitedir(sys.argv[1])
cost = time.perf_counter() - t
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("ds_core", "deepspeed", "torch",
                "ds_core_deepspeed_hook"))
installed = None
if len(sys.argv) > 2:
    import deepspeed
    installed = type(deepspeed.get_accelerator()).__name__
print(json.dumps({"cost": cost, "loaded": loaded, "installed": installed}))
"""


def _start(tmp_path: Path, env_value: str | None, import_deepspeed: bool) -> dict[str, Any]:
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / PTH.name).write_text(PTH.read_text())
    env = {k: v for k, v in os.environ.items() if k != dsi.ENV_HOOK}
    if env_value is not None:
        env[dsi.ENV_HOOK] = env_value
    args = [sys.executable, "-c", PROBE, str(site_dir)] + (["go"] if import_deepspeed else [])
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_start_hook_unset_imports_nothing_and_is_cheap(tmp_path: Path) -> None:
    result = _start(tmp_path, None, import_deepspeed=False)
    assert result["loaded"] == []
    assert result["cost"] < 0.005  # docs/interop.md quotes the measured figure


def test_start_hook_set_installs_the_adapter_before_deepspeed_chooses(tmp_path: Path) -> None:
    armed = _start(tmp_path, "1", import_deepspeed=False)
    assert armed["loaded"] == ["ds_core_deepspeed_hook"]  # nothing heavy until DeepSpeed
    result = _start(tmp_path, "1", import_deepspeed=True)
    assert result["installed"] == "DeepSpeedAdapter"


def test_install_makes_deepspeed_accept_a_backend_it_does_not_list() -> None:
    pytest.importorskip("ds_backend_sim")
    code = (
        "import ds_core.interop.deepspeed as d; a = d.install(); import deepspeed;"
        "acc = deepspeed.get_accelerator(); assert acc is a, acc;"
        "print(acc.device_name(), acc.device_name(1))"
    )
    env = {**os.environ, "DS_ACCELERATOR": "sim", "DS_SIM_DEVICES": "2"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["sim", "sim:1"]


# --------------------------------------------------------------------------- training


def _train(tmp_path: Path, mode: str, backend: str, stages: str) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_SIM_")}
    env.update(DS_ACCELERATOR=backend, OMP_NUM_THREADS="1")
    if backend == "sim":
        env["DS_SIM_DEVICES"] = "2"
    outdir = tmp_path / f"{mode}-{backend}"
    outdir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interop._ds_worker", mode, str(outdir), stages],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((outdir / f"{mode}.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def deepspeed_cpu_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """DeepSpeed 0.19.8 on its own CPU accelerator (gloo; no oneCCL here), stages 0-3."""
    return _train(tmp_path_factory.mktemp("ds"), "deepspeed", "cpu", "0123")


@pytest.fixture(scope="module")
def adapter_cpu_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _train(tmp_path_factory.mktemp("adapter"), "adapter", "cpu", "0123")


@pytest.mark.slow
def test_zero_stages_through_the_adapter_match_deepspeeds_cpu_accelerator(
    deepspeed_cpu_run: list[dict[str, Any]], adapter_cpu_run: list[dict[str, Any]]
) -> None:
    for theirs, ours in zip(deepspeed_cpu_run, adapter_cpu_run, strict=True):
        assert theirs["accelerator"] == "CPU_Accelerator"
        assert ours["accelerator"] == "DeepSpeedAdapter"
        assert set(ours["losses"]) == STAGE_KEYS
        for stage, losses in ours["losses"].items():
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(theirs["losses"][stage]), rtol=0, atol=1e-6
            )


@pytest.mark.slow
def test_sim_through_the_adapter_matches_the_cpu_run_at_every_stage(
    tmp_path: Path, adapter_cpu_run: list[dict[str, Any]]
) -> None:
    pytest.importorskip("ds_backend_sim")
    sim = _train(tmp_path, "adapter", "sim", "0123")
    reference = {kind: _one_process_losses(kind) for kind in ("simple", "gpt")}
    for rank, (cpu, ours) in enumerate(zip(adapter_cpu_run, sim, strict=True)):
        assert ours["device"] == f"sim:{rank}"
        assert set(ours["losses"]) == STAGE_KEYS
        for stage, losses in ours["losses"].items():
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(cpu["losses"][stage]), rtol=0, atol=1e-5
            )
            kind = "gpt" if stage.startswith("gpt") else "simple"
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(reference[kind][rank]), rtol=0, atol=1e-5
            )


#: result keys of tests/interop/_ds_worker.py: SimpleModel's stages, then the example GPT's
STAGE_KEYS = {"0", "1", "2", "3", "gpt0", "gpt1", "gpt2", "gpt3"}


def _one_process_losses(kind: str) -> list[list[float]]:
    """The two ranks' losses of tests/interop/_ds_worker.py computed in one process: the
    same model and data, the gradient of the ranks' mean loss (DeepSpeed averages over the
    data-parallel ranks), clipped to DeepSpeed's default norm 1.0, then torch's Adam."""
    from tests.interop import _ds_worker as w

    model = w.build(kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses: list[list[float]] = [[] for _ in range(w.WORLD)]
    for x, y in w.batches(kind):
        per_rank = [
            model(x[r * w.MICRO : (r + 1) * w.MICRO], y[r * w.MICRO : (r + 1) * w.MICRO])
            for r in range(w.WORLD)
        ]
        for r, loss in enumerate(per_rank):
            losses[r].append(float(loss.detach()))
        optimizer.zero_grad()
        torch.stack(per_rank).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return losses
