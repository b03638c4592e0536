"""Rank-side jobs of the pipeline × tensor-parallel tests (tests/pipe/test_pipe_tp.py), run on
the shared rank pools (tests/rankpool.py).

Two models, each a layer list built the same way on every rank and in the single-process
reference (seeded per layer as ``PipelineModule(seed_layers=True)`` does):

- ``mlp``: Linear, tanh, two :class:`TPBlock` (``fc1`` column-split, ``fc2`` row-split by
  AutoTP's heuristics), Linear; float inputs, MSE loss;
- ``gpt``: the example GPT's pipeline layers (examples/gpt.py ``pipeline_layers``, the
  ``tiny`` preset: embeddings, two blocks whose fused ``qkv``/``fc`` are column-split and
  ``proj`` row-split, head), token inputs, next-token cross-entropy.

Mesh (ds_core/comm/mesh.py): ``tp_rank = rank % T``, ``dp_rank = (rank // T) % D``, stage
``rank // (D·T)``; the ranks of one TP group read the same batch (``dp_rank``'s).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import ds_core
from ds_core.parallel.tensor import TP_ATTR, TP_FUSED_ATTR
from ds_core.pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec
from ds_core.zero.config import load_config
from examples.gpt import PRESETS, next_token_loss, pipeline_layers
from tests.pipe._worker import MICRO, batches, message_of

LR, EPS, WD = 1e-2, 1e-6, 0.01
HID, WIDE = 8, 16
SEQ = 6
BASE_SEED = 4321
CLIP = 0.05  # below every step's gradient norm here: a norm counting a shard twice shows


class TPBlock(nn.Module):
    """A residual MLP block AutoTP splits: ``fc1`` column-wise, ``fc2`` row-wise."""

    def __init__(self, dim: int, wide: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, wide)
        self.fc2 = nn.Linear(wide, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def layers(kind: str, wide: int = WIDE) -> list[Any]:
    """The model's layer list (see the module docstring); ``wide``: ``fc1``'s width."""
    if kind == "gpt":
        return pipeline_layers(PRESETS["tiny"])
    return [
        LayerSpec(nn.Linear, HID, HID),
        torch.tanh,
        LayerSpec(TPBlock, HID, wide),
        LayerSpec(TPBlock, HID, wide),
        LayerSpec(nn.Linear, HID, 4),
    ]


def loss_fn(kind: str) -> Any:
    return next_token_loss if kind == "gpt" else F.mse_loss


def data(kind: str, steps: int, replicas: int, gas: int) -> list[list[list[Any]]]:
    """``[step][replica][micro]`` of ``(inputs, labels)``."""
    vocab = PRESETS["tiny"].vocab_size if kind == "gpt" else None
    return batches(11, steps, replicas, gas, vocab, SEQ, HID)


def _built(kind: str) -> list[Any]:
    """The reference's layers, each seeded as ``PipelineModule(seed_layers=True)`` seeds it."""
    mods: list[Any] = []
    for idx, spec in enumerate(layers(kind)):
        torch.manual_seed(BASE_SEED + idx)
        mods.append(spec.build() if isinstance(spec, LayerSpec) else spec)
    return mods


def reference(kind: str, batches: list[list[list[Any]]], clip: float) -> dict[str, Any]:
    """Single-process training on the global batch: losses per step, final parameters by
    their pipeline name (``<layer index>.<name>``), the loss of one more batch and each
    step's gradient norm before clipping."""
    mods = _built(kind)
    holder = nn.ModuleDict({str(i): m for i, m in enumerate(mods) if isinstance(m, nn.Module)})
    params = list(holder.parameters())
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WD)
    fn = loss_fn(kind)

    def mean_loss(step: list[list[Any]]) -> torch.Tensor:
        items = [mb for rep in step for mb in rep]
        total = torch.zeros(())
        for x, y in items:
            h = x
            for m in mods:
                h = m(h)
            total = total + fn(h, y)
        return total / len(items)

    losses, norms = [], []
    for step in batches[:-1]:
        opt.zero_grad()
        loss = mean_loss(step)
        loss.backward()  # type: ignore[no-untyped-call]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        evaluated = float(mean_loss(batches[-1]))
    final = {n: p.detach().clone() for n, p in holder.named_parameters()}
    return {"losses": losses, "eval": evaluated, "params": final, "norms": norms}


def _config(stage: int, gas: int, tp: int, extra: dict[str, Any] | None = None) -> Any:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
        "tensor_parallel": {"autotp_size": tp},
    }
    cfg.update(extra or {})
    return cfg


def _module(kind: str, pp: int, wide: int = WIDE) -> PipelineModule:
    return PipelineModule(
        layers(kind, wide),
        num_stages=pp,
        loss_fn=loss_fn(kind),
        seed_layers=True,
        base_seed=BASE_SEED,
        partition_method="uniform" if kind == "mlp" else "parameters",
    )


def _engine(module: PipelineModule, cfg: Any) -> PipelineEngine:
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    return cast(PipelineEngine, ds_core.initialize(model=module, optimizer=opt, config=cfg)[0])


def _iter(items: list[Any]) -> Iterator[Any]:
    return iter(items)


def train_case(kind: str, pp: int, tp: int, stage: int, gas: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` batches at PP=``pp`` × TP=``tp`` (DP = the rest) and evaluate one more;
    this rank's losses, eval loss, stage parameters with their TP split, and mesh place."""
    world = ds_core.comm.get_world_size()
    dp = world // (pp * tp)
    engine = _engine(_module(kind, pp), _config(stage, gas, tp))
    try:
        mesh = engine.mesh
        batches = data(kind, steps + 1, dp, gas)
        mine = [batches[t][mesh.dp_rank] for t in range(steps + 1)]
        losses = [float(engine.train_batch(_iter(mine[t]))) for t in range(steps)]
        evals = float(engine.eval_batch(_iter(mine[steps])))
        params = {
            n: (
                p.detach().float().cpu().clone(),
                getattr(p, TP_ATTR, None),
                getattr(p, TP_FUSED_ATTR, 1),
            )
            for n, p in engine.module.named_parameters()
        }
        return {
            "losses": losses,
            "eval": evals,
            "params": params,
            "stage": engine.stage_id,
            "tp_rank": mesh.tp_rank,
            "tp_size": mesh.tp_size,
            "dp_rank": mesh.dp_rank,
            "prev": engine.prev_rank,
            "next": engine.next_rank,
            "global_steps": engine.global_steps,
            "skipped": engine.skipped_steps,
        }
    finally:
        engine.destroy()


def resume_case(kind: str, pp: int, tp: int, stage: int, gas: int, out: str) -> dict[str, Any]:
    """PP=``pp`` × TP=``tp``: 4 batches uninterrupted; then 2, save, a fresh engine loads and
    trains 2 more. Both runs' losses and this rank's parameters (its TP shards), and the
    layer files of the checkpoint."""
    world = ds_core.comm.get_world_size()
    batches = data(kind, 4, world // (pp * tp), gas)

    def run(steps: range, engine: PipelineEngine) -> list[float]:
        return [float(engine.train_batch(_iter(batches[t][engine.mesh.dp_rank]))) for t in steps]

    def params(engine: PipelineEngine) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}

    engine = _engine(_module(kind, pp), _config(stage, gas, tp))
    try:
        straight, want = run(range(4), engine), params(engine)
    finally:
        engine.destroy()
    engine = _engine(_module(kind, pp), _config(stage, gas, tp))
    try:
        resumed = run(range(2), engine)
        engine.save_checkpoint(out, universal=True)  # TP engines save universally
    finally:
        engine.destroy()
    engine = _engine(_module(kind, pp), _config(stage, gas, tp))
    try:
        engine.load_checkpoint(out)
        resumed += run(range(2, 4), engine)
        got = params(engine)
    finally:
        engine.destroy()
    files = sorted(p.name for p in (Path(out) / "global_step2").glob("layer_*"))
    return {"straight": straight, "resumed": resumed, "want": want, "got": got, "files": files}


def train_cases(cases: list[tuple[str, int, int, int, int, int]]) -> list[dict[str, Any]]:
    """Several :func:`train_case` runs in one job."""
    return [train_case(*case) for case in cases]


def bad_inputs() -> dict[str, str]:
    """Each refusal's message on this rank (4 ranks)."""
    out: dict[str, str] = {}
    # fc1's width 15 is not divisible by TP=2 (a column split of its output features)
    out["indivisible"] = message_of(lambda: _engine(_module("mlp", 2, wide=15), _config(1, 2, 2)))
    # 2 stages × TP=4 = 8 ranks do not fit a world of 4 (initialize's config check, on the
    # world // stages ranks a stage has)
    out["world"] = message_of(lambda: _engine(_module("mlp", 2), _config(1, 2, 4)))
    # 2 stages × TP=3 does not divide 4
    out["world3"] = message_of(lambda: _engine(_module("mlp", 2), _config(1, 2, 3)))

    def direct() -> None:
        # The engine's own check, for a config validated for the whole world (4 ranks, where
        # TP=4 fits) rather than initialize's world // stages
        module = _module("mlp", 2)
        opt = torch.optim.AdamW(module.parameters(), lr=LR)
        PipelineEngine(module, load_config(_config(1, 2, 4), 4), opt)

    out["direct"] = message_of(direct)
    tied_split = {
        "autotp_size": 2,
        "partition_config": {
            "layer_specs": [{"patterns": [r".*emb\.weight$"], "partition_type": "row"}]
        },
    }

    def tied() -> None:
        specs = [
            TiedLayerSpec("emb", nn.Embedding, 10, HID),
            LayerSpec(TPBlock, HID, WIDE),
            LayerSpec(TPBlock, HID, WIDE),
            TiedLayerSpec("emb", nn.Embedding, 10, HID, forward_fn=lambda m, x: x @ m.weight.t()),
        ]
        module = PipelineModule(specs, num_stages=2, loss_fn=F.mse_loss)
        _engine(module, _config(1, 2, 2, {"tensor_parallel": tied_split}))

    out["tied"] = message_of(tied)
    return out


def fp16_case(poison_rank: int) -> dict[str, Any]:
    """fp16 at PP=2 × TP=2, ZeRO 1: at step 1, rank ``poison_rank`` alone multiplies the
    gradient of one of its TP-replicated parameters by inf (on TP rank 1, a gradient the norm
    counts on TP rank 0, not here; on stage 0, one the last stage never sees). Per step: this
    rank's skips and loss scale, and whether its stage's parameters changed."""
    cfg = _config(1, 2, 2, {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}})
    engine = _engine(_module("gpt", 2), cfg)
    rank = ds_core.comm.get_rank()
    current = {"step": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf if rank == poison_rank and current["step"] == 1 else grad

    replicated = [p for p in engine.module.parameters() if getattr(p, TP_ATTR, None) is None]
    replicated[-1].register_hook(poison)
    try:
        batches = data("gpt", 3, 1, 2)
        record = []
        for t in range(3):
            current["step"] = t
            before = [p.detach().float().clone() for p in engine.module.parameters()]
            engine.train_batch(_iter(batches[t][0]))
            after = list(engine.module.parameters())
            changed = any(
                not torch.equal(b, a.detach().float()) for b, a in zip(before, after, strict=True)
            )
            scale = engine.loss_scaler.scale if engine.loss_scaler is not None else None
            record.append({"skipped": engine.skipped_steps, "scale": scale, "changed": changed})
        return {"record": record}
    finally:
        engine.destroy()
