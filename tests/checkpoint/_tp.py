"""Rank jobs for tensor-parallel checkpoints (suites ``tp_save`` on 2 ranks, ``tp_w1`` on 1).

The Llama-style model of ``tests/zero/_autotp.py`` trains at TP=2 (2 ranks, DP=1, stage 1) for
3 steps, saves the universal format and trains 3 more (the uninterrupted run). Fresh engines
then load it at TP=2 (stage 1: the same layout; stage 3) and at TP=1 (2 ranks DP=2 stage 2;
1 rank stage 0) and train the same 3 steps on the same global batches. The ``vocab`` variant
(fused grouped-query ``qkv_proj`` and ``gate_up_proj``, a tied embedding and LM head split
over the vocabulary) saves at TP=2 the same way and loads at TP=1 (2 ranks DP=2 stage 2).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.zero import _autotp as A  # noqa: N812

GLOBAL = 4  # sequences per step, split over the DP ranks
STEPS = 3


def engine_for(tp: int, stage: int, perturb: bool = False, vocab: bool = False) -> Any:
    import ds_core
    from ds_core import comm

    world = comm.get_world_size()
    model = A.TinyLlama(fused=vocab, tied=vocab)
    model.load_state_dict(A.llama_state(0, fused=vocab, tied=vocab))
    if perturb:  # a load must overwrite every value
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL // (world // tp),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 400,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
        if vocab:
            cfg["tensor_parallel"]["partition_config"] = A.VOCAB_CONFIG
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=A.optimizer(model.parameters()), config=cfg
    )
    return engine


def train(engine: Any, offset: int) -> list[float]:
    """Steps ``offset .. offset + STEPS``; this rank's loss of each (its DP slice)."""
    dp, dp_rank = engine.mesh.dp_size, engine.mesh.dp_rank
    per = GLOBAL // dp
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    losses = []
    for step in range(offset, offset + STEPS):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(0, A.VOCAB, (GLOBAL, A.SEQ), generator=g)
        tgt = torch.randint(0, A.VOCAB, (GLOBAL, A.SEQ), generator=g)
        loss = engine(idx[sl], tgt[sl])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_opt(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Full (unsharded over TP and DP) fp32 master and Adam moments by name (collective)."""
    from ds_core.checkpoint._save import gather_param

    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, zp in engine.zparams.items():
        st = engine.optimizer.state[zp.master]
        out[name] = {
            "fp32": gather_param(engine, zp, zp.master).clone(),
            **{k: gather_param(engine, zp, st[k]).clone() for k in ("exp_avg", "exp_avg_sq")},
            "step": st["step"].clone(),
        }
    return out


def save(root: Path) -> dict[str, Any]:
    engine = engine_for(2, 1)
    train(engine, 0)
    saved = full_opt(engine)
    try:
        engine.save_checkpoint(str(root / "tp" / "native"))
        native = "accepted"
    except Exception as exc:  # the message is the result
        native = f"{type(exc).__name__}: {exc}"
    engine.save_checkpoint(str(root / "tp" / "universal"), universal=True)
    engine.save_16bit_model(str(root / "tp" / "w16"), "model.pt")
    losses = train(engine, STEPS)
    out = {"saved": saved, "native": native, "losses": losses, "final": full_opt(engine)}
    engine.destroy()
    return out


def save_vocab(root: Path) -> dict[str, Any]:
    engine = engine_for(2, 1, vocab=True)
    train(engine, 0)
    saved = full_opt(engine)
    engine.save_checkpoint(str(root / "tp" / "vocab"), universal=True)
    out = {"saved": saved, "losses": train(engine, STEPS)}
    engine.destroy()
    return out


def load(tp: int, stage: int, root: Path, vocab: bool = False) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        engine = engine_for(tp, stage, perturb=True, vocab=vocab)
        engine.load_checkpoint(str(root / "tp" / ("vocab" if vocab else "universal")))
        loaded = full_opt(engine)
        losses = train(engine, STEPS)
        out = {
            "loaded": loaded,
            "losses": losses,
            "final": full_opt(engine),
            "steps": engine.global_steps,
        }
        engine.destroy()
        return out

    return run


def jobs(suite: str, root: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    if suite == "tp_save":
        return {
            "save": lambda: save(root),
            "tp2_s1": load(2, 1, root),
            "tp2_s3": load(2, 3, root),
            "tp1_dp2_s2": load(1, 2, root),
            "save_vocab": lambda: save_vocab(root),
            "vocab_tp1_dp2_s2": load(1, 2, root, vocab=True),
        }
    if suite == "tp_w1":
        return {"tp1_s0": load(1, 0, root)}
    raise SystemExit(f"unknown suite {suite}")
