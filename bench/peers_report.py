"""bench/zero_vs_peers.py's configurations, the record of one run, and the table it prints
(step time, memory and communication against the ZeRO formulas, ratios against the peers).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import Any

PEERS = ("ddp", "zero_opt", "fsdp2")
DS_STAGES = ("ds0", "ds1", "ds2", "ds3", "ds3_block", "ds3_default")
OFFLOAD = ("ds1_off", "ds2_off", "ds3_off", "ds3_param", "ds3_off_param", "ds2_nvme", "ds3_nvme")
OFFLOAD += ("ds3_param_nvme", "ds3_off_param_nvme")


def zero_formula_bytes(n_params: int, stage: int, world: int) -> float:
    """ZeRO model-state bytes per rank in fp32: params 4, grads 4, Adam moments 8 per parameter."""
    p, g, o = 4.0 * n_params, 4.0 * n_params, 8.0 * n_params
    return {0: p + g + o, 1: p + g + o / world, 2: p + (g + o) / world, 3: (p + g + o) / world}[
        stage
    ]


def expected_comm_bytes(n_params: int, stage: int) -> float:
    """The paper's logical bytes per step: 2Ψ (stages 0-2), 3Ψ (stage 3), Ψ in bytes (fp32)."""
    return (3 if stage == 3 else 2) * 4.0 * n_params


@dataclass
class RunResult:
    name: str
    step_s: list[float] = field(default_factory=list)  # slowest rank's wall time per step
    cpu_s: list[float] = field(default_factory=list)  # mean over ranks of CPU time per step
    peak_above_baseline: list[int] = field(default_factory=list)  # per rank
    state_bytes: list[int] = field(default_factory=list)  # per rank
    logical_per_step: float = 0.0  # per rank
    wire_per_step: float = 0.0  # per rank, mean
    losses: list[float] = field(default_factory=list)  # mean over ranks, per measured step
    error: str | None = None


def config_stage(name: str) -> int:
    """The ZeRO stage a configuration corresponds to (DDP 0, ZeroRedundancyOptimizer 1, FSDP2 3)."""
    peers = {"ddp": 0, "zero_opt": 1, "fsdp2": 3}
    name = name.partition("+")[0]
    return peers[name] if name in peers else int(name[2])


MiB = 2**20


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _floor_medians(
    floors: dict[str, list[RunResult]],
) -> tuple[dict[str, float | str], dict[str, float]]:
    """Median step ms and CPU ms of each configuration's world-size-1 runs (step: or why it
    has none)."""
    wall: dict[str, float | str] = {}
    cpu: dict[str, float] = {}
    for name, results in floors.items():
        ok = [r for r in results if r.error is None]
        steps = [s for r in ok for s in r.step_s]
        wall[name] = statistics.median(steps) * 1e3 if steps else "failed"
        if steps:
            cpu[name] = statistics.median(s for r in ok for s in r.cpu_s) * 1e3
    return wall, cpu


def summarize(
    runs: dict[str, list[RunResult]],
    args: argparse.Namespace,
    n_params: int,
    host_bytes: dict[str, int],
    floors: dict[str, list[RunResult]] | None = None,
) -> str:
    """The table and ratios, as text; ``host_bytes``: offload runs' host-side model-state
    bytes on rank 0, by configuration; ``floors``: each configuration's runs at world size 1
    (the no-communication floor), by configuration."""
    world = args.world
    tokens_per_step = args.micro_batch * args.seq * world
    rows: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        ok = [r for r in results if r.error is None]
        if not ok:
            rows[name] = {"error": results[0].error if results else "not run"}
            continue
        steps = [s for r in ok for s in r.step_s]
        med = statistics.median(steps)
        stage = config_stage(name)
        rows[name] = {
            "stage": stage,
            "median_s": med,
            "p10_s": _pct(steps, 0.1),
            "p90_s": _pct(steps, 0.9),
            "cpu_s": statistics.median(s for r in ok for s in r.cpu_s),
            "tok_s": tokens_per_step / med,
            "peak_mib": [max(r.peak_above_baseline[i] for r in ok) / MiB for i in range(world)],
            "state": max(max(r.state_bytes) for r in ok),
            "logical": statistics.median(r.logical_per_step for r in ok),
            "wire": statistics.median(r.wire_per_step for r in ok),
            "loss": ok[-1].losses[-1],
            "runs": len(ok),
        }
    formula_stage = {"ddp": 0, "zero_opt": 1, "fsdp2": 3}
    lines = []
    head = (
        f"{'config':<13} {'step ms':>8} {'p10-p90 ms':>13} {'cpu ms':>7} {'tok/s':>7} "
        f"{'peak MiB/rank':>14} {'pk/form':>7} {'state MiB':>9} {'formula':>8} {'st/form':>7} "
        f"{'comm MiB':>8} {'/ideal':>6} {'wire MiB':>8} {'loss':>9} {'Δ vs DDP':>9}"
    )
    lines += [head, "-" * len(head)]
    ddp = rows.get("ddp", {})
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"{name:<13} not measured: {r['error']}")
            continue
        stage = formula_stage.get(name, r["stage"])
        formula = zero_formula_bytes(n_params, stage, world)
        ideal = expected_comm_bytes(n_params, r["stage"])
        dloss = f"{(r['loss'] - ddp['loss']) / abs(ddp['loss']):+.1e}" if "loss" in ddp else "n/a"
        lines.append(
            f"{name:<13} {r['median_s'] * 1e3:>8.1f} "
            f"{r['p10_s'] * 1e3:>6.0f}-{r['p90_s'] * 1e3:<6.0f} {r['cpu_s'] * 1e3:>7.1f} "
            f"{r['tok_s']:>7.0f} {'/'.join(f'{m:.0f}' for m in r['peak_mib']):>14} "
            f"{max(r['peak_mib']) * MiB / formula:>7.2f} "
            f"{r['state'] / MiB:>9.1f} {formula / MiB:>8.1f} {r['state'] / formula:>7.2f} "
            f"{r['logical'] / MiB:>8.1f} {r['logical'] / ideal:>6.2f} {r['wire'] / MiB:>8.1f} "
            f"{r['loss']:>9.5f} {dloss:>9}"
        )
    lines.append("")
    lines.append(
        "formula: ZeRO fp32 model states per rank (zero_opt as stage 1, fsdp2 as stage 3); "
        "pk/form: peak during the measured steps over it; "
        "/ideal: logical bytes over 2Ψ (stages 0-2) or 3Ψ (stage 3)"
    )
    best_peer = {0: "ddp", 1: "zero_opt", 2: "zero_opt", 3: "fsdp2"}
    floor_ms, floor_cpu = _floor_medians(floors or {})
    lines.append("")
    lines.append(
        f"{'config':<13} {'time/DDP':>9} {'time/peer':>10} {'peer':>9} {'cpu/DDP':>8} "
        f"{'floor ms':>9} {'time/floor':>10} {'time/ddpfl':>10} {'cpu/floor':>9}"
    )
    for name, r in rows.items():
        if "error" in r:
            continue
        peer = best_peer[r["stage"]] if name in DS_STAGES else name
        if name in OFFLOAD:
            peer = name[:3]  # the same stage without offload
        pr = rows.get(peer, {})
        vs_peer = f"{r['median_s'] / pr['median_s']:.2f}" if "median_s" in pr else "n/a"
        vs_ddp = f"{r['median_s'] / ddp['median_s']:.2f}" if "median_s" in ddp else "n/a"
        cpu_ddp = f"{r['cpu_s'] / ddp['cpu_s']:.2f}" if "cpu_s" in ddp else "n/a"
        own = floor_ms.get(name)
        ddp_floor = floor_ms.get("ddp")
        fl = f"{own:.1f}" if isinstance(own, float) else (own or "n/a")
        vs_floor = f"{r['median_s'] * 1e3 / own:.2f}" if isinstance(own, float) else "n/a"
        vs_ddpfl = (
            f"{r['median_s'] * 1e3 / ddp_floor:.2f}" if isinstance(ddp_floor, float) else "n/a"
        )
        cpu_floor = f"{r['cpu_s'] * 1e3 / floor_cpu[name]:.2f}" if name in floor_cpu else "n/a"
        lines.append(
            f"{name:<13} {vs_ddp:>9} {vs_peer:>10} {peer:>9} {cpu_ddp:>8} "
            f"{fl:>9} {vs_floor:>10} {vs_ddpfl:>10} {cpu_floor:>9}"
        )
    if floor_ms:
        lines.append(
            "floor: the configuration alone at world size 1 (same micro-batch, 1 thread, same "
            "engine), median step ms; time/ddpfl: over DDP's floor (plain torch, no "
            "communication); the ddp row's time/floor is DDP/floor; cpu/floor: CPU seconds per "
            "step per rank over the floor's"
        )
    for name in OFFLOAD:
        if name in rows and "state" in rows[name] and name[:3] in rows and name in host_bytes:
            dev, base = rows[name]["state"], rows[name[:3]].get("state", 0)
            lines.append(
                f"{name}: device model states {dev / MiB:.1f} MiB vs {base / MiB:.1f} MiB "
                f"without offload ({(base - dev) / MiB:.1f} MiB saved, {dev / base:.2f}x); "
                f"host {host_bytes[name] / MiB:.1f} MiB (rank 0)"
            )
    return "\n".join(lines)
