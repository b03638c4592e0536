"""AutoTP scenarios: a tiny Llama-style model (and the GPT example) trained with TP × DP ranks,
their single-process references, and the rank jobs (``suite("autotp", world)``).

Layout: ``tp_rank = rank % tp``, ``dp_rank = rank // tp``; the ranks of one TP group read the
same micro-batch (their DP rank's slice of the global batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from tests.zero._common import EPS, on_device

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, SEQ = 32, 16, 4, 2, 32, 2, 6
MICRO = 2  # sequences per DP rank per micro-batch
LR = 1e-2
LOSS_SCALE = 128.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Grouped-query attention that reshapes with its head counts (AutoTP divides them);
    ``fused``: one ``qkv_proj`` of unequal parts ``[q; k; v]`` (Phi-3 style)."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = HEADS, KV_HEADS
        self.head_dim = HIDDEN // HEADS
        if fused:
            # no bias: a key bias's gradient is zero up to rounding (softmax ignores a shift),
            # and AdamW would turn that rounding noise into updates
            self.qkv_proj = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * self.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
            self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
            self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hasattr(self, "qkv_proj"):
            kv = self.num_key_value_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class MLP(nn.Module):
    """SwiGLU; biases on up/down so the column split of a bias and the once-added row bias
    are exercised; ``fused``: one ``gate_up_proj`` ``[gate; up]``."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        if fused:
            self.gate_up_proj = nn.Linear(HIDDEN, 2 * FFN)
        else:
            self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
            self.up_proj = nn.Linear(HIDDEN, FFN)
        self.down_proj = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class Layer(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention(fused)
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = MLP(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer(fused) for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.norm(x)
        return out


class TinyLlama(nn.Module):
    """``model.layers.N.self_attn.{q,k,v,o}_proj``, ``model.layers.N.mlp.{gate,up,down}_proj``,
    an untied ``lm_head`` (left replicated by the heuristics). ``fused``: ``qkv_proj`` and
    ``gate_up_proj`` instead; ``tied``: ``lm_head.weight`` is ``model.embed_tokens.weight``;
    ``parallel_ce``: the loss by ``vocab_parallel_cross_entropy`` (targets -100 ignored)."""

    def __init__(self, fused: bool = False, tied: bool = False, parallel_ce: bool = False) -> None:
        super().__init__()
        self.parallel_ce = parallel_ce
        self.model = Body(fused)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model(idx))
        if self.parallel_ce:  # sharded logits under TP; F.cross_entropy otherwise
            from ds_core.parallel.tensor import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits, targets, self.lm_head)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def llama_state(seed: int = 0, fused: bool = False, tied: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in TinyLlama(fused, tied).state_dict().items()}


#: sub-parameters along dim 0 of the fused weights (GQA ``[q; k; v]``: unequal).
FUSED = {
    "qkv_proj": (HEADS * HIDDEN // HEADS, KV_HEADS * HIDDEN // HEADS, KV_HEADS * HIDDEN // HEADS),
    "gate_up_proj": 2,
    "attn.qkv": 3,  # the GPT example
}


def fused_of(param_name: str) -> int | tuple[int, ...]:
    module = param_name.rpartition(".")[0]
    return next((f for k, f in FUSED.items() if module.endswith(k)), 1)


def gpt_model() -> nn.Module:
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16))


#: module path -> the spec the partition-config scenario gives (full paths, regex).
PARTITION_CONFIG: dict[str, Any] = {
    "use_default_specs": True,
    "layer_specs": [
        # layer 1's MLP stays replicated; layer 0's up/down are named by full path
        {"patterns": [r"model\.layers\.1\.mlp\..*"], "partition_type": "skip"},
        {"patterns": [r"model\.layers\.0\.mlp\.up_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r"model\.layers\.0\.mlp\.down_proj\.weight$"], "partition_type": "row"},
    ],
}
#: the embedding split over its vocabulary, the LM head column-split with gathered logits.
VOCAB_CONFIG: dict[str, Any] = {
    "layer_specs": [
        {"patterns": [r"model\.embed_tokens\.weight$"], "partition_type": "row"},
        {"patterns": [r"lm_head\.weight$"], "partition_type": "column", "gather_output": True},
    ],
}


#: as VOCAB_CONFIG, the LM head's logits left sharded (the loss: vocab_parallel_cross_entropy).
SHARDED_LOGITS_CONFIG: dict[str, Any] = {
    "layer_specs": [
        VOCAB_CONFIG["layer_specs"][0],
        {"patterns": [r"lm_head\.weight$"], "partition_type": "column"},
    ],
}


@dataclass
class TPScenario:
    stage: int
    world: int
    tp: int = 2
    gas: int = 2
    steps: int = 3
    clip: float = 0.5
    model: str = "llama"  # or "gpt"
    fused: bool = False  # llama: qkv_proj (GQA) and gate_up_proj
    tied: bool = False  # llama: lm_head.weight is model.embed_tokens.weight
    parallel_ce: bool = False  # llama: vocab-parallel loss; each sequence's first target -100
    precision: str = "fp32"  # or "bf16", "fp16" (static loss scale LOSS_SCALE)
    #: parameter atol when looser than the precision's (the reason at the scenario)
    param_atol: float = 0.0
    partition_config: dict[str, Any] | None = None
    function_form: bool = False  # tp_model_init before initialize, no tensor_parallel key
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.world // self.tp

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": self.clip,
            "steps_per_print": 1000,
            "zero_optimization": {
                "stage": self.stage,
                "reduce_bucket_size": 400,
                "stage3_param_persistence_threshold": 0,
            },
        }
        if self.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif self.precision == "fp16":
            cfg["fp16"] = {"enabled": True, "loss_scale": LOSS_SCALE}
        if not self.function_form:
            tp: dict[str, Any] = {"autotp_size": self.tp}
            if self.partition_config is not None:
                tp["partition_config"] = self.partition_config
            cfg["tensor_parallel"] = tp
        cfg.update(self.extra)
        return cfg


def scenarios(world: int) -> dict[str, TPScenario]:
    if world == 4:
        out = {f"tp2dp2_s{s}": TPScenario(stage=s, world=4) for s in range(4)}
        for s in (1, 3):
            for prec in ("bf16", "fp16"):
                out[f"tp2dp2_{prec}_s{s}"] = TPScenario(stage=s, world=4, precision=prec)
        return out
    return {
        # One gate_up_proj element's first gradient is -1.1e-7 (1e4 x below the median, a
        # cancellation): AdamW (eps 1e-6) turns its last-bit differences into 1e-5 changes
        # of that weight; losses and norms still match to 1e-5.
        "tp2_fused_s2": TPScenario(stage=2, world=2, fused=True, param_atol=LR * 1e-2),
        "tp2_vocab_s1": TPScenario(stage=1, world=2, partition_config=VOCAB_CONFIG),
        "tp2_tied_s3": TPScenario(stage=3, world=2, tied=True, partition_config=VOCAB_CONFIG),
        # as tp2_fused_s2: one v_proj element's first gradient is -3.5e-7 (3e4 x below the
        # median), which AdamW amplifies into an 8e-6 change of that weight
        "tp2_vocab_ce_s2": TPScenario(
            stage=2,
            world=2,
            parallel_ce=True,
            partition_config=SHARDED_LOGITS_CONFIG,
            param_atol=LR * 1e-2,
        ),
        "tp2_s1": TPScenario(stage=1, world=2),
        "tp2_s3": TPScenario(stage=3, world=2),
        "tp2_pcfg_s2": TPScenario(stage=2, world=2, partition_config=PARTITION_CONFIG),
        "tp2_fn_s0": TPScenario(stage=0, world=2, function_form=True),
        # as tp2_fused_s2, milder: 1.26e-6 on one qkv element (sim, avx512 host, 2026-12-05)
        "tp2_gpt_s2": TPScenario(stage=2, world=2, model="gpt", param_atol=LR * 1e-3),
    }


def batches(sc: TPScenario, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][micro] -> (idx, targets)`` of the global batch (``dp * MICRO`` sequences)."""
    g = torch.Generator().manual_seed(seed)
    n = sc.dp * MICRO
    out = [
        [
            (
                torch.randint(0, VOCAB, (n, SEQ), generator=g),
                torch.randint(0, VOCAB, (n, SEQ), generator=g),
            )
            for _ in range(sc.gas)
        ]
        for _ in range(sc.steps)
    ]
    if sc.parallel_ce:  # the same count per sequence, so micro-batch means still average
        for step in out:
            for _, targets in step:
                targets[:, 0] = -100
    return out


def build(sc: TPScenario) -> nn.Module:
    if sc.model == "gpt":
        return gpt_model()
    model = TinyLlama(sc.fused, sc.tied, sc.parallel_ce)
    model.load_state_dict(llama_state(0, sc.fused, sc.tied))
    return model


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=EPS, foreach=False)


def run_reference(sc: TPScenario) -> dict[str, Any]:
    """Single-process training on the global batch: step losses, norms, final parameters.

    16-bit: the model in that dtype, fp32 master weights and AdamW on them, gradients taken
    to fp32 and unscaled (fp16: the loss × LOSS_SCALE) before the clip — the engine's recipe
    in one process."""
    model = build(sc)
    params = [p for p in model.parameters() if p.requires_grad]
    if sc.precision != "fp32":
        model.to(torch.bfloat16 if sc.precision == "bf16" else torch.float16)
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = optimizer(masters)
    scale = LOSS_SCALE if sc.precision == "fp16" else 1.0
    losses, norms = [], []
    for step in batches(sc):
        idx = torch.cat([b[0] for b in step])
        tgt = torch.cat([b[1] for b in step])
        loss = model(idx, tgt)
        (loss.float() * scale).backward()
        for m, p in zip(masters, params, strict=True):
            m.grad = p.grad.float() / scale  # type: ignore[union-attr]
            p.grad = None
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, sc.clip)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, params, strict=True):
                p.copy_(m)
        losses.append(loss.item())
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "norms": norms,
        "params": {names[id(p)]: m for p, m in zip(params, masters, strict=True)},
    }


# --------------------------------------------------------------------------- rank jobs


def train(sc: TPScenario) -> dict[str, Any]:
    """Train ``sc`` on this rank: losses, per-step global norms, local shards, layout."""
    import ds_core
    from ds_core import comm
    from ds_core.parallel.tensor import TP_ATTR

    rank = comm.get_rank()
    dp_rank = rank // sc.tp
    model = build(sc)
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    if sc.function_form:
        ds_core.tp_model_init(model, sc.tp, None)
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=optimizer(model.parameters()), config=sc.config()
    )
    losses, norms = [], []
    sl = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
    for step in batches(sc):
        for idx, tgt in step:
            loss = engine(on_device(idx[sl]), on_device(tgt[sl]))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.last_grad_norm)
    out = {
        "losses": losses,
        "norms": norms,
        "state": engine.gathered_state_dict(),
        "kinds": {n: getattr(p, TP_ATTR, None) for n, p in engine.module.named_parameters()},
        "types": {n: type(m).__name__ for n, m in engine.module.named_modules()},
        "dp_size": engine.mesh.dp_size,
        "train_batch_size": engine.train_batch_size(),
    }
    engine.destroy()
    return out


def refusals() -> dict[str, Any]:
    """Configs AutoTP must refuse, each error's message (collective: every rank runs it)."""
    import ds_core
    from ds_core.checkpoint import CheckpointError

    def attempt(build_model: Callable[[], nn.Module], tp_cfg: dict[str, Any]) -> str:
        cfg = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": tp_cfg}
        try:
            ds_core.initialize(model=build_model(), config=cfg)
        except ds_core.ConfigError as exc:
            return str(exc)
        return "accepted"

    def odd_heads() -> nn.Module:
        m = TinyLlama()
        for layer in m.model.layers:
            layer.self_attn.num_heads = 3  # q_proj still splits evenly: the head count cannot
        return m

    engine, _, _, _ = ds_core.initialize(
        model=TinyLlama(),
        config={"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}},
    )
    try:  # native format: refused before anything is written
        engine.save_checkpoint("/nonexistent/tp-checkpoint")
        checkpoint = "accepted"
    except CheckpointError as exc:
        checkpoint = str(exc)
    engine.destroy()
    bad_pattern = {"layer_specs": [{"patterns": [r"layers\.0\.mlp\.up_proj"]}]}
    # an embedding splits its vocabulary rows (row); its embedding dimension cannot be split
    embed = {"layer_specs": [{"patterns": [r"model\.embed_tokens"], "partition_type": "column"}]}
    tied_half = {"layer_specs": [VOCAB_CONFIG["layer_specs"][0]]}
    return {
        "no_match": attempt(TinyLlama, {"autotp_size": 2, "partition_config": bad_pattern}),
        "embedding": attempt(TinyLlama, {"autotp_size": 2, "partition_config": embed}),
        "heads": attempt(odd_heads, {"autotp_size": 2}),
        "tied": attempt(
            lambda: TinyLlama(tied=True), {"autotp_size": 2, "partition_config": tied_half}
        ),
        "checkpoint": checkpoint,
    }


#: the step whose gradient overflows on global rank 1 only (TP rank 1 of DP replica 0).
OVERFLOW_STEP = 1


def replica_overflow() -> dict[str, Any]:
    """fp16, TP=2 × DP=2, stage 1: at :data:`OVERFLOW_STEP`, rank 1 alone multiplies the
    gradient of the replicated ``model.norm.weight`` by inf — a gradient its TP rank 0 counts
    in the norm, not it. Every rank must skip that step. Per step: skips, scale, masters."""
    import math

    import ds_core
    from ds_core import comm

    sc = TPScenario(stage=1, world=4, gas=1, steps=3, precision="fp16")
    cfg = sc.config()
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    model = build(sc)
    engine, _, _, _ = ds_core.initialize(
        model=model, optimizer=optimizer(model.parameters()), config=cfg
    )
    rank, dp_rank = comm.get_rank(), comm.get_rank() // sc.tp
    current = {"step": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf if rank == 1 and current["step"] == OVERFLOW_STEP else grad

    engine.module.model.norm.weight.register_hook(poison)
    sl = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
    record = []
    for i, step in enumerate(batches(sc)):
        current["step"] = i
        idx, tgt = step[0]
        engine.backward(engine(on_device(idx[sl]), on_device(tgt[sl])))
        engine.step()
        masters = torch.cat([zp.master.detach().reshape(-1).clone() for zp in engine._trainable])
        record.append(
            {"skipped": engine.skipped_steps, "scale": engine.loss_scaler.scale, "masters": masters}
        )
    norm_weight = engine.gathered_state_dict()["model.norm.weight"].float()
    engine.destroy()
    return {"record": record, "norm_weight": norm_weight}


def jobs(world: int) -> dict[str, Callable[[], dict[str, Any]]]:
    out: dict[str, Callable[[], dict[str, Any]]] = {
        name: (lambda sc=sc: train(sc)) for name, sc in scenarios(world).items()
    }
    if world == 2:
        out["refusals"] = refusals
    if world == 4:
        out["replica_overflow"] = replica_overflow
    return out
