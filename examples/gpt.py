# Tensor names carry shape suffixes (x_BTC), which the naming rules would flag.
# ruff: noqa: N803, N806, N812
"""A small GPT decoder and its data, shared by examples/train_gpt.py and the benchmarks in bench/.

Shapes: B batch, T sequence (time), C embedding channels, H heads, V vocabulary.

The corpus is generated, not downloaded: sentences from a small grammar, so the text has
structure a model can learn in a few hundred steps (the loss falls from ln(30) ≈ 3.4 to well
under 2) and every machine builds exactly the same bytes from a seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``n_params()`` of the built model is about ``12 · n_layer · n_embd²``."""

    vocab_size: int = 32  # the corpus alphabet (30 characters), rounded up
    block_size: int = 128  # longest sequence the position table covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    n_experts: int = 0  # > 0: the MoE variant (every block's MLP is a mixture of experts)
    top_k: int = 2  # experts per token in the MoE variant


#: named sizes used by the example and the benchmarks; parameter counts at vocab 32
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64),  # ≈ 0.1 M parameters, for tests
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=256),  # ≈ 3.2 M, the example's default
    "medium": GPTConfig(n_layer=6, n_head=6, n_embd=384),  # ≈ 10.7 M
    "large": GPTConfig(n_layer=8, n_head=8, n_embd=768),  # ≈ 56.8 M, states dominate memory
}


def causal_attention(
    q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor
) -> torch.Tensor:
    """Causal softmax attention on batch-first ``(B, T, H, C/H)`` tensors, same layout out."""
    q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BTHD, v_BTHD))  # (B, H, T, C/H)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. ``attention`` is the hook point for parallel
    attention: any callable ``(q, k, v) -> y`` on ``(B, T, H, C/H)`` tensors (default
    :func:`causal_attention`); :func:`use_sequence_parallel` puts Ulysses' there."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attention: Callable[..., torch.Tensor] = causal_attention

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        # Widths come from the projection, not the input: under AutoTP (--tp) ``qkv`` holds
        # this rank's slice of each of q, k, v and ``n_head`` is the local head count.
        q, k, v = self.qkv(x_BTC).chunk(3, dim=2)
        C = q.shape[-1]
        # (B, T, C) -> (B, T, H, C/H)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in (q, k, v))
        y = self.attention(q, k, v)  # (B, T, H, C/H)
        return self.proj(y.contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x_BTC)))


class MoEMLP(nn.Module):
    """The MoE variant's MLP: a router ``gate`` and ``n_experts`` MLPs; each token goes to its
    ``top_k`` experts, weighted by their softmax probabilities renormalised over the chosen
    ones. Written plainly (a loop over experts) so the unconverted model is the reference;
    ``--ep`` (AutoEP) spreads the experts over ranks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, True
        self.gate = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_NC = x_BTC.reshape(-1, x_BTC.shape[-1])
        probs_NE = F.softmax(self.gate(x_NC), dim=-1, dtype=torch.float)
        w_NK, e_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        w_NK = (w_NK / w_NK.sum(dim=-1, keepdim=True)).to(x_NC.dtype)
        out_NC = torch.zeros_like(x_NC)
        for e, expert in enumerate(self.experts):
            n, k = torch.where(e_NK == e)
            out_NC = out_NC.index_add(0, n, expert(x_NC[n]) * w_NK[n, k, None])
        return out_NC.view_as(x_BTC)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp: nn.Module = MoEMLP(cfg) if cfg.n_experts > 0 else MLP(cfg)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln_1(x_BTC))
        return x_BTC + self.mlp(self.ln_2(x_BTC))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        # Not tied to wte: ZeRO partitions by parameter, and a tied weight would be the one
        # parameter two modules share, a special case this example does not need.
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        #: the sequence-parallel group the loss spans (:func:`use_sequence_parallel`), or None.
        self.sp_group: Any = None
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor, pos_offset: int = 0
    ) -> torch.Tensor:
        """Mean cross-entropy (nats per token) of ``idx_BT``'s next tokens; ``pos_offset``: the
        position of its first token (a sequence-parallel rank's shard starts inside the
        sequence). Under :func:`use_sequence_parallel` the mean is over the full sequences of
        the SP group, the same on every SP rank, as DeepSpeed expects."""
        B, T = idx_BT.shape
        pos = torch.arange(pos_offset, pos_offset + T, device=idx_BT.device)
        x_BTC = self.wte(idx_BT) + self.wpe(pos)
        for block in self.blocks:
            x_BTC = block(x_BTC)
        logits_BTV = self.lm_head(self.ln_f(x_BTC))
        if self.sp_group is not None:
            from ds_core.parallel.sequence import sequence_parallel_cross_entropy

            return sequence_parallel_cross_entropy(logits_BTV, targets_BT, self.sp_group)
        return F.cross_entropy(logits_BTV.view(B * T, -1).float(), targets_BT.reshape(-1))


def use_sequence_parallel(model: GPT, group: Any) -> None:
    """Ulysses sequence parallelism over ``group`` (``engine.mesh.sp_group``): every block's
    attention exchanges sequence shards for head shards around :func:`causal_attention`
    (:class:`ds_core.sequence.layer.DistributedAttention`). Each rank then feeds its shard of
    every sequence (``ds_core.parallel.sequence.shard_sequence``) with ``pos_offset`` its
    first position (``shard_offset``); its loss is the mean over the full sequences
    (``sequence_parallel_cross_entropy``), whose gradient reaches only its own shard's logits,
    so the engine's sum over the SP ranks is the full batch's gradient (DeepSpeed's
    convention). ``n_head`` must be a multiple of the group's size; ``group`` ``None`` (SP size
    1) leaves the model as it is."""
    from ds_core.sequence.layer import DistributedAttention

    if group is None:  # the mesh's group at SP size 1; as a group, None would be the world
        return
    model.sp_group = group

    for block in model.blocks:
        block.attn.attention = partial(
            DistributedAttention(causal_attention, group), batch_dim_idx=0
        )


class GPTEmbed(nn.Module):
    """The pipeline's first layer: token plus position embeddings, ``(B, T) -> (B, T, C)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.apply(GPT._init_weights)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx_BT.shape[1], device=idx_BT.device)
        return self.wte(idx_BT) + self.wpe(pos)


class PipelineBlock(Block):
    """A :class:`Block` initialised as :class:`GPT` initialises its blocks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.apply(GPT._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))


class GPTHead(nn.Module):
    """The pipeline's last layer: final norm and vocabulary projection, ``-> (B, T, V)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(GPT._init_weights)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x_BTC))


def next_token_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits_BTV`` against ``targets_BT`` (the pipeline's loss_fn)."""
    return F.cross_entropy(
        logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), targets_BT.reshape(-1)
    )


def pipeline_layers(cfg: GPTConfig) -> list[Any]:
    """The GPT as a layer list for :class:`ds_core.pipe.PipelineModule` (embeddings, blocks,
    head), each built on the stage that holds it; with ``seed_layers`` every layer's initial
    values are the same whatever the number of stages."""
    from ds_core.pipe import LayerSpec

    return [
        LayerSpec(GPTEmbed, cfg),
        *(LayerSpec(PipelineBlock, cfg) for _ in range(cfg.n_layer)),
        LayerSpec(GPTHead, cfg),
    ]


# ------------------------------------------------------------------------------------- data

_SUBJECTS = ["the cat", "a dog", "the old sailor", "my sister", "the engine", "a small bird",
             "the teacher", "every child", "the river", "our neighbour"]  # fmt: skip
_VERBS = ["sees", "follows", "builds", "paints", "carries", "remembers", "watches", "finds",
          "loves", "counts"]  # fmt: skip
_OBJECTS = ["the red boat", "a quiet garden", "seven stones", "the long road", "a green apple",
            "the morning light", "two letters", "the broken clock", "a warm loaf",
            "the open window"]  # fmt: skip
_TAILS = ["", " at night", " in the rain", " near the sea", " every day", " with care",
          " before dinner", " without a word"]  # fmt: skip

#: the alphabet: index 0 is a newline, then the characters the grammar can produce
ALPHABET = "\n .,abcdefghijklmnopqrstuvwxyz"


def make_corpus(n_chars: int = 400_000, seed: int = 1234) -> str:
    """Sentences from a small grammar, ``n_chars`` long, identical for a given seed."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_chars:
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
            f"{rng.choice(_TAILS)}{rng.choice(['.', ',', '.'])}"
            f"{chr(10) if rng.random() < 0.2 else ' '}"
        )
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:n_chars]


def encode(text: str) -> torch.Tensor:
    """Character ids (int64) of ``text``; every character must be in :data:`ALPHABET`."""
    table = {c: i for i, c in enumerate(ALPHABET)}
    return torch.tensor([table[c] for c in text], dtype=torch.long)


class Batches:
    """Random (input, target) windows of a token stream, the same on every run for a seed.

    Each rank draws its own batches (``seed`` is offset by ``rank``), so data-parallel ranks
    see different samples, as a distributed sampler would give them; they are returned on
    ``device`` (the accelerator's).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch: int,
        seq: int,
        seed: int,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ):
        self.tokens, self.batch, self.seq, self.device = tokens, batch, seq, torch.device(device)
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.seq - 1, (self.batch,), generator=self.gen)
        x_BT = torch.stack([self.tokens[s : s + self.seq] for s in starts.tolist()])
        y_BT = torch.stack([self.tokens[s + 1 : s + 1 + self.seq] for s in starts.tolist()])
        # drawn on the host (the same stream on every backend), then moved to the device
        return x_BT.to(self.device), y_BT.to(self.device)
