"""Rank-side jobs of the pipeline tests (run on the shared rank pools, tests/rankpool.py).

Models are built by :func:`layers`, the same on every rank and in the single-process
reference (:func:`reference`): a plain ``nn.ModuleList`` of the same layers, seeded per layer
as ``PipelineModule(seed_layers=True)`` does, trained with ``torch.optim.AdamW`` on the global
batch (every replica's micro-batches of a step in one backward of their mean loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any, cast
from unittest import mock

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import ds_core
from ds_core.pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec

LR, EPS, WD = 1e-2, 1e-6, 0.01
MICRO = 2  # samples per micro-batch
VOCAB, HID, SEQ = 10, 8, 3
BASE_SEED = 1234
CLIP = 0.3


def _head(emb: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ emb.weight.t()  # type: ignore[operator]


def layers(kind: str) -> list[Any]:
    """``mlp``: Linear/Tanh layers on float inputs; ``deep``: the same with four Linear layers;
    ``tied``: an embedding whose weight is also the LM head's (int64 tokens in, logits out)."""
    if kind == "tied":
        return [
            TiedLayerSpec("emb", nn.Embedding, VOCAB, HID),
            LayerSpec(nn.Linear, HID, HID),
            torch.tanh,
            LayerSpec(nn.Linear, HID, HID),
            TiedLayerSpec("emb", nn.Embedding, VOCAB, HID, forward_fn=_head),
        ]
    if kind == "deep":  # four layers with parameters: one per stage at PP=4
        return [
            LayerSpec(nn.Linear, HID, 12),
            torch.tanh,
            LayerSpec(nn.Linear, 12, 12),
            LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, 12, 12),
            LayerSpec(nn.Linear, 12, 4),
        ]
    return [
        LayerSpec(nn.Linear, HID, 12),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, 12, 12),
        torch.tanh,
        LayerSpec(nn.Linear, 12, 4),
    ]


def loss_fn(kind: str) -> Any:
    if kind == "tied":
        return lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return F.mse_loss


def batches(
    seed: int, steps: int, replicas: int, gas: int, vocab: int | None, seq: int, hid: int = HID
) -> list[list[list[Any]]]:
    """``[step][replica][micro]`` of ``(inputs, labels)``, drawn from one generator seeded
    ``seed``: ``MICRO × seq`` token ids below ``vocab`` for both, or (``vocab`` ``None``)
    ``MICRO × hid`` inputs and ``MICRO × 4`` labels from a normal distribution. The pipeline
    workers' (this one's and tests/pipe/_tp_worker.py's) data."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        reps = []
        for _ in range(replicas):
            mbs = []
            for _ in range(gas):
                if vocab is not None:
                    x = torch.randint(0, vocab, (MICRO, seq), generator=g)
                    y = torch.randint(0, vocab, (MICRO, seq), generator=g)
                else:
                    x = torch.randn(MICRO, hid, generator=g)
                    y = torch.randn(MICRO, 4, generator=g)
                mbs.append((x, y))
            reps.append(mbs)
        out.append(reps)
    return out


def data(kind: str, steps: int, replicas: int, gas: int) -> list[list[list[Any]]]:
    """``[step][replica][micro]`` of ``(inputs, labels)``."""
    return batches(7, steps, replicas, gas, VOCAB if kind == "tied" else None, SEQ)


def _built(kind: str) -> tuple[list[Any], dict[str, str]]:
    """The reference's layers (seeded per layer as ``seed_layers=True`` builds them; a tie's
    later positions reuse its first module) and each reference parameter's pipeline name."""
    mods: list[Any] = []
    names: dict[str, str] = {}
    tied: dict[str, nn.Module] = {}
    for idx, spec in enumerate(layers(kind)):
        torch.manual_seed(BASE_SEED + idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
                for n, _ in tied[spec.key].named_parameters():
                    names[f"{idx}.{n}"] = f"tied_modules.{spec.key}.{n}"
            m = tied[spec.key]
            mods.append(partial(spec.forward_fn, m) if spec.forward_fn is not None else m)
        elif isinstance(spec, LayerSpec):
            m = spec.build()
            mods.append(m)
            for n, _ in m.named_parameters():
                names[f"{idx}.{n}"] = f"{idx}.{n}"
        else:
            mods.append(spec)
    return mods, names


def reference(kind: str, batches: list[list[list[Any]]], clip: float) -> dict[str, Any]:
    """Single-process training of the same layers: losses per step and final parameters by
    their pipeline name."""
    mods, names = _built(kind)
    holder = nn.ModuleList([m for m in mods if isinstance(m, nn.Module)])
    params: dict[int, nn.Parameter] = {}
    for p in holder.parameters():
        params[id(p)] = p
    opt = torch.optim.AdamW(list(params.values()), lr=LR, eps=EPS, weight_decay=WD)
    fn = loss_fn(kind)
    losses = []
    for step in batches:
        opt.zero_grad()
        items = [mb for rep in step for mb in rep]
        total = torch.zeros(())
        for x, y in items:
            h = x
            for m in mods:
                h = m(h)
            total = total + fn(h, y)
        loss = total / len(items)
        loss.backward()  # type: ignore[no-untyped-call]
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
        losses.append(float(loss.detach()))
    final: dict[str, torch.Tensor] = {}
    for idx, m in enumerate(mods):
        if isinstance(m, nn.Module):
            for n, p in m.named_parameters():
                key = f"{idx}.{n}"
                if key in names:
                    final[names[key]] = p.detach().clone()
    return {"losses": losses, "params": final}


def _config(stage: int, gas: int, clip: float, extra: dict[str, Any] | None = None) -> Any:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
    }
    cfg.update(extra or {})
    return cfg


def _pipeline(module: PipelineModule, opt: Any, cfg: Any) -> PipelineEngine:
    """``ds_core.initialize``'s engine, which is a pipeline engine for a PipelineModule."""
    return cast(PipelineEngine, ds_core.initialize(model=module, optimizer=opt, config=cfg)[0])


def _iter(items: list[Any]) -> Iterator[Any]:
    return iter(items)


def train_case(pp: int, stage: int, kind: str, gas: int, ckpt: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` batches; this rank's losses, eval losses and stage parameters."""
    world, rank = ds_core.comm.get_world_size(), ds_core.comm.get_rank()
    replicas = world // pp
    dp_rank = rank % replicas
    batches = data(kind, steps + 1, replicas, gas)
    module = PipelineModule(
        layers(kind),
        num_stages=pp,
        loss_fn=loss_fn(kind),
        seed_layers=True,
        base_seed=BASE_SEED,
        activation_checkpoint_interval=ckpt,
    )
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    engine = _pipeline(module, opt, _config(stage, gas, CLIP))
    try:
        losses = [float(engine.train_batch(_iter(batches[t][dp_rank]))) for t in range(steps)]
        evals = float(engine.eval_batch(_iter(batches[steps][dp_rank])))
        params = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
        return {
            "losses": losses,
            "eval": evals,
            "params": params,
            "stage": engine.stage_id,
            "first": engine.is_first_stage(),
            "last": engine.is_last_stage(),
            "global_steps": engine.global_steps,
        }
    finally:
        engine.destroy()


def eval_reference(kind: str, batch: list[list[Any]], params: dict[str, torch.Tensor]) -> float:
    """Mean loss of ``batch`` (``[replica][micro]``) under ``params`` (pipeline names)."""
    mods, names = _built(kind)
    with torch.no_grad():
        for idx, m in enumerate(mods):
            if isinstance(m, nn.Module):
                for n, p in m.named_parameters():
                    key = f"{idx}.{n}"
                    if key in names:
                        p.copy_(params[names[key]])
        fn = loss_fn(kind)
        items = [mb for rep in batch for mb in rep]
        total = 0.0
        for x, y in items:
            h = x
            for m in mods:
                h = m(h)
            total += float(fn(h, y))
    return total / len(items)


def train_cases(cases: list[tuple[int, int, str, int, int, int]]) -> list[dict[str, Any]]:
    """Several :func:`train_case` runs in one job (each ``(pp, stage, kind, gas, ckpt,
    steps)``)."""
    return [train_case(*case) for case in cases]


def message_of(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_inputs() -> dict[str, Any]:
    """Each refusal's message on this rank (2 ranks, 2 stages), and the losses of training
    from ``initialize(training_data=...)``."""
    out: dict[str, Any] = {}
    out["few_layers"] = message_of(
        lambda: PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=2)
    )
    out["bad_stages"] = message_of(lambda: PipelineModule(layers("mlp"), num_stages=3))

    def stage3() -> None:
        module = PipelineModule(layers("mlp"), num_stages=2, loss_fn=F.mse_loss)
        opt = torch.optim.AdamW(module.parameters(), lr=LR)
        ds_core.initialize(model=module, optimizer=opt, config=_config(3, 2, 0.0))

    out["stage3"] = message_of(stage3)

    def without_p2p() -> None:
        # A backend without point-to-point (a hook-version-1 backend): the facade says so.
        acc = ds_core.get_accelerator()
        real = type(acc).has
        with mock.patch.object(type(acc), "has", lambda self, c: c != "p2p" and real(self, c)):
            module = PipelineModule(layers("mlp"), num_stages=2, loss_fn=F.mse_loss)
            opt = torch.optim.AdamW(module.parameters(), lr=LR)
            _pipeline(module, opt, _config(0, 2, 0.0))

    out["no_p2p"] = message_of(without_p2p)

    module = PipelineModule(layers("mlp"), num_stages=2, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    engine = _pipeline(module, opt, _config(1, 2, 0.0))
    try:
        one = data("mlp", 1, 1, 1)[0][0]  # one micro-batch where a batch needs two
        out["exhausted"] = message_of(lambda: engine.train_batch(_iter(one)))
        out["forward"] = message_of(lambda: engine(torch.zeros(2, HID)))
        out["checkpoint"] = message_of(lambda: engine.save_16bit_model("/nonexistent"))
        # the engine still trains after the refusal
        two = data("mlp", 1, 1, 2)[0][0]
        out["after"] = repr(float(engine.train_batch(_iter(two))))
    finally:
        engine.destroy()

    # initialize(training_data=...): train_batch() reads its loader, restarted at its end
    module = PipelineModule(layers("mlp"), num_stages=2, loss_fn=F.mse_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    dataset = torch.utils.data.TensorDataset(torch.randn(6, HID), torch.randn(6, 4))
    engine = cast(
        PipelineEngine,
        ds_core.initialize(
            model=module, optimizer=opt, config=_config(0, 2, 0.0), training_data=dataset
        )[0],
    )
    try:  # 3 batches of 2 samples per epoch; a train batch takes 2 of them
        out["loader"] = [float(engine.train_batch()) for _ in range(3)]
    finally:
        engine.destroy()
    return out


def partition_errors() -> dict[str, str]:
    """Refusals of a one-stage module's arguments (1 rank)."""
    return {
        "regex": message_of(
            lambda: PipelineModule(layers("mlp"), num_stages=1, partition_method="type:Conv")
        ),
        "method": message_of(
            lambda: PipelineModule(layers("mlp"), num_stages=1, partition_method="bogus")
        ),
        "layer": message_of(lambda: PipelineModule([torch.tanh, 3], num_stages=1)),
        "topology": message_of(lambda: PipelineModule(layers("mlp"), num_stages=1, topology=1)),
    }


def fp16_case(stage: int) -> dict[str, Any]:
    """fp16 with dynamic loss scaling: the first steps overflow at the initial scale; this
    rank's losses, skipped steps and final scale."""
    module = PipelineModule(layers("tied"), num_stages=2, loss_fn=loss_fn("tied"), seed_layers=True)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    engine = _pipeline(module, opt, _config(stage, 3, CLIP, {"fp16": {"enabled": True}}))
    try:
        batches = data("tied", 4, 1, 3)
        losses = [float(engine.train_batch(_iter(batches[t][0]))) for t in range(4)]
        scale = engine.loss_scaler.scale if engine.loss_scaler is not None else None
        return {"losses": losses, "skipped": engine.skipped_steps, "scale": scale}
    finally:
        engine.destroy()
