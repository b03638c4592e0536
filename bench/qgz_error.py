"""qgZ's gradient error, per step, against the exact mean: ds_core's quantized reduce-scatter
and DeepSpeed 0.19.8's ``all_to_all_quant_reduce`` side by side, on the same gradients.

One process, no collectives: ``world`` ranks' gradients of the small GPT (each rank its own
batches, as ``bench/compression.py`` draws them) at steps along an Adam run of the mean
gradient (lr 3e-4, clipping 1.0), and both algorithms' arithmetic applied to them:

- **ds_core** (``ds_core/comm/quantized.py`` ``quantized_reduce_scatter``): stage 3's flat unit
  of each module (its own parameters, concatenated, padded to ``world``), each rank's chunk
  of it block-quantized (15 levels at 4 bits) inside the node, summed in fp32, re-quantized at
  8 bits across nodes, summed again. It runs the module's own ``quantize``/``dequantize``, so
  its arithmetic is the engine's. Blocks (``--blocks``): ``engine``, the engine's rule
  (``ds_core/zero/zeropp.py`` ``qgz_block``: DeepSpeed's group, units of 1-D parameters
  exact), or a fixed size for every unit (2048 was the engine's before that rule).
- **DeepSpeed** (``deepspeed/runtime/comm/coalesced_collectives.py``
  ``all_to_all_quant_reduce``, called by ``deepspeed/runtime/zero/stage3.py``
  ``__avg_scatter_grads`` only when there is more than one node; kernels in
  ``ops/csrc/quantization/swizzled_quantize.cu`` and ``quant_reduce.cu``): each parameter
  separately; 1-D ones (biases, norms) and those whose size ``2 × world`` does not divide go
  through the plain reduce-scatter; the others in groups of ``numel / max(rows, cols, world)``
  elements (``intra_quant_group`` is a group *count*), 4 bits in both phases with the kernel's
  rounding (``quantization_utils.h``: scale ``16 / (2 absmax)``, codes clamped to [-8, 7], so
  a block's largest positive value loses up to an eighth), summed in fp32 here (the kernel
  sums in fp16), the result the sum over nodes divided by the node count.

Printed per step: the relative L2 error of the reduced gradient (``‖q − exact‖ / ‖exact‖``,
both scaled to the mean over ranks), the share of elements whose sign the result gets wrong
or zeroes (where Adam, which divides by each element's own scale, moves the wrong way), and
the same two for the 1-D parameters alone.

``python bench/qgz_error.py`` (about 2 minutes here); ``--worlds``, ``--steps``, ``--blocks``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_core.comm.quantized import dequantize, quantize  # noqa: E402
from ds_core.zero.zeropp import qgz_block  # noqa: E402
from examples.gpt import GPT, PRESETS, Batches, encode, make_corpus  # noqa: E402

SEED, LR, CLIP = 1234, 3e-4, 1.0


def roundtrip(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """ds_core's block quantization of each row of ``x`` and back."""
    codes, scales = quantize(x, bits, block)
    return dequantize(codes, scales, bits, x.shape[1], block)


def ours(grads: list[list[torch.Tensor]], units: list[list[int]], local: int, blocks: str) -> list:
    """ds_core's qgZ arithmetic: per flat unit, returns the reduced mean of every parameter."""
    world = len(grads)
    nodes = world // local
    out: list[torch.Tensor | None] = [None] * len(grads[0])
    for unit in units:
        shapes = [tuple(grads[0][i].shape) for i in unit]
        block = qgz_block(shapes, world) if blocks == "engine" else int(blocks)
        if not block:  # reduced exactly
            for i in unit:
                out[i] = torch.stack([g[i] for g in grads]).mean(dim=0)
            continue
        flats = [torch.cat([g[i].flatten() for i in unit]) for g in grads]
        n = flats[0].numel()
        part = -(-n // world)
        padded = [
            torch.nn.functional.pad(f, (0, part * world - n)).view(world, part) for f in flats
        ]
        total = torch.zeros(world, part)
        for dest in range(world):  # the rank that ends with chunk dest
            node_sums = []
            for node in range(nodes):
                rows = torch.stack([padded[node * local + i][dest] for i in range(local)])
                partial = roundtrip(rows, 4, block).sum(dim=0, keepdim=True)
                node_sums.append(roundtrip(partial, 8, block) if nodes > 1 else partial)
            total[dest] = torch.cat(node_sums).sum(dim=0)
        flat = total.flatten()[:n] / world
        offset = 0
        for i in unit:
            k = grads[0][i].numel()
            out[i] = flat[offset : offset + k].view_as(grads[0][i])
            offset += k
    return out


def ds_roundtrip(x: torch.Tensor, group: int) -> torch.Tensor:
    """DeepSpeed's symmetric 4-bit group quantization of the flat ``x`` and back."""
    g = x.view(-1, group)
    absmax = g.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, 16 / (2 * absmax), torch.ones_like(absmax))
    return ((g * scale).round().clamp(-8, 7) / scale).view(-1)


def deepspeed(grads: list[list[torch.Tensor]], local: int) -> list[torch.Tensor]:
    """DeepSpeed 0.19.8's qgZ arithmetic on each parameter, scaled to the mean over ranks."""
    world = len(grads)
    nodes = world // local
    out = []
    for i, g0 in enumerate(grads[0]):
        exact = torch.stack([g[i] for g in grads]).mean(dim=0)
        if nodes == 1 or g0.dim() == 1 or g0.numel() % (2 * world):
            out.append(exact)  # the plain reduce-scatter
            continue
        group = g0.numel() // max(g0.shape[0], g0.shape[1], world)
        # quantizing the whole tensor in groups is quantizing each rank's chunk: groups never
        # straddle chunks (numel / world is a multiple of the group)
        q = [ds_roundtrip(g[i].flatten(), group) for g in grads]
        partial = [sum(q[node * local + j] for j in range(local)) for node in range(nodes)]
        total = sum(ds_roundtrip(p, group) for p in partial)
        out.append((total / world).view_as(g0))
    return out


def compare(approx: list[torch.Tensor], exact: list[torch.Tensor], names: list[str]) -> str:
    def stats(idx: list[int]) -> tuple[float, float]:
        a = torch.cat([approx[i].flatten() for i in idx])
        e = torch.cat([exact[i].flatten() for i in idx])
        rel = float((a - e).norm() / e.norm())
        wrong = float(((torch.sign(a) != torch.sign(e)) & (e != 0)).float().mean())
        return rel, wrong

    every = list(range(len(names)))
    one_d = [i for i in every if exact[i].dim() == 1]
    (r, w), (r1, w1) = stats(every), stats(one_d)
    return f"rel {r:6.3f} sign lost {w:6.1%} | 1-D: rel {r1:6.3f} sign lost {w1:6.1%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--steps", default="0,30,100,200")
    p.add_argument("--blocks", default="2048,engine", help="ds_core blocks to compare")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the quantizer op of the CPU backend
    torch.set_num_threads(1)
    tokens = encode(make_corpus())
    checkpoints = sorted(int(s) for s in args.steps.split(","))
    for world in (int(w) for w in args.worlds.split(",")):
        local = world // 2 if world >= 4 else world
        torch.manual_seed(SEED)
        model = GPT(PRESETS["small"])
        names = [n for n, _ in model.named_parameters()]
        index = {id(q): i for i, q in enumerate(model.parameters())}
        units = [
            [index[id(q)] for q in m.parameters(recurse=False)]
            for m in model.modules()
            if any(True for _ in m.parameters(recurse=False))
        ]
        batches = [Batches(tokens, 8, 64, seed=SEED, rank=r) for r in range(world)]
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        print(f"world {world} = {world // local} node(s) x {local}")
        for step in range(checkpoints[-1] + 1):
            grads = []
            for data in batches:
                model.zero_grad()
                model(*data.next()).backward()
                grads.append([q.grad.detach().clone() for q in model.parameters()])  # type: ignore[union-attr]
            exact = [torch.stack(gs).mean(dim=0) for gs in zip(*grads, strict=True)]
            if step in checkpoints:
                for block in args.blocks.split(","):
                    line = compare(ours(grads, units, local, block), exact, names)
                    print(f"  step {step:>3} ds_core block {block:>6}: {line}", flush=True)
                line = compare(deepspeed(grads, local), exact, names)
                print(f"  step {step:>3} DeepSpeed 0.19.8  : {line}", flush=True)
            for q, e in zip(model.parameters(), exact, strict=True):
                q.grad = e
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()


if __name__ == "__main__":
    main()
