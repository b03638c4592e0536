"""Rank jobs of the sequence-parallel tests (tests/sequence/test_ulysses.py), run on the
session's rank pools: ``rank_pools.get(world, env).run("tests.sequence._worker:job", name)``.

Every job draws its inputs from fixed seeds, identically on every rank, and returns host
tensors; the tests compute the single-process references and compare.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from tests.zero._common import EPS, on_device, to_host

# The GPT scenarios: a 1-layer, 2-head GPT, sequences of SEQ tokens, MICRO sequences per data
# replica per micro-batch.
VOCAB, SEQ, MICRO, LR, CLIP, STEPS = 32, 8, 2, 1e-2, 0.5, 3
#: stage -> gradient accumulation steps (stage 1 with accumulation takes another reduce path)
GAS = {0: 1, 1: 2, 2: 1, 3: 2}


def attention_inputs(layout: str) -> dict[str, torch.Tensor]:
    """Full-sequence inputs of one attention case: ``q, k, v`` (batch first ``[B, T, H, D]``
    or sequence first ``[T, B, H, D]``), the output weights ``w`` of the test's loss, and for
    the GQA case rotary ``cos, sin`` (``[B?, T, 1, D]``-shaped as DeepSpeed passes them,
    before its ``(1, 0, 2, 3)`` permute)."""
    g = torch.Generator().manual_seed(7)
    b, t, d = 2, 8, 4
    hq, hkv = (2, 2) if layout == "bthd" else (4, 2)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    if layout == "bthd":
        out = {"q": rand(b, t, hq, d), "k": rand(b, t, hkv, d), "v": rand(b, t, hkv, d)}
        out["w"] = rand(b, t, hq, d)
    else:  # sequence first, grouped-query, rotary on the first half of each head
        out = {"q": rand(t, b, hq, d), "k": rand(t, b, hkv, d), "v": rand(t, b, hkv, d)}
        out["w"] = rand(t, b, hq, d)
        angle = rand(1, t, 1, d // 4).repeat(1, 1, 1, 2)  # [1, T, 1, rot]: rot = D/2
        out["cos"], out["sin"] = angle.cos(), angle.sin()
    return out


def local_attention(layout: str) -> Any:
    """The attention each layout's case wraps: causal SDPA over the full sequence, grouped
    queries sharing their key/value head (``repeat_interleave``)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layout == "tbhd":  # [T, B, H, D] -> [B, T, H, D]
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return y.transpose(0, 1) if layout == "tbhd" else y

    return attend


def attention_job() -> dict[str, Any]:
    """SP=2 over the world: each layout's output shard and the gradients of ``q, k, v``'s
    shards; the loss helper's value and gradient; the exchange's round trip; the groups
    getters; the errors of bad inputs."""
    import ds_core
    from ds_core import comm
    from ds_core.comm.counting import CommCounter
    from ds_core.parallel.sequence import (
        seq_all_to_all,
        sequence_parallel_cross_entropy,
        shard_sequence,
    )
    from ds_core.sequence.layer import DistributedAttention
    from ds_core.utils import groups

    mesh = comm.device_mesh(1, 1, 2)
    sp, r, group = mesh.sp_size, mesh.sp_rank, mesh.sp_group
    out: dict[str, Any] = {"sp_rank": r, "sp_size": sp}
    for layout in ("bthd", "tbhd"):
        full = attention_inputs(layout)
        seq_dim = 1 if layout == "bthd" else 0
        shard = {n: on_device(shard_sequence(full[n], r, sp, seq_dim)) for n in "qkvw"}
        q, k, v = (shard[n].clone().requires_grad_(True) for n in "qkv")
        attn = DistributedAttention(local_attention(layout), group)
        counter = CommCounter()  # the exchanges go through the comm hooks
        ds_core.register_plugin(counter)
        if layout == "bthd":
            y = attn(q, k, v, 0)
        else:
            y = attn(q, k, v, 1, (on_device(full["cos"]), on_device(full["sin"])))
        (y * shard["w"]).sum().backward()
        ds_core.unregister_plugin(counter)
        out[layout] = to_host({"y": y, "dq": q.grad, "dk": k.grad, "dv": v.grad})
        out[layout]["comm"] = {
            "calls": counter.calls_by_op(),
            "bytes": counter.bytes_by_op(),
            "shard_bytes": [t.numel() * t.element_size() for t in (q, k, v, y)],
        }

    # the loss helper: ignored tokens unevenly spread over the two shards
    g = torch.Generator().manual_seed(3)
    logits, targets = (
        torch.randn(2, SEQ, VOCAB, generator=g),
        torch.randint(0, VOCAB, (2, SEQ), generator=g),
    )
    targets[:, :3] = -100  # 6 of rank 0's 8 tokens ignored, none of rank 1's
    lg = on_device(shard_sequence(logits, r, sp)).requires_grad_(True)
    loss = sequence_parallel_cross_entropy(lg, on_device(shard_sequence(targets, r, sp)), group)
    loss.backward()
    out["ce"] = to_host({"loss": loss, "grad": lg.grad, "logits": logits, "targets": targets})
    out["ds_ce"] = deepspeed_loss_cases(logits, targets, r, sp, group)

    x = on_device(torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6))
    there = seq_all_to_all(x, group, 2, 1)
    out["round_trip"] = {
        "shape": tuple(there.shape),
        "back": bool(torch.equal(seq_all_to_all(there, group, 1, 2), x)),
    }

    out["groups"] = {
        "sp_world": groups._get_sequence_parallel_world_size(),
        "sp_rank": groups._get_sequence_parallel_rank(),
        "sp_group_is_mesh": groups._get_sequence_parallel_group() is group,
        "sdp_world": groups._get_sequence_data_parallel_world_size(),
        "sdp_rank": groups._get_sequence_data_parallel_rank(),
    }

    def error(fn: Any) -> str:
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return "accepted"

    three = on_device(torch.zeros(2, 4, 3, 4))  # 3 heads over SP 2
    ident = DistributedAttention(local_attention("bthd"), group)
    out["errors"] = {
        "heads": error(lambda: ident(three, three, three, 0)),
        "kv_heads": error(
            lambda: DistributedAttention(local_attention("bthd"), group, num_kv_heads=3)(
                *(on_device(torch.zeros(2, 4, 4, 4)),) * 3, 0
            )
        ),
        "batch_dim": error(lambda: ident(three, three, three, 2)),
    }
    return out


def deepspeed_loss_cases(
    logits: torch.Tensor, targets: torch.Tensor, r: int, sp: int, group: Any
) -> dict[str, Any]:
    """DeepSpeed's loss functions on SP=2 (sequence first, as DeepSpeed gathers along dim 0):
    the gathered per-token losses and the gradient of their sum over the counted tokens; the
    ``reduction="mean"`` form; and the vocabulary split over the same two ranks as a TP
    group (each rank the whole sequence, half the logits)."""
    from ds_core.parallel.sequence import shard_sequence
    from ds_core.sequence.cross_entropy import (
        vocab_parallel_cross_entropy,
        vocab_sequence_parallel_cross_entropy,
    )

    seq_first, tgt = logits.transpose(0, 1), targets.transpose(0, 1)  # [T, B, V], [T, B]
    mine = on_device(shard_sequence(tgt, r, sp, 0))
    counted = int((targets != -100).sum())
    out: dict[str, Any] = {}
    lg = on_device(shard_sequence(seq_first, r, sp, 0)).requires_grad_(True)
    per_token = vocab_sequence_parallel_cross_entropy(lg, mine, group)
    (per_token.sum() / counted).backward()
    out["gathered"] = {"losses": per_token, "grad": lg.grad}
    lg = on_device(shard_sequence(seq_first, r, sp, 0)).requires_grad_(True)
    mean = vocab_parallel_cross_entropy(lg, mine, sp_group=group)
    mean.backward()
    out["mean"] = {"loss": mean, "grad": lg.grad}
    v = VOCAB // sp
    lg = on_device(seq_first[..., r * v : (r + 1) * v].contiguous()).requires_grad_(True)
    tp_mean = vocab_parallel_cross_entropy(lg, on_device(tgt), tp_group=group)
    tp_mean.backward()
    out["tp"] = {"loss": tp_mean, "grad": lg.grad}
    return to_host(out)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- the GPT example


def gpt_model() -> torch.nn.Module:
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16))


def gpt_batches(data_size: int, gas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][micro] -> (idx, targets)`` of the global batch (``data_size · MICRO``
    sequences, data replica ``d`` reading rows ``[d·MICRO, (d+1)·MICRO)``)."""
    g = torch.Generator().manual_seed(1)
    n = data_size * MICRO
    return [
        [
            (
                torch.randint(0, VOCAB, (n, SEQ), generator=g),
                torch.randint(0, VOCAB, (n, SEQ), generator=g),
            )
            for _ in range(gas)
        ]
        for _ in range(STEPS)
    ]


def gpt_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=EPS, foreach=False)


def gpt_reference(data_size: int, gas: int) -> dict[str, Any]:
    """One process, the full sequences of the global batch: per-step losses, norms, the final
    parameters."""
    model = gpt_model()
    opt = gpt_optimizer(model.parameters())
    losses, norms = [], []
    for step in gpt_batches(data_size, gas):
        idx = torch.cat([b[0] for b in step])
        tgt = torch.cat([b[1] for b in step])
        loss = model(idx, tgt)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


def gpt_job() -> dict[str, Any]:
    """The GPT example with SP=2 (× the remaining ranks as data replicas) at stages 0-3: per
    stage, each micro-batch's loss on this rank, each step's global norm, the final
    parameters (gathered)."""
    import ds_core
    from ds_core.parallel.sequence import shard_offset, shard_sequence
    from examples.gpt import use_sequence_parallel

    results: dict[str, Any] = {}
    for stage, gas in GAS.items():
        model = gpt_model()
        if ds_core.comm.get_rank() != 0:  # the engine broadcasts rank 0's parameters
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": gas,
            "gradient_clipping": CLIP,
            "sequence_parallel_size": 2,
            "steps_per_print": 1000,
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 400,
                "stage3_param_persistence_threshold": 0,
            },
        }
        engine, _, _, _ = ds_core.initialize(
            model=model, optimizer=gpt_optimizer(model.parameters()), config=config
        )
        mesh = engine.mesh
        use_sequence_parallel(engine.module, mesh.sp_group)
        rows = slice(mesh.data_rank * MICRO, (mesh.data_rank + 1) * MICRO)
        offset = shard_offset(SEQ, mesh.sp_rank, mesh.sp_size)
        losses, norms = [], []
        for step in gpt_batches(mesh.data_size, gas):
            for idx, tgt in step:
                x, y = (
                    on_device(shard_sequence(t[rows], mesh.sp_rank, mesh.sp_size))
                    for t in (idx, tgt)
                )
                loss = engine(x, y, offset)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            norms.append(float(engine.last_grad_norm))
        results[f"s{stage}"] = {
            "losses": losses,
            "norms": norms,
            "state": to_host(engine.gathered_state_dict()),
            "train_batch_size": engine.train_batch_size(),
            "data_rank": mesh.data_rank,
        }
        engine.destroy()
        results[f"ds{stage}"] = deepspeed_script_step(stage)
    return results


# ------------------------------------------------- a DeepSpeed Ulysses script's loss, one step


def token_model() -> torch.nn.Module:
    """A per-token model (embedding, linear head): under SP each rank's tokens are independent,
    so one step isolates the loss and gradient convention from attention."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))


#: clipping threshold far above the norms: the engine computes the norm but never clips.
NO_CLIP = 1e3


def token_reference(data_size: int) -> dict[str, Any]:
    """One process, one SGD step on the full global batch: loss, norm, parameters after."""
    model = token_model()
    idx, tgt = gpt_batches(data_size, 1)[0][0]
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), NO_CLIP))
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {"loss": loss.item(), "norm": norm, "params": dict(model.named_parameters())}


def deepspeed_script_step(stage: int) -> dict[str, Any]:
    """One SGD step written as for DeepSpeed: each SP rank's loss is the mean of DeepSpeed's
    ``vocab_sequence_parallel_cross_entropy`` (the full sequences' per-token losses); the
    engine's norm and the parameters after the step must be the single-process ones (with
    gradients averaged over the SP ranks instead of summed, they are half)."""
    import ds_core
    from ds_core.parallel.sequence import shard_sequence
    from ds_core.sequence.cross_entropy import vocab_sequence_parallel_cross_entropy

    model = token_model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": NO_CLIP,
        "sequence_parallel_size": 2,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config
    )
    mesh = engine.mesh
    idx, tgt = gpt_batches(mesh.data_size, 1)[0][0]
    rows = slice(mesh.data_rank * MICRO, (mesh.data_rank + 1) * MICRO)
    x, y = (on_device(shard_sequence(t[rows], mesh.sp_rank, mesh.sp_size)) for t in (idx, tgt))
    logits = engine(x)  # [B, T/P, V]; DeepSpeed's function gathers sequence-first
    loss = vocab_sequence_parallel_cross_entropy(
        logits.transpose(0, 1), y.transpose(0, 1), mesh.sp_group
    ).mean()
    engine.backward(loss)
    engine.step()
    out = {
        "loss": loss.item(),
        "norm": float(engine.last_grad_norm),
        "state": to_host(engine.gathered_state_dict()),
    }
    engine.destroy()
    return out


def job(name: str) -> dict[str, Any]:
    """Run job ``name`` (``attention`` or ``gpt``) on this rank."""
    return {"attention": attention_job, "gpt": gpt_job}[name]()
