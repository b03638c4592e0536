"""Rank worker: ``python -m tests.compat._outside_backward IMPL OUTFILE``.

Gradients made outside ``engine.backward`` (issue 26 §3): small programs run once with real
DeepSpeed (IMPL ``deepspeed``, its own CPU accelerator, gloo) and once with ds_core (IMPL
``ds_core``, ``import ds_core as deepspeed``), at ZeRO stages 0-3, two spawned ranks, one process
group for every program. Each program records its losses and final parameters, or the
exception it raised; rank 0 writes ``{program: {stage: result}}`` to OUTFILE as JSON, and
``tests/compat/test_outside_backward.py`` compares the two.

What DeepSpeed 0.19.8 does (``deepspeed/runtime/engine.py``; read for these programs):

- ``DeepSpeedEngine.forward`` registers output hooks (``register_output_backward_hooks``) whose
  first call runs ``_backward_prologue`` and whose per-tensor call divides the gradient by
  ``gradient_accumulation_steps`` unless an ``engine.backward`` of *any* engine is running
  (``_ENGINE_BACKWARD_GRAPH_TRACKER``). ``_backward_prologue`` raises "Direct calls to
  tensor.backward() are not supported in this configuration" when the engine has no
  PyTorch-style support (stage 0, ``_support_torch_style_backward`` false) and this engine's
  ``backward`` is not running (``_running_engine_backward``).
- ``DeepSpeedEngine.zero_grad`` sets ``p.grad = None`` for the module's parameters; the
  optimizer ``initialize`` returns is the client optimizer at stage 0 (its ``zero_grad``) and
  the ZeRO optimizer at stages 1-3 (``DeepSpeedZeroOptimizer.zero_grad``,
  ``DeepSpeedZeroOptimizer_Stage3.zero_grad``).
- Stages 1-2 (``runtime/zero/stage_1_and_2.py``) and 3 (``runtime/zero/stage3.py``) register
  gradient hooks on the parameters that fire in any backward reaching them, engine or not.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from tests.compat._loops import DIM, NZ, Discriminator, Generator
from tests.rankpool import free_port, rank_env

WORLD = 2
MICRO = 2
ITERS = 3
HIDDEN = 8
STAGES = (0, 1, 2, 3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).view(-1)


def config(stage: int, gas: int = 1, optimizer: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10_000,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if optimizer:
        # torch's Adam through the config: DeepSpeed's FusedAdam would need a CUDA op build.
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
    return cfg


def params(ds: Any, *models: nn.Module) -> list[list[float]]:
    """Every parameter of ``models``, full (stage 3 gathers)."""
    out = []
    for model in models:
        ps = list(model.parameters())
        with ds.zero.GatheredParameters(ps):
            out.extend(p.detach().flatten().tolist() for p in ps)
    return out


# ---------------------------------------------------------------------------------- GAN


def gan(ds: Any, stage: int, rank: int, variant: str) -> dict[str, Any]:
    """DeepSpeedExamples' training/gan/gan_deepspeed_train.py loop, with ``variant``:

    - ``example``: as the example (raw ``netD(...)`` / ``netG(...)`` calls, ``netD.zero_grad()``
      before D's update, ``netG.zero_grad()`` before G's, ``model_engineG.backward(errG)``);
    - ``plain``: ``errG.backward()`` in place of ``model_engineG.backward(errG)``;
    - ``optimizer_zero``: ``optimizerD.zero_grad()`` / ``optimizerG.zero_grad()`` (the
      optimizers ``initialize`` returned) in place of the modules';
    - ``engine_zero``: ``model_engineD.zero_grad()`` / ``model_engineG.zero_grad()``;
    - ``no_zero``: no zero_grad at all, so G's loss leaves gradients on D's parameters;
    - ``engines``: every forward through the engines (``model_engineD(...)``), G's loss by
      ``model_engineG.backward(errG)``;
    - ``engines_plain``: the same with ``errG.backward()`` and ``errD_*.backward()``.
    """
    torch.manual_seed(0)
    netG, netD = Generator(), Discriminator()  # noqa: N806 (the example's names)
    criterion = nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))  # noqa: N806
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))  # noqa: N806
    model_engineD, optimizerD, _, _ = ds.initialize(  # noqa: N806
        model=netD, model_parameters=netD.parameters(), optimizer=optD, config=config(stage)
    )
    model_engineG, optimizerG, _, _ = ds.initialize(  # noqa: N806
        model=netG, model_parameters=netG.parameters(), optimizer=optG, config=config(stage)
    )
    g = torch.Generator().manual_seed(3)
    n = ITERS * WORLD * MICRO
    # Drawn on the host (every backend sees the same data), used on the engine's device.
    device = model_engineD.device
    reals = torch.randn(n, DIM, generator=g).to(device)
    noises = torch.randn(n, NZ, generator=g).to(device)
    through = variant in ("engines", "engines_plain")
    D = model_engineD if through else netD  # noqa: N806
    G = model_engineG if through else netG  # noqa: N806

    def zero(net: nn.Module, engine: Any, opt: Any) -> None:
        if variant == "optimizer_zero":
            opt.zero_grad()
        elif variant == "engine_zero":
            engine.zero_grad()
        elif variant != "no_zero":
            net.zero_grad()

    def backward(engine: Any, loss: torch.Tensor) -> None:
        if variant == "engines_plain":
            loss.backward()
        else:
            engine.backward(loss)

    losses = []
    try:
        for i in range(ITERS):
            lo = (i * WORLD + rank) * MICRO
            real, noise = reals[lo : lo + MICRO], noises[lo : lo + MICRO]
            zero(netD, model_engineD, optimizerD)
            label = torch.full((MICRO,), 1.0, device=device)
            errD_real = criterion(D(real), label)  # noqa: N806
            backward(model_engineD, errD_real)
            fake = G(noise)
            label.fill_(0.0)
            errD_fake = criterion(D(fake.detach()), label)  # noqa: N806
            backward(model_engineD, errD_fake)
            model_engineD.step()
            zero(netG, model_engineG, optimizerG)
            label.fill_(1.0)
            errG = criterion(D(fake), label)  # noqa: N806
            if variant in ("plain", "engines_plain"):
                errG.backward()
            else:
                model_engineG.backward(errG)
            model_engineG.step()
            losses += [(errD_real + errD_fake).item(), errG.item()]
        return {"losses": losses, "params": params(ds, netG, netD)}
    finally:
        model_engineD.destroy()
        model_engineG.destroy()


# ------------------------------------------------------------------------ one engine


def single(ds: Any, stage: int, rank: int, variant: str) -> dict[str, Any]:
    """One engine over ``Net`` and an MSE loss, ``ITERS`` optimizer steps:

    - ``plain``: ``loss = mse(engine(x)); loss.backward(); engine.step()``;
    - ``plain_gas2``: the same with ``gradient_accumulation_steps`` 2 (two micro-batches per
      step);
    - ``plain_config_opt``: ``plain`` with the config's optimizer (torch Adam);
    - ``module_plain``: the module called directly (``model(x)``), ``loss.backward()``,
      ``engine.step()``: a backward the engine's forward never saw;
    - ``two_backwards``: ``engine.backward`` of two losses (two halves of the micro-batch)
      before each ``engine.step()``, ``gradient_accumulation_steps`` 1, as the GAN's
      discriminator does with ``errD_real`` and ``errD_fake``.
    """
    gas = 2 if variant == "plain_gas2" else 1
    torch.manual_seed(0)
    model = Net()
    cfg = config(stage, gas=gas, optimizer=variant == "plain_config_opt")
    if variant == "plain_config_opt":
        engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        engine, *_ = ds.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(5)
    n = ITERS * gas * WORLD * MICRO
    xs = torch.randn(n, HIDDEN, generator=g).to(engine.device)
    ys = torch.randn(n, generator=g).to(engine.device)
    fwd = model if variant == "module_plain" else engine
    losses = []
    try:
        for i in range(ITERS * gas):
            lo = (i * WORLD + rank) * MICRO
            if variant == "two_backwards":
                for half in (slice(lo, lo + 1), slice(lo + 1, lo + MICRO)):
                    loss = nn.functional.mse_loss(engine(xs[half]), ys[half])
                    engine.backward(loss)
                    losses.append(loss.item())
                engine.step()
                continue
            loss = nn.functional.mse_loss(fwd(xs[lo : lo + MICRO]), ys[lo : lo + MICRO])
            loss.backward()
            engine.step()
            losses.append(loss.item())
        return {"losses": losses, "params": params(ds, model)}
    finally:
        engine.destroy()


GAN_VARIANTS = (
    "example",
    "plain",
    "optimizer_zero",
    "engine_zero",
    "no_zero",
    "engines",
    "engines_plain",
)
SINGLE_VARIANTS = ("plain", "plain_gas2", "plain_config_opt", "module_plain", "two_backwards")
#: program name -> (function, variant); each run as ``function(ds, stage, rank, variant)``.
PROGRAMS: dict[str, tuple[Callable[[Any, int, int, str], dict[str, Any]], str]] = {
    **{f"gan_{v}": (gan, v) for v in GAN_VARIANTS},
    **{f"single_{v}": (single, v) for v in SINGLE_VARIANTS},
}


def run_one(ds: Any, name: str, stage: int, rank: int) -> dict[str, Any]:
    """The program's result, or the exception it raised (type and first line)."""
    try:
        fn, variant = PROGRAMS[name]
        return fn(ds, stage, rank, variant)
    except Exception as exc:  # recorded: the test compares refusals too
        if os.environ.get("OUTSIDE_BACKWARD_TRACE"):
            traceback.print_exc()
        return {"error": type(exc).__name__, "message": (str(exc).splitlines() or [""])[0][:300]}


def _rank(rank: int, port: int, impl: str, outfile: str, names: list[str]) -> None:
    os.environ.update(rank_env(rank, WORLD, port, LOCAL_SIZE=str(WORLD)))
    torch.set_num_threads(1)
    if impl == "deepspeed":
        import deepspeed as ds
        import deepspeed.ops

        # DeepSpeed's shared-memory inference all-reduce is a compiled op (about 100 s to
        # build on a cold cache) that training never calls: mark it unbuildable.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        import ds_core as ds  # type: ignore[no-redef]
    ds.init_distributed(dist_backend=None)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        for stage in STAGES:
            results.setdefault(name, {})[str(stage)] = run_one(ds, name, stage, rank)
            # A refusal on one rank only would desynchronise the collectives that follow.
            torch.distributed.barrier()
    if rank == 0:
        with open(outfile, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    impl, outfile = sys.argv[1], sys.argv[2]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(PROGRAMS)
    port = free_port()
    mp.spawn(_rank, args=(port, impl, outfile, names), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
