"""A corpus of real DeepSpeed programs run on ds_core (issue 26 §5; docs/from-deepspeed.md,
"A corpus of real clients").

Each module transcribes one program (its header names the source repository, path and commit;
every departure is marked ``# CHANGED: <why>``). The program's own ``import deepspeed`` resolves
to ds_core through :func:`deepspeed_shim`; each module has ``run(world, rank, outdir) -> dict``
(per-rank losses and final weights) and ``reference(world, results) -> dict``, its plain-PyTorch
twin: the same model trained in one process on every rank's batches (each rank's forward on its
own batch, the losses averaged as data parallelism averages gradients).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

#: Client modules, in the order the rank job runs them.
CLIENTS = (
    "cifar10",
    "cifar10_moe",
    "gan",
    "hello_bert",
    "dschat_sft",
    "unit_lr_schedule",
    "unit_lr_checkpoint",
    "unit_unused_params",
)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``deepspeed.X`` is ``ds_core.X`` (the same module object); a name ds_core lacks is
    a ``ModuleNotFoundError``, as for any missing module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module("ds_core" + spec.name[len("deepspeed") :])

    def exec_module(self, module: ModuleType) -> None:
        pass


@contextmanager
def deepspeed_shim() -> Iterator[ModuleType]:
    """``import deepspeed`` (and ``deepspeed.X``) gives ds_core inside; the real DeepSpeed
    (installed here) and anything imported under its name are put back after."""
    saved = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    for name in saved:
        del sys.modules[name]
    finder = _Alias()
    sys.meta_path.insert(0, finder)
    try:
        yield importlib.import_module("deepspeed")
    finally:
        sys.meta_path.remove(finder)
        for name in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def load(name: str) -> ModuleType:
    """Client module ``name``, imported under the shim (its ``import deepspeed`` is ds_core's)."""
    with deepspeed_shim():
        return importlib.import_module(f"tests.compat.clients.{name}")


def run_all(outdir: str, names: Sequence[str] = CLIENTS) -> dict[str, Any]:
    """The rank job: every client on this rank, under the shim; client name -> its results,
    every tensor copied to the host (the test process compares them with host twins)."""
    import os
    import time
    import traceback

    from ds_core import comm
    from tests.zero._common import to_host

    rank, world = comm.get_rank(), comm.get_world_size()
    out: dict[str, Any] = {}
    for name in names:
        workdir = os.path.join(outdir, name)
        os.makedirs(workdir, exist_ok=True)
        try:
            module = load(name)
            start = time.perf_counter()
            with deepspeed_shim():
                out[name] = module.run(world, rank, workdir)
            out[name]["seconds"] = time.perf_counter() - start
        except Exception:  # reported by the client's test; the other clients still run
            out[name] = {"error": traceback.format_exc()}
        comm.barrier()
    return to_host(out)


def run_some(outdir: str, names: Sequence[str]) -> dict[str, Any]:
    return run_all(outdir, names)
