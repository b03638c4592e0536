"""Activation memory of the GPT example with and without ``ds_core.checkpointing.checkpoint``.

Run: ``python bench/activation_checkpointing.py [--preset small --batch 8 --seq 128]``
(seconds on a CPU). For one forward of examples/gpt.py's model, every block either run plainly
or through ``checkpointing.checkpoint(block, x)``, it prints side by side:

- ``kept``: bytes of the tensors autograd keeps for backward (each storage once: what the
  graph saves, counted by a ``saved_tensors_hooks`` pack hook, plus the inputs a checkpoint
  keeps to recompute from);
- ``kept/layer``: the same per transformer block;
- ``allocated``: the accelerator's ``memory_allocated()`` after forward less before (on a
  GPU, the allocator's exact figure; on cpu the process's resident set, coarse);

and the ratios checkpointed / plain. It prints and never asserts.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, PRESETS

from ds_core import checkpointing, get_accelerator


def _nbytes(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def measure(model: GPT, idx: torch.Tensor, tgt: torch.Tensor, ckpt: bool) -> dict[str, Any]:
    acc = get_accelerator()
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, size = _nbytes(t)
        seen[key] = size
        return t

    def run_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not ckpt:
            return block(x)
        key, size = _nbytes(x)  # the checkpoint keeps its input to recompute from
        seen[key] = size
        return checkpointing.checkpoint(block, x)

    gc.collect()
    before = acc.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = model.wte(idx) + model.wpe(pos)
        for block in model.blocks:
            x = run_block(block, x)
        logits = model.lm_head(model.ln_f(x))
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(), tgt.view(-1))
    after = acc.memory_allocated()
    params = {_nbytes(p)[0] for p in model.parameters()}
    kept = sum(size for key, size in seen.items() if key not in params)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {"kept": kept, "allocated": after - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    acc = get_accelerator()
    device = acc.device()
    torch.manual_seed(0)
    cfg = PRESETS[args.preset]
    model = GPT(cfg).to(device)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    tgt = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    plain = measure(model, idx, tgt, ckpt=False)
    ck = measure(model, idx, tgt, ckpt=True)
    mib = 2**20
    print(
        f"GPT {args.preset} ({cfg.n_layer} layers, n_embd {cfg.n_embd}), batch {args.batch} x "
        f"seq {args.seq}, accelerator {acc.name}"
    )
    print(f"{'':14}{'plain':>14}{'checkpointed':>14}{'ratio':>8}")
    for key, label in (("kept", "kept MiB"), ("allocated", "allocated MiB")):
        a, b = plain[key] / mib, ck[key] / mib
        ratio = f"{b / a:.3f}" if a else "n/a"
        print(f"{label:14}{a:14.2f}{b:14.2f}{ratio:>8}")
    per_a, per_b = plain["kept"] / cfg.n_layer / mib, ck["kept"] / cfg.n_layer / mib
    print(f"{'kept/layer MiB':14}{per_a:14.2f}{per_b:14.2f}{per_b / per_a:8.3f}")


if __name__ == "__main__":
    main()
