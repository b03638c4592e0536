"""Print measured bytes per step and model-state bytes per rank, per stage, against the formulas.

    python -m tests.zero._report            # 2 gloo ranks on the CPU backend

Runs the ``accounting`` and ``resident`` worker suites (the same jobs the tests check) and
prints one table each. Ψ is the bytes of one full fp32 gradient.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.rankpool import RankPools
from tests.zero.conftest import run_suite

N = 2
MiB = 2**20
BYTES_FORMULA = {0: "2Ψ", 1: "2Ψ", 2: "2Ψ (+Ψ per extra micro-batch)", 3: "3Ψ per micro-batch"}
MEM_FORMULA = {0: 4 + 4 + 8, 1: 4 + 4 + 8 / N, 2: 4 + (4 + 8) / N, 3: (4 + 4 + 8) / N}


def main() -> None:
    pools = RankPools()
    with tempfile.TemporaryDirectory() as tmp:
        for sub in ("a", "r"):
            (Path(tmp) / sub).mkdir()
        acc = run_suite(pools, Path(tmp) / "a", "accounting", N, "cpu")
        res = run_suite(pools, Path(tmp) / "r", "resident", N, "cpu")
        counts = acc.ranks("bytes")[0]
        memory = acc.ranks("memory")[0]
        resident = res.ranks("resident")
    pools.close()
    print(
        f"bytes communicated per optimizer step, rank 0 of {N} (logical: docs/architecture.md §3.4)"
    )
    print(f"{'stage':>5} {'GAS':>3} {'Ψ (bytes)':>10} {'measured':>34} {'total/Ψ':>8}  formula")
    for stage in range(4):
        for gas in (1, 2):
            got = counts[f"s{stage}_gas{gas}"]
            psi = got["psi"]
            detail = " + ".join(f"{op} {b}" for op, b in sorted(got["bytes"].items()))
            total = sum(got["bytes"].values())
            print(
                f"{stage:>5} {gas:>3} {psi:>10} {detail:>34} {total / psi:>8.2f}  "
                f"{BYTES_FORMULA[stage]}"
            )
    print(f"\nmodel-state bytes per rank (fp32 AdamW, N={N}), engine buffers after 2 and 100 steps")
    print(f"{'stage':>5} {'Ψ (params)':>10} {'measured':>10} {'formula':>10} {'ratio':>6}  parts")
    for stage in range(4):
        got = memory[f"s{stage}"]
        psi = got["psi"]
        expected = MEM_FORMULA[stage] * psi
        parts = ", ".join(f"{k} {v}" for k, v in got["early"].items() if k != "total")
        print(
            f"{stage:>5} {psi:>10} {got['early']['total']:>10} {expected:>10.0f} "
            f"{got['early']['total'] / expected:>6.3f}  {parts}; unchanged at step 100: "
            f"{got['late'] == got['early']}"
        )
    print("\nbf16 model states per rank: params 2 + fp32 master 4 + fp32 grads 4 + moments 8")
    print(
        "(the paper's 16-bit formula has 2-byte gradients; ds_core accumulates in fp32: docs/architecture.md §3.2)"
    )
    print(f"{'stage':>5} {'measured':>10} {'engine formula':>14} {'paper formula':>13}")
    paper16 = {0: 16, 1: 4 + 12 / N, 2: 2 + 14 / N, 3: 16 / N}
    ours16 = {0: 18, 1: 2 + 4 + 12 / N, 2: 2 + 16 / N, 3: 18 / N}
    for stage in range(4):
        got = memory[f"bf16_s{stage}"]
        print(
            f"{stage:>5} {got['early']['total']:>10} {ours16[stage] * got['psi']:>14.0f} "
            f"{paper16[stage] * got['psi']:>13.0f}"
        )
    print("\nresident growth through the memory hooks (MALLOC_MMAP_THRESHOLD_=65536), MiB")
    print(f"{'stage':>5} {'rank':>4} {'measured':>9} {'formula':>8} {'buffers':>8}")
    for stage in range(4):
        for rank, r in enumerate(resident):
            expected = MEM_FORMULA[stage] * r["psi"]
            print(
                f"{stage:>5} {rank:>4} {r[f's{stage}']['rss'] / MiB:>9.1f} {expected / MiB:>8.1f} "
                f"{r[f's{stage}']['buffers'] / MiB:>8.1f}"
            )
    for rank, r in enumerate(resident):
        print(
            f"rank {rank}: after each of 20 engine create/destroy cycles "
            f"{[round(x / MiB) for x in r['after_destroy']]} MiB; "
            f"every 10 of 100 steps {[round(x / MiB) for x in r['drift']]} MiB"
        )


if __name__ == "__main__":
    main()
