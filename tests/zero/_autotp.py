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

from tests.zero._common import EPS

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, SEQ = 32, 16, 4, 2, 32, 2, 6
MICRO = 2  # sequences per DP rank per micro-batch
LR = 1e-2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Grouped-query attention that reshapes with its head counts (AutoTP divides them)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = HEADS, KV_HEADS
        self.head_dim = HIDDEN // HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class MLP(nn.Module):
    """SwiGLU; biases on up/down so the column split of a bias and the once-added row bias
    are exercised."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN)
        self.down_proj = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.norm(x)
        return out


class TinyLlama(nn.Module):
    """``model.layers.N.self_attn.{q,k,v,o}_proj``, ``model.layers.N.mlp.{gate,up,down}_proj``,
    an untied ``lm_head`` (left replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Body()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model(idx))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def llama_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in TinyLlama().state_dict().items()}


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


@dataclass
class TPScenario:
    stage: int
    world: int
    tp: int = 2
    gas: int = 2
    steps: int = 3
    clip: float = 0.5
    model: str = "llama"  # or "gpt"
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
        if not self.function_form:
            tp: dict[str, Any] = {"autotp_size": self.tp}
            if self.partition_config is not None:
                tp["partition_config"] = self.partition_config
            cfg["tensor_parallel"] = tp
        cfg.update(self.extra)
        return cfg


def scenarios(world: int) -> dict[str, TPScenario]:
    if world == 4:
        return {f"tp2dp2_s{s}": TPScenario(stage=s, world=4) for s in range(4)}
    return {
        "tp2_s1": TPScenario(stage=1, world=2),
        "tp2_s3": TPScenario(stage=3, world=2),
        "tp2_pcfg_s2": TPScenario(stage=2, world=2, partition_config=PARTITION_CONFIG),
        "tp2_fn_s0": TPScenario(stage=0, world=2, function_form=True),
        "tp2_gpt_s2": TPScenario(stage=2, world=2, model="gpt"),
    }


def batches(sc: TPScenario, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][micro] -> (idx, targets)`` of the global batch (``dp * MICRO`` sequences)."""
    g = torch.Generator().manual_seed(seed)
    n = sc.dp * MICRO
    return [
        [
            (
                torch.randint(0, VOCAB, (n, SEQ), generator=g),
                torch.randint(0, VOCAB, (n, SEQ), generator=g),
            )
            for _ in range(sc.gas)
        ]
        for _ in range(sc.steps)
    ]


def build(sc: TPScenario) -> nn.Module:
    if sc.model == "gpt":
        return gpt_model()
    model = TinyLlama()
    model.load_state_dict(llama_state())
    return model


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, eps=EPS, foreach=False)


def run_reference(sc: TPScenario) -> dict[str, Any]:
    """Single-process training on the global batch: step losses, norms, final parameters."""
    model = build(sc)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    losses, norms = [], []
    for step in batches(sc):
        idx = torch.cat([b[0] for b in step])
        tgt = torch.cat([b[1] for b in step])
        loss = model(idx, tgt)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, sc.clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


# --------------------------------------------------------------------------- rank jobs


def train(sc: TPScenario) -> dict[str, Any]:
    """Train ``sc`` on this rank: losses, per-step global norms, local shards, layout."""
    import ds_core
    from ds_core import comm
    from ds_core.tp import TP_ATTR

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
            loss = engine(idx[sl], tgt[sl])
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
    embed = {"layer_specs": [{"patterns": [r"model\.embed_tokens"], "partition_type": "row"}]}
    return {
        "no_match": attempt(TinyLlama, {"autotp_size": 2, "partition_config": bad_pattern}),
        "embedding": attempt(TinyLlama, {"autotp_size": 2, "partition_config": embed}),
        "heads": attempt(odd_heads, {"autotp_size": 2}),
        "checkpoint": checkpoint,
    }


def jobs(world: int) -> dict[str, Callable[[], dict[str, Any]]]:
    out: dict[str, Callable[[], dict[str, Any]]] = {
        name: (lambda sc=sc: train(sc)) for name, sc in scenarios(world).items()
    }
    if world == 2:
        out["refusals"] = refusals
    return out
